"""The one tensor checksum: MD5 of a tensor's raw bytes (row-major, contiguous, host order).

Every checksum in the project goes through here: checkpoint and weight-sync integrity,
alignment records, training-state digests, determinism checks. Shape and dtype are not part
of a tensor's hash; `named_md5` adds each name so that moved or missing entries change it.
`fingerprint` is the one exception, for weights that never leave the device (a colocated
engine's CUDA-IPC sync): an order-sensitive integer sum of the bytes, computed where they are.
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


FINGERPRINT_CHUNK = 1 << 24  # 16-bit words per step: bounded int64 temporaries (128 MiB each)


@torch.no_grad()
def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """An integer of each tensor's raw bytes computed on its own device, one copy to the host
    for them all: their sum, and their sum weighted by position modulo 251, as 16-bit words
    (exact in int64 for tensors under 2**33 bytes), and the byte count. Catches a wrong offset,
    dtype, length or a torn copy, as the MD5 does, without the host copy the MD5 needs."""
    sums, sizes = [], []
    for t in tensors.values():
        b = t.detach().reshape(-1).contiguous().view(torch.uint8)
        if b.numel() % 2:
            b = torch.cat((b, b.new_zeros(1)))
        words = b.view(torch.int16)  # [n]
        acc = torch.zeros(2, dtype=torch.int64, device=b.device)
        for i in range(0, words.numel(), FINGERPRINT_CHUNK):
            w = words[i: i + FINGERPRINT_CHUNK].long()
            pos = torch.arange(i, i + w.numel(), device=w.device) % 251 + 1
            acc += torch.stack((w.sum(), (w * pos).sum()))
        sums.append(acc)
        sizes.append(b.numel())
    if not sums:
        return {}
    both = torch.stack([x.to(sums[0].device) for x in sums]).cpu().tolist()  # [tensors, 2]
    return {k: s * 2**40 + ws + n for k, (s, ws), n in zip(tensors, both, sizes, strict=True)}


def fingerprint(t: torch.Tensor) -> int:
    """fingerprints() of one tensor."""
    return fingerprints({"": t})[""]
