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


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
POISON_OUTPUTS = False  # tests: outputs start as NaN, so an element a kernel fails to write shows


def within_head_dim(block: str):
    """An autotune `early_config_prune` keeping configs whose D tile `block` fits the head
    dim D (BLOCK <= D; the candidate lists include a 16-wide tile, which fits every D)."""
    def prune(configs, nargs, **kwargs):
        d = kwargs.get("D", nargs.get("D"))
        return [c for c in configs if c.kwargs[block] <= d]
    return prune


def new_output(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output buffer (uninitialised, or NaN-filled under POISON_OUTPUTS)."""
    if POISON_OUTPUTS:  # integers: their most negative value; bool: True
        fill = (float("nan") if dtype.is_floating_point or dtype.is_complex else True if dtype == torch.bool
                else torch.iinfo(dtype).min)
        return torch.full(shape, fill, device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def tile_span(total: int, parts: int, tile: int) -> int:
    """Each of `parts` programs' share of `total` rows, rounded up to whole tiles (>= one)."""
    share = -(-max(total, 1) // parts)
    return -(-share // tile) * tile
