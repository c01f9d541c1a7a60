"""The MoE's row moves between tokens and expert groups (`ops.routed_experts`), one pass each.

The PyTorch path (`ops.take_rows`) appends a zero row to the source (a copy of the whole
tensor) so that index -1 reads zeros, gathers into a new tensor, and the combine then sums
a [N, k, d] copy of the gathered rows and casts in further passes. Here a row of -1 is
written as zeros directly, the k slots of a token are summed in fp32 registers in slot
order, and the result is stored in the asked dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output

BR, BD = (4, 32) if INTERPRET else (8, 512)  # rows, columns of one program's tile


@triton.jit
def _gather_rows(X, IDX, OUT, M, D, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[r] = X[IDX[r]], zeros where IDX[r] is -1."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    src = tl.load(IDX + r, mask=r < M, other=-1)
    cm = (c < D)[None, :]
    x = tl.load(X + src.to(tl.int64)[:, None] * D + c[None, :], mask=(src >= 0)[:, None] & cm, other=0.0)
    tl.store(OUT + r.to(tl.int64)[:, None] * D + c[None, :], x.to(OUT.dtype.element_ty), mask=(r < M)[:, None] & cm)


@triton.jit
def _sum_rows(Y, ROWS, OUT, N, D, K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[t] = sum over slots s of Y[ROWS[t * K + s]] in fp32 (slot order; -1 adds nothing)."""
    t = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = (c < D)[None, :]
    acc = tl.zeros([BR, BD], tl.float32)
    for s in tl.static_range(K):
        src = tl.load(ROWS + t.to(tl.int64) * K + s, mask=t < N, other=-1)
        acc += tl.load(Y + src.to(tl.int64)[:, None] * D + c[None, :], mask=(src >= 0)[:, None] & cm,
                       other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64)[:, None] * D + c[None, :], acc.to(OUT.dtype.element_ty), mask=(t < N)[:, None] & cm)


def gather_rows(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, d], idx [M] (int, -1: a zero row) -> x[idx] [M, d] in `dtype` (x's by default)."""
    m, d = idx.numel(), x.shape[1]
    out = new_output((m, d), x, dtype or x.dtype)
    if m and d:
        _gather_rows[(triton.cdiv(m, BR), triton.cdiv(d, BD))](x.contiguous(), idx.contiguous(), out, m, d,
                                                              BR=BR, BD=BD)
    return out


def sum_rows(y: torch.Tensor, rows: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """y [M, d], rows [N * k] (int, -1: no row) -> [N, d] in `dtype`: row t is the fp32 sum of
    y[rows[t * k + s]] over its k slots."""
    n, d = rows.numel() // k, y.shape[1]
    out = new_output((n, d), y, dtype)
    if n and d:
        _sum_rows[(triton.cdiv(n, BR), triton.cdiv(d, BD))](y.contiguous(), rows.contiguous(), out, n, d, K=k,
                                                           BR=BR, BD=BD)
    return out
