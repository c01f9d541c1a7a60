"""Triton kernels of the lightning indexer: its training target (`attention_mass`, below)
and its scores with their backward (`indexer_scores`, at the end of the file).

The target: the main attention's probability mass on each chosen compressed entry, summed
over heads (no gradient).

    mass[b, t, g] = sum_h exp(q[b, t, h] . e[b, g] * scale - lse[b*S + t, h])   (g chosen)

lse is the attention core's log-denominator (sink included), so this is exactly the
probability the core gave entry g. The PyTorch path materialises the fp32 logits
[B, H, S, G] (1 GiB per CSA layer at S = 4096, H = 64); here one program owns a
[BT tokens, BG entries] tile and loops over heads and D chunks with bf16 tensor-core dots
(fp32 accumulation), so only the [B, S, G] result is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output, tile_span, within_head_dim
from .sparse_attention import _mm

_CONFIGS = ([triton.Config({"BT": 16, "BG": 16, "BD": 16}, num_warps=4, num_stages=1)] if INTERPRET else
            [triton.Config({"BT": bt, "BG": bg, "BD": bd}, num_warps=w, num_stages=st)
             for bt, bg, bd, w, st in [(64, 64, 64, 4, 2), (64, 64, 128, 4, 2), (64, 128, 64, 8, 2),
                                       (128, 64, 64, 8, 2), (128, 128, 64, 8, 2), (64, 64, 32, 4, 3),
                                       (32, 64, 64, 4, 2), (16, 32, 16, 4, 2)]])


@triton.autotune(_CONFIGS, key=["H", "D"], prune_configs_by={"early_config_prune": within_head_dim("BD")})
@triton.jit
def _mass(Q, E, LSE, CH, OUT, scale, S, G, H, sq_b, sq_s, sq_h, se_b, se_g, sc_b, sc_s, so_b, so_s,
          D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # t * stride can pass 2^31
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    tmask, gmask = t < S, g < G
    tile = tmask[:, None] & gmask[None, :]
    chosen = tl.load(CH + b * sc_b + t[:, None] * sc_s + g[None, :], mask=tile, other=0) != 0  # [BT, BG]
    acc = tl.zeros([BT, BG], tl.float32)
    for h in range(H):
        s = tl.zeros([BT, BG], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            qh = tl.load(Q + b * sq_b + t[:, None] * sq_s + h * sq_h + d[None, :], mask=tmask[:, None], other=0.0)
            e = tl.load(E + b * se_b + g[:, None] * se_g + d[None, :], mask=gmask[:, None], other=0.0)
            s += _mm(qh, tl.trans(e), IEEE)
        lse = tl.load(LSE + (b * S + t) * H + h, mask=tmask, other=0.0)
        # unchosen entries may exceed lse (overflow to inf): masked before they are summed
        acc += tl.where(chosen, tl.exp(s * scale - lse[:, None]), 0.0)
    tl.store(OUT + b * so_b + t[:, None] * so_s + g[None, :], acc, mask=tile)


def attention_mass(q: torch.Tensor, entries: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, S, H, D]; entries [B, G, D] (the compressed keys); lse [B*S, H] fp32 from the
    attention core; chosen [B, S, G] bool -> [B, S, G] fp32 head-summed probabilities
    (0 where not chosen). No autograd (a detached training target)."""
    b, s, h, d = q.shape
    g = entries.shape[1]
    if entries.shape != (b, g, d) or lse.shape != (b * s, h) or chosen.shape != (b, s, g):
        raise ValueError(f"attention_mass: shapes q {list(q.shape)}, entries {list(entries.shape)}, "
                         f"lse {list(lse.shape)}, chosen {list(chosen.shape)} do not fit")
    if d & (d - 1) or d < 16:
        raise ValueError(f"attention_mass: head dim {d} must be a power of two >= 16")
    q, e = q.detach().contiguous(), entries.detach().to(q.dtype).contiguous()
    lse, ch = lse.detach().float().contiguous(), chosen.to(torch.int8).contiguous()
    out = new_output((b, s, g), q, torch.float32)
    if out.numel():
        _mass[lambda m: (triton.cdiv(s, m["BT"]), triton.cdiv(g, m["BG"]), b)](
            q, e, lse, ch, out, scale, s, g, h, q.stride(0), q.stride(1), q.stride(2), e.stride(0), e.stride(1),
            ch.stride(0), ch.stride(1), out.stride(0), out.stride(1), D=d, IEEE=q.dtype == torch.float32)
    return out


