"""Deterministic mode: fixed seeds and deterministic algorithms (no atomics-based
reductions), so two identical runs give bit-identical losses and gradients."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def enable_deterministic(seed: int) -> None:
    """Seed every generator and make torch refuse nondeterministic kernels."""
    # cuBLAS reads this when its first handle is created; harmless on CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def disable_deterministic() -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
