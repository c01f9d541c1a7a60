"""Triton Sinkhorn normalisation of mHC's residual mixing matrices (forward and backward).

The PyTorch reference (`ops.sinkhorn`) runs 2 * iters - 1 normalisation steps of a tiny
n x n matrix per token as separate launches (about 120 forward and 240 backward launches
per mHC site at 20 iterations). Here one program normalises BLOCK_R matrices entirely in
registers: one launch forward, one backward.

Schedule (same as the reference): m = softmax(logits, -1) + eps; column step; then
(iters - 1) x (row step, column step); a step divides by (sum over the axis) + eps.
Backward recomputes the forward, keeping each step's input in a scratch buffer
[R, 2 * iters - 1, n, n] (transient, freed after the call), then walks the steps back:
for y = z / (s + eps), s = sum_axis z: dz = (dy - sum_axis(dy * y)) / (s + eps).
n need not be a power of two: the tile is NP = next_pow2(n) wide and padding stays 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output

BLOCK_R = 16 if INTERPRET else 64


@triton.jit
def _start(L, r0, R, n, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets [BLOCK, NP, NP], mask, and softmax(logits, -1) (padding 0)."""
    r = r0 + tl.arange(0, BLOCK)
    i = tl.arange(0, NP)
    offs = r[:, None, None] * n * n + i[None, :, None] * n + i[None, None, :]
    mask = (r < R)[:, None, None] & (i < n)[None, :, None] & (i < n)[None, None, :]
    x = tl.load(L + offs, mask=mask, other=float("-inf"))
    mx = tl.max(x, 2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # padded rows: no NaN
    e = tl.where(mask, tl.exp(x - mx[:, :, None]), 0.0)
    den = tl.sum(e, 2)
    p = e / tl.where(den == 0.0, 1.0, den)[:, :, None]
    return offs, mask, p


@triton.jit
def _norm(z, eps, ROWS: tl.constexpr):
    """One step: divide by the row sums (ROWS) or column sums, plus eps."""
    if ROWS:
        return z / (tl.sum(z, 2)[:, :, None] + eps)
    return z / (tl.sum(z, 1)[:, None, :] + eps)


@triton.jit
def _norm_bwd(z, dy, eps, ROWS: tl.constexpr):
    if ROWS:
        d = tl.sum(z, 2)[:, :, None] + eps
        y = z / d
        return (dy - tl.sum(dy * y, 2)[:, :, None]) / d
    d = tl.sum(z, 1)[:, None, :] + eps
    y = z / d
    return (dy - tl.sum(dy * y, 1)[:, None, :]) / d


@triton.jit
def _fwd(L, OUT, R, n, iters, eps, NP: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask, p = _start(L, tl.program_id(0) * BLOCK, R, n, NP, BLOCK)
    m = _norm(tl.where(mask, p + eps, 0.0), eps, False)
    for _ in range(iters - 1):
        m = _norm(_norm(m, eps, True), eps, False)
    tl.store(OUT + offs, m, mask=mask)


@triton.jit
def _bwd(L, DY, DL, BUF, R, n, iters, eps, NP: tl.constexpr, BLOCK: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK
    offs, mask, p = _start(L, r0, R, n, NP, BLOCK)
    steps = 2 * iters - 1
    # scratch of step inputs, [R, steps, NP, NP]; padding entries are stored (as 0) too
    r = r0 + tl.arange(0, BLOCK)
    i = tl.arange(0, NP)
    sb = (r.to(tl.int64)[:, None, None] * steps * NP * NP + i[None, :, None] * NP + i[None, None, :])
    live = (r < R)[:, None, None] & (i < NP)[None, :, None] & (i < NP)[None, None, :]
    z = tl.where(mask, p + eps, 0.0)
    for k in range(steps):  # step 0 and even steps normalise columns, odd steps rows
        tl.store(BUF + sb + k * NP * NP, z, mask=live)
        if k % 2 == 1:
            z = _norm(z, eps, True)
        else:
            z = _norm(z, eps, False)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    for kk in range(steps):
        k = steps - 1 - kk
        z = tl.load(BUF + sb + k * NP * NP, mask=live, other=0.0)
        if k % 2 == 1:
            dy = _norm_bwd(z, dy, eps, True)
        else:
            dy = _norm_bwd(z, dy, eps, False)
    dy = tl.where(mask, dy, 0.0)  # d(p + eps) = dp
    dx = p * (dy - tl.sum(dy * p, 2)[:, :, None])
    tl.store(DL + offs, dx, mask=mask)


def _launch(kernel, r: int, *args, n: int):
    np_ = triton.next_power_of_2(n)
    kernel[(triton.cdiv(r, BLOCK_R),)](*args, NP=np_, BLOCK=BLOCK_R)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        flat = logits.float().contiguous()
        n = flat.shape[-1]
        r = flat.numel() // (n * n)
        out = new_output(flat.shape, flat, torch.float32)
        if r:
            _launch(_fwd, r, flat, out, r, n, iters, eps, n=n)
        ctx.save_for_backward(flat)
        ctx.iters, ctx.eps = iters, eps
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (flat,) = ctx.saved_tensors
        n = flat.shape[-1]
        r = flat.numel() // (n * n)
        dl = new_output(flat.shape, flat, torch.float32)
        if r:
            np_ = triton.next_power_of_2(n)
            buf = torch.empty(r, 2 * ctx.iters - 1, np_, np_, device=flat.device, dtype=torch.float32)
            _launch(_bwd, r, flat, dy.float().contiguous(), dl, buf, r, n, ctx.iters, ctx.eps, n=n)
        return dl, None, None


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Same contract as `ops.sinkhorn`: [..., n, n] -> doubly stochastic, fp32."""
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn kernel: expected square matrices, got {list(logits.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn kernel: iters must be >= 1, got {iters}")
    return _Sinkhorn.apply(logits, iters, eps)