# --------------------------------------------------------------------------- indexer scores
# score[b, t, g] = sum_h w[b, t, h] relu(q[b, t, h] . k[b, g]), fp32 (DSV4.md keeps the
# lightning indexer's scores in fp32), forward and backward without the [B, S, h, G] dot
# products the PyTorch path builds chunk by chunk (`ops.indexer_scores`: fp32 bmm's on CUDA
# cores, a relu, a head sum; the backward recomputes them and permutes [G, h, S] copies).
# The dots are tf32x3 (three TF32 products: fp32-accurate on tensor cores). The backward:
# one program per (token tile, head) for dq and dw over all entries; one per (entry tile,
# token split) for dk's per-split partials, summed once (no atomics: deterministic).
# The model's kernel path (`ops.indexer_scores(fused=True)`); `benchmarks/indexer_gpu.py` times the tiles.
SCORE_PREC = "tf32x3"
SCORE_TILE = dict(BT=16, BG=16, SPLIT=2, warps=4) if INTERPRET else dict(BT=64, BG=32, SPLIT=16, warps=4)


@triton.jit
def _q_tile(Q, b, t, h, S, H, D: tl.constexpr):
    """q[b, t, h, :] [BT, D] of a contiguous [B, S, H, D] tensor (rows past S are 0)."""
    d = tl.arange(0, D)
    return tl.load(Q + ((b * S + t) * H + h)[:, None] * D + d[None, :], mask=(t < S)[:, None], other=0.0)


