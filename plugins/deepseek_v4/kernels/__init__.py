"""Triton kernels for DeepSeek-V4 (GPU path). The PyTorch functions in `ops` remain the CPU
path and the oracle. Importing this package needs triton; `available()` says whether the
kernels can run here (CUDA, or Triton's CPU interpreter when TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import os

import torch


def available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
