"""Datasets and samples."""