@triton.jit
def _k_tile(K, b, g, G, D: tl.constexpr):
    """k[b, g, :] [BG, D] of a contiguous [B, G, D] tensor (rows past G are 0)."""
    d = tl.arange(0, D)
    return tl.load(K + (b * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)


@triton.jit
def _w_col(W, b, t, h, S, H):
    """w[b, t, h] [BT] of a contiguous [B, S, H] tensor."""
    return tl.load(W + (b * S + t) * H + h, mask=t < S, other=0.0)


@triton.jit
def _dots_and_grad(q, k, DS, b, t, g, w, S, G, PREC: tl.constexpr):
    """dots [BT, BG] = q . k, the upstream ds [BT, BG] and d score / d dots = [dots > 0] ds w."""
    ds = tl.load(DS + (b * S + t)[:, None] * G + g[None, :], mask=(t < S)[:, None] & (g < G)[None, :], other=0.0)
    dots = tl.dot(q, tl.trans(k), input_precision=PREC)
    return dots, ds, tl.where(dots > 0, ds * w[:, None], 0.0)


@triton.jit
def _scores_fwd(Q, K, W, OUT, S, G, H, D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    k = _k_tile(K, b, g, G, D)  # [BG, D]
    acc = tl.zeros([BT, BG], tl.float32)
    for h in range(H):
        dots = tl.dot(_q_tile(Q, b, t, h, S, H, D), tl.trans(k), input_precision=PREC)  # [BT, BG]
        acc += _w_col(W, b, t, h, S, H)[:, None] * tl.maximum(dots, 0.0)
    tl.store(OUT + (b * S + t)[:, None] * G + g[None, :], acc, mask=(t < S)[:, None] & (g < G)[None, :])


@triton.jit
def _scores_bwd_q(Q, K, W, DS, DQ, DW, S, G, H, D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr,
                  PREC: tl.constexpr):
    """dq[b, t, h] = sum_g [dots > 0] ds[t, g] w[t, h] k[g]; dw[b, t, h] = sum_g ds relu(dots)."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    q, w = _q_tile(Q, b, t, h, S, H, D), _w_col(W, b, t, h, S, H)
    dq = tl.zeros([BT, D], tl.float32)
    dw = tl.zeros([BT], tl.float32)
    for g0 in range(0, G, BG):
        g = g0 + tl.arange(0, BG)
        k = _k_tile(K, b, g, G, D)
        dots, ds, dd = _dots_and_grad(q, k, DS, b, t, g, w, S, G, PREC)
        dw += tl.sum(ds * tl.maximum(dots, 0.0), 1)
        dq += tl.dot(dd, k, input_precision=PREC)
    tl.store(DQ + ((b * S + t) * H + h)[:, None] * D + d[None, :], dq, mask=(t < S)[:, None])
    tl.store(DW + (b * S + t) * H + h, dw, mask=t < S)


@triton.jit
def _scores_bwd_k(Q, K, W, DS, DK, S, G, H, span, D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr,
                  PREC: tl.constexpr):
    """This token split's share of dk[b, g] = sum_{t, h} [dots > 0] ds[t, g] w[t, h] q[t, h]."""
    b = tl.program_id(2).to(tl.int64)
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    part = tl.program_id(1)
    d = tl.arange(0, D)
    k = _k_tile(K, b, g, G, D)
    dk = tl.zeros([BG, D], tl.float32)
    for t0 in range(part * span, tl.minimum(part * span + span, S), BT):
        t = t0 + tl.arange(0, BT)
        for h in range(H):
            q = _q_tile(Q, b, t, h, S, H, D)
            _dots, _ds, dd = _dots_and_grad(q, k, DS, b, t, g, _w_col(W, b, t, h, S, H), S, G, PREC)
            dk += tl.dot(tl.trans(dd), q, input_precision=PREC)  # [BG, D]
    tl.store(DK + ((part * tl.num_programs(2) + b) * G + g)[:, None] * D + d[None, :], dk, mask=(g < G)[:, None])


class _Scores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, s, h, d = q.shape
        g, t = k.shape[1], SCORE_TILE
        q32, k32, w32 = (x.float().contiguous() for x in (q, k, w))
        out = new_output((b, s, g), q32, torch.float32)
        if out.numel():
            _scores_fwd[(triton.cdiv(s, t["BT"]), triton.cdiv(g, t["BG"]), b)](
                q32, k32, w32, out, s, g, h, D=d, BT=t["BT"], BG=t["BG"], PREC=SCORE_PREC, num_warps=t["warps"])
        ctx.save_for_backward(q32, k32, w32)
        ctx.dtypes = (q.dtype, k.dtype, w.dtype)
        return out

    @staticmethod
    def backward(ctx, ds: torch.Tensor):
        q, k, w = ctx.saved_tensors
        b, s, h, d = q.shape
        g, t = k.shape[1], SCORE_TILE
        ds = ds.float().contiguous()
        dq, dw = new_output(q.shape, q, torch.float32), new_output(w.shape, q, torch.float32)
        span = tile_span(s, t["SPLIT"], t["BT"])
        parts = triton.cdiv(max(s, 1), span)
        dk = new_output((parts, b, g, d), q, torch.float32)
        if s and g:
            _scores_bwd_q[(triton.cdiv(s, t["BT"]), h, b)](q, k, w, ds, dq, dw, s, g, h, D=d, BT=t["BT"],
                                                           BG=t["BG"], PREC=SCORE_PREC, num_warps=t["warps"])
            _scores_bwd_k[(triton.cdiv(g, t["BG"]), parts, b)](q, k, w, ds, dk, s, g, h, span, D=d, BT=t["BT"],
                                                               BG=t["BG"], PREC=SCORE_PREC, num_warps=t["warps"])
        else:
            for x in (dq, dw, dk):
                x.zero_()
        qd, kd, wd = ctx.dtypes
        return dq.to(qd), dk.sum(0).to(kd), dw.to(wd)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as `ops.indexer_scores`: q [B, S, h, d], k [B, G, d], w [B, S, h] ->
    [B, S, G] fp32 = sum_h w relu(q_h . k_g), differentiable in q, k and w."""
    b, s, h, d = q.shape
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != d or w.shape != (b, s, h):
        raise ValueError(f"indexer_scores: q {list(q.shape)}, k {list(k.shape)}, w {list(w.shape)} do not fit")
    if d & (d - 1) or d < 16:
        raise ValueError(f"indexer_scores: head dim {d} must be a power of two >= 16")
    return _Scores.apply(q, k, w)
