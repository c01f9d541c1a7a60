"""The weight sync's fingerprint sums in one read of the bytes (checksum.packed_fingerprints
on a GPU): for each block of 16-bit words of a buffer, the sum of the words and the sum of
the words weighted by their 1-based index in the buffer, in int64 that wraps as torch's does."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words a program: 8 KB of the buffer


@triton.jit
def _block_sums(W, S, n, nblocks, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    j = k * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(W + j, mask=j < n, other=0).to(tl.int64)  # sign-extended, as torch's .long()
    tl.store(S + k, tl.sum(w, 0))
    tl.store(S + nblocks + k, tl.sum(w * (j + 1), 0))


def block_sums(words: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """words [N] int16 -> [2, ceil(N / block)] int64: block k's sum of w_j and of (j + 1) w_j
    over j in [k * block, (k + 1) * block) (j: the index in `words`)."""
    n = words.numel()
    nblocks = triton.cdiv(n, block)
    out = torch.empty(2, nblocks, dtype=torch.int64, device=words.device)
    if nblocks:
        with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():
            _block_sums[(nblocks,)](words, out, n, nblocks, BLOCK=block, num_warps=8)
    return out
