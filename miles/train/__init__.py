"""Megatron-core training backend (runs inside TrainWorker actors)."""
