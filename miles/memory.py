"""Moving tensors between the host and the device: one copy without a wait, and a whole
device memory out to the host and back, in place.

Colocated training and generation share a GPU: whichever side is idle frees its device
memory. The storages are resized to zero (every view, optimizer reference and cache view
stays valid) and refilled bit for bit later.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """t on `device` (None: as it is); from the host to a GPU through pinned memory, so the host
    does not wait for the copy (nor for the GPU's queue before it)."""
    if device is None:
        return t
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":  # the pinned copy lives until the transfer ends
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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


def device_memory(device: torch.device | str | None) -> dict[str, float]:
    """This process's peak of allocated device memory since the last call (GB; the peak is
    reset) and the whole device's memory in use now (every process on it, CUDA contexts
    included). Read at a phase's end, the latter is the GPU's memory in that phase when
    trainer and engine share it. Empty off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_gb": peak, "device_used_gb": (total - free) / 1e9}


def phase_metrics(side: str, reports: list[dict[str, float]]) -> dict[str, float]:
    """perf/<side>_peak_gb and perf/<side>_device_used_gb: the largest over the side's
    processes (trainer ranks, engines); nothing where none reported (CPUs)."""
    reports = [r for r in reports if r]
    return {f"perf/{side}_{k}": max(r[k] for r in reports) for k in ("peak_gb", "device_used_gb") if reports}
