"""Observation: metrics, alignment records, plots."""
