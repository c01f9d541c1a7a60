"""The one tensor checksum: MD5 of a tensor's raw bytes (row-major, contiguous, host order).

Every checksum in the project goes through here: checkpoint and weight-sync integrity,
alignment records, training-state digests, determinism checks. Shape and dtype are not part
of a tensor's hash; `named_md5` adds each name so that moved or missing entries change it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def update(h, t: torch.Tensor) -> None:
    """Feed the raw bytes of `t` (any dtype: float8, bfloat16, bool; 0-dim, empty) to `h`."""
    # A copy, also on the host: numpy() would make the tensor's storage non-resizable for good
    # (colocation frees storages by resizing them).
    flat = t.detach().reshape(-1).to("cpu", copy=True).contiguous()
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    h.update(flat.numpy().tobytes())


def tensor_md5(t: torch.Tensor) -> str:
    """MD5 hex digest of the raw bytes of `t`."""
    h = hashlib.md5(usedforsecurity=False)
    update(h, t)
    return h.hexdigest()


def named_md5(items: Iterable[tuple[str, torch.Tensor | None]]) -> str:
    """One MD5 over (name, bytes) of every tensor, in the order given; None entries skipped."""
    h = hashlib.md5(usedforsecurity=False)
    for name, t in items:
        if t is not None:
            h.update(name.encode())
            update(h, t)
    return h.hexdigest()
