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


FINGERPRINT_CHUNK = 1 << 24  # 16-bit words per pass: bounded int64 temporaries (128 MiB each)
_WRAP = 1 << 64
BOUNDS_CHUNK = 256  # span ends gathered at a time by the block path: [256, BLOCK] int64 temporaries


@torch.no_grad()
def packed_fingerprints(flat: torch.Tensor, spans: list[tuple[str, int, int]], kernel: bool | None = None
                        ) -> dict[str, int]:
    """fingerprints() of the tensors packed in one flat byte buffer, spans [(name, byte offset,
    bytes)] at even offsets, with zero bytes after an odd-sized tensor: prefix sums over the
    whole buffer at each span's ends (a weight-sync bucket holds ~100 tensors at a ~1B model;
    one set of kernels per tensor made the GPU sync host-bound), one copy to the host at the
    end. `kernel` (default: on CUDA): the sums of each block of the buffer in one read of its
    bytes (kernels/fingerprint.py) instead of torch's scans over int64 copies of it."""
    if not spans:
        return {}
    words = flat.reshape(-1).view(torch.uint8).view(torch.int16)  # [N]
    dev = words.device
    first = [off // 2 for _, off, _ in spans]
    last = [off // 2 + -(-nbytes // 2) for _, off, nbytes in spans]  # one past each tensor's words
    if any(off % 2 for _, off, _ in spans) or max(last) > words.numel():
        raise ValueError(f"spans must lie at even offsets inside the buffer's {flat.numel()} bytes")
    bounds = torch.tensor(first + last, dtype=torch.int64, device=dev)  # [2T] word indices
    # prefix sums at each bound: P(b) = sum of x_j for j < b, for x = w and x = (j + 1) w;
    # int64 wraps (mod 2**64) alike on both ends of a sync
    blocks = dev.type == "cuda" if kernel is None else kernel
    at = (_prefix_by_blocks if blocks else _prefix_by_scans)(words, bounds)
    t = len(spans)
    s = at[:, t:] - at[:, :t]  # [2, T]: sum of w, sum of (j + 1) w over each tensor's words
    s[1] -= torch.tensor(first, dtype=torch.int64, device=dev) * s[0]  # positions from each tensor's start
    rows = s.T.cpu().tolist()
    return {name: (a % _WRAP) * _WRAP**2 + (b % _WRAP) * _WRAP + nbytes
            for (name, _, nbytes), (a, b) in zip(spans, rows, strict=True)}


def _prefix_by_blocks(words: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[2, B]: P(b) for w and (j + 1) w at each bound, as the blocks before b's block (one
    kernel's block sums, then a scan over blocks) plus b's own block up to b (gathered)."""
    from plugins.deepseek_v4.kernels.fingerprint import BLOCK, block_sums

    if not words.numel():  # every span empty
        return torch.zeros(2, bounds.numel(), dtype=torch.int64, device=words.device)
    sums = block_sums(words, BLOCK)  # [2, nblocks]
    zero = sums.new_zeros(1)
    # one 1-D scan each (CUDA scans the rows of a 2-D tensor with a thread block per row)
    before = torch.stack([torch.cat((zero, x.cumsum(0))) for x in sums])  # [2, nblocks + 1]
    out = []
    for bs in bounds.split(BOUNDS_CHUNK):
        blk = bs // BLOCK  # [b]
        j = blk[:, None] * BLOCK + torch.arange(BLOCK, device=words.device)  # [b, BLOCK]
        w = words[j.clamp_max(words.numel() - 1)].long() * (j < bs[:, None])  # each bound's block up to it
        out.append(before[:, blk] + torch.stack((w.sum(1), (w * (j + 1)).sum(1))))
    return torch.cat(out, 1)


def _prefix_by_scans(words: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[2, B]: P(b) for w and (j + 1) w at each bound, from torch's scans over int64 copies of
    the words, FINGERPRINT_CHUNK words at a time (the CPU path)."""
    dev = words.device
    at = torch.zeros(2, bounds.numel(), dtype=torch.int64, device=dev)
    carry = torch.zeros(2, 1, dtype=torch.int64, device=dev)
    for c0 in range(0, words.numel(), FINGERPRINT_CHUNK):
        w = words[c0: c0 + FINGERPRINT_CHUNK].long()  # [n]
        n = w.numel()
        pos = torch.arange(c0 + 1, c0 + n + 1, dtype=torch.int64, device=dev)
        # one 1-D scan each: CUDA scans a 1-D tensor with a device-wide kernel, but scans
        # the rows of [2, n] with one thread block per row (10x slower on an H200)
        sums = torch.stack((w.cumsum(0), (w * pos).cumsum(0)))  # [2, n] inclusive
        here = (bounds > c0) & (bounds <= c0 + n)
        got = carry + sums[:, (bounds - c0 - 1).clamp(0, n - 1)]  # [2, 2T]
        at = torch.where(here, got, at)
        carry = carry + sums[:, -1:]
    return at


@torch.no_grad()
def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """An integer of each tensor's raw bytes computed on its own device: as 16-bit words w_j
    (a zero byte after an odd count), their sum and their sum weighted by position, sum of
    (j + 1) w_j (both mod 2**64), and the byte count. Catches a wrong offset, dtype, length,
    swapped words or a torn copy, as the MD5 does, without the host copy the MD5 needs."""
    out = {}
    for name, t in tensors.items():
        b = t.detach().reshape(-1).contiguous().view(torch.uint8)
        n = b.numel()
        if n % 2:
            b = torch.cat((b, b.new_zeros(1)))
        out |= packed_fingerprints(b, [(name, 0, n)])
    return out


def fingerprint(t: torch.Tensor) -> int:
    """fingerprints() of one tensor."""
    return fingerprints({"": t})[""]
