"""The chunked LM/MTP head's log-softmax pieces over fp32 logits [c, V] (`parallel._HeadLogprobs`).

PyTorch takes a chunk's log-probabilities as log_softmax (a [c, V] fp32 output written, then
one column gathered) and its gradient as four passes over the chunk (max, exp, sum, scale).
Here the forward reads the logits once (a row's running max and sum of exponentials, and the
label's logit), and the backward turns the recomputed logits into their gradient in place in
one read and one write, from the log-sum-exp the forward kept; or, for the bf16 backward
GEMMs, straight into their operand's one or two bf16 terms (`softmax_grad_terms`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output

BV = 64 if INTERPRET else 4096  # vocabulary columns of one program's tile


@triton.jit
def _row_stats(Z, IDS, M, S, PICK, V, BV: tl.constexpr):
    """Row r of Z [R, V]: M = max, S = sum exp(z - M), PICK = z[ids[r]] (online over tiles)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BV)
    m = tl.full((), -float("inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BV):
        z = tl.load(Z + r * V + v0 + cols, mask=v0 + cols < V, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(z, 0))  # finite from the first tile on (V >= 1)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(M + r, m)
    tl.store(S + r, s)
    tl.store(PICK + r, tl.load(Z + r * V + tl.load(IDS + r)))


@triton.jit
def _softmax_grad(Z, LSE, IDS, G, HIT, V, BV: tl.constexpr):
    """In place: z -> -g exp(z - lse), plus hit at the row's label column."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    z = tl.load(Z + r * V + cols, mask=cols < V, other=0.0)
    dz = -tl.load(G + r) * tl.exp(z - tl.load(LSE + r))
    dz += tl.where(cols == tl.load(IDS + r), tl.load(HIT + r), 0.0)
    tl.store(Z + r * V + cols, dz, mask=cols < V)


@triton.jit
def _softmax_grad_terms(Z, LSE, IDS, G, HIT, OUT, V, TERMS: tl.constexpr, BV: tl.constexpr):
    """_softmax_grad's dz stored as TERMS bf16 terms at row r of OUT [R, TERMS*V] (hi | lo:
    hi = bf16(dz), lo = bf16(dz - hi)), not as fp32."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    z = tl.load(Z + r * V + cols, mask=cols < V, other=0.0)
    dz = -tl.load(G + r) * tl.exp(z - tl.load(LSE + r))
    dz += tl.where(cols == tl.load(IDS + r), tl.load(HIT + r), 0.0)
    hi = dz.to(tl.bfloat16, fp_downcast_rounding="rtne")  # as torch rounds
    tl.store(OUT + r * TERMS * V + cols, hi, mask=cols < V)
    if TERMS == 2:
        lo = (dz - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")  # dz - hi: exact in fp32
        tl.store(OUT + r * TERMS * V + V + cols, lo, mask=cols < V)


def row_stats(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits z [R, V] fp32, label columns ids [R] in [0, V) -> (max [R], sum of exp(z - max)
    [R], z[r, ids[r]] [R]), fp32."""
    r, v = z.shape
    m, s, pick = (new_output((r,), z, torch.float32) for _ in range(3))
    if r:
        _row_stats[(r,)](z.contiguous(), ids.contiguous(), m, s, pick, v, BV=min(BV, triton.next_power_of_2(v)))
    return m, s, pick


def softmax_grad_(z: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, hit: torch.Tensor) -> None:
    """z [R, V] fp32 (contiguous) becomes -g[r] softmax(z)[r] + hit[r] onehot(ids[r]), in place:
    the gradient of sum_r g[r] log p(ids[r]) on this vocabulary shard (hit = g where the label
    is on it), given each row's log-sum-exp over the whole vocabulary."""
    if not z.is_contiguous():
        raise ValueError("softmax_grad_: the logits must be contiguous (they are overwritten in place)")
    r, v = z.shape
    if r:
        bv = min(BV, triton.next_power_of_2(v))
        _softmax_grad[(r, triton.cdiv(v, bv))](z, lse.contiguous(), ids.contiguous(), g.float().contiguous(),
                                               hit.float().contiguous(), v, BV=bv)


def softmax_grad_terms(z: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, hit: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """softmax_grad_'s gradient as the head backward's GEMM operand: into out [R, terms * V]
    bf16 (contiguous; terms 1: bf16(dz); 2: hi | lo, ops.split_bf16's layout), the same bits as
    softmax_grad_ then the rounding or the split, without the fp32 gradient's write and read.
    z [R, V] fp32 is read only. (No sampling scale: times a scale, the split's dz - hi would
    contract into one FMA with the product, off softmax_grad_'s bits.)"""
    r, v = z.shape
    terms = out.shape[-1] // max(v, 1)
    if (out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (r, terms * v) or terms not in (1, 2)
            or not z.is_contiguous()):
        raise ValueError(f"softmax_grad_terms: out {list(out.shape)} {out.dtype} for logits {list(z.shape)}")
    if r and v:
        bv = min(BV, triton.next_power_of_2(v))
        _softmax_grad_terms[(r, triton.cdiv(v, bv))](z, lse.contiguous(), ids.contiguous(), g.float().contiguous(),
                                                     hit.float().contiguous(), out, v, TERMS=terms, BV=bv)
    return out
