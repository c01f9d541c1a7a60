"""Moving tensors' device memory out to the host and back, in place.

Colocated training and generation share a GPU: whichever side is idle frees its device
memory. The storages are resized to zero (every view, optimizer reference and cache view
stays valid) and refilled bit for bit later.
"""

from __future__ import annotations

import torch


def unique_storages(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """One tensor per distinct, non-empty storage, in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(t)
    return out


def offload(tensors: list[torch.Tensor]) -> tuple[list, int]:
    """Copy each storage to (pinned, on CUDA) host memory and free it. Returns what `restore`
    needs and the bytes freed."""
    moved, freed = [], 0
    for t in unique_storages(tensors):
        s = t.untyped_storage()
        host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.untyped_storage().copy_(s)
        moved.append((s, host))
        freed += s.nbytes()
        s.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return moved, freed


def restore(moved: list) -> None:
    for s, host in moved:
        s.resize_(host.numel())
        s.copy_(host.untyped_storage())
