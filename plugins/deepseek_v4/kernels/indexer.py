"""Triton kernels of the lightning indexer: its training target (`attention_mass`, below)
and its scores with their backward (`indexer_scores`, at the end of the file).

The target: the main attention's probability mass on each chosen compressed entry, summed
over heads (no gradient).

    mass[b, t, g] = sum_h exp(q[b, t, h] . e[b, g] * scale - lse[b*S + t, h])   (g chosen)

lse is the attention core's log-denominator (sink included), so this is exactly the
probability the core gave entry g. The PyTorch path materialises the fp32 logits
[B, H, S, G] (1 GiB per CSA layer at S = 4096, H = 64); here one program owns a
[BT tokens, BG entries] tile, keeps its entries and loops over heads, a bf16 tensor-core dot
each (fp32 accumulation), so only the [B, S, G] result is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output, tile_span
from .mhc import _bf16x3, _dot3
from .sparse_attention import _mm

# A program's entries [BG, D] are loaded once and each head's q tile [BT, D] is one dot with
# them. (Loading both for every head and D chunk of 64 doubled the L2 traffic at V4's 64
# heads of 512: 875 against 794 us on an H200, benchmarks/indexer_gpu.py --mass.) Configs past
# the shared memory at D = 512 fail to compile and the autotuner passes them over.
_CONFIGS = ([triton.Config({"BT": 16, "BG": 16}, num_warps=4, num_stages=1)] if INTERPRET else
            [triton.Config({"BT": bt, "BG": bg}, num_warps=w, num_stages=st)
             for bt, bg, w, st in [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2),
                                   (32, 32, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (16, 32, 4, 2)]])


@triton.autotune(_CONFIGS, key=["H", "D"])
@triton.jit
def _mass(Q, E, LSE, CH, OUT, scale, S, G, H, sq_b, sq_s, sq_h, se_b, se_g, sc_b, sc_s, so_b, so_s,
          D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # t * stride can pass 2^31
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    d = tl.arange(0, D)
    tmask, gmask = t < S, g < G
    tile = tmask[:, None] & gmask[None, :]
    chosen = tl.load(CH + b * sc_b + t[:, None] * sc_s + g[None, :], mask=tile, other=0) != 0  # [BT, BG]
    acc = tl.zeros([BT, BG], tl.float32)
    if tl.max(tl.max(chosen.to(tl.int32), 1), 0) > 0:  # else (past the causal triangle: half the tiles) zeros
        et = tl.trans(tl.load(E + b * se_b + g[:, None] * se_g + d[None, :], mask=gmask[:, None], other=0.0))
        for h in range(H):
            qh = tl.load(Q + b * sq_b + t[:, None] * sq_s + h * sq_h + d[None, :], mask=tmask[:, None], other=0.0)
            s = _mm(qh, et, IEEE)  # [BT, BG] over all D
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


# --------------------------------------------------------------------------- Hadamard rotation
# The indexer's bf16 q rotated by the orthonormal Sylvester-Hadamard matrix H / sqrt(n): the
# torch path casts q to fp32 and runs an fp32 GEMM on CUDA cores (no TF32: [4096 x 64, 128] @
# [128, 128] took 250 us at flash_slice's shape, plus the casts' two passes). H's entries are
# +-1, exact in bf16, so a bf16 tensor-core dot of q with them has exact products summed in
# fp32; the 1 / sqrt(n) is applied to the fp32 sums. One pass each way (H is symmetric and
# orthonormal: the backward is the same rotation of the gradient).
@triton.jit
def _hadamard(X, H, Y, R, scale, N: tl.constexpr, BM: tl.constexpr, IEEE: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.arange(0, N)
    rows = r.to(tl.int64)[:, None] * N + c[None, :]
    x = tl.load(X + rows, mask=(r < R)[:, None], other=0.0)  # [BM, N] bf16
    h = tl.load(H + c[:, None] * N + c[None, :])  # [N, N] bf16, +-1
    y = _mm(x, h, IEEE) * scale  # [BM, N] fp32 sums (the interpreter's dot reads bf16 as its bits: fp32 there)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=(r < R)[:, None])


def _hadamard_launch(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    x = x.contiguous()
    y = new_output(x.shape, x, x.dtype)
    r = x.numel() // n
    if r:
        bm = 16 if INTERPRET else 64
        _hadamard[(triton.cdiv(r, bm),)](x, signs, y, r, n ** -0.5, N=n, BM=bm, IEEE=INTERPRET, num_warps=4)
    return y


class _Hadamard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        ctx.signs = signs  # a constant, not saved for the backward
        return _hadamard_launch(x, signs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _hadamard_launch(g.to(torch.bfloat16), ctx.signs), None


def hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Same contract as `ops.hadamard` for bf16 x [..., n] (n a power of two, 16 to 128): the
    orthonormal rotation of the last dim, in bf16, differentiable. signs: H's +-1 entries
    [n, n] bf16 on x's device (`ops._hadamard_signs`)."""
    n = x.shape[-1]
    if x.dtype != torch.bfloat16 or n & (n - 1) or not 16 <= n <= 128 or signs.shape != (n, n):
        raise ValueError(f"hadamard kernel: bf16 rows of a power of two from 16 to 128, got {x.dtype} {list(x.shape)}")
    return _Hadamard.apply(x, signs.contiguous())


# --------------------------------------------------------------------------- indexer scores
# score[b, t, g] = sum_h w[b, t, h] relu(q[b, t, h] . k[b, g]), fp32 (DSV4.md keeps the
# lightning indexer's scores in fp32), forward and backward without the [B, S, h, G] dot
# products the PyTorch path builds chunk by chunk (`ops.indexer_scores`: fp32 bmm's on CUDA
# cores, a relu, a head sum; the backward recomputes them and permutes [G, h, S] copies).
# The forward also keeps the relu gate as bits, [B, S, h, ceil(G/32)] int32 (S h G / 8
# bytes), so the backward needs one product per gradient and no dots:
#   e[t, h] = sum_g [dot > 0] ds[t, g] k[g]  ->  dq = w e,  dw = q . e  (= sum_g ds relu(dot))
#   dk[g]   = sum_{t,h} [dot > 0] ds[t, g] w[t, h] q[t, h]
# one program per (token tile, head) for e, one per (entry tile, token split) for dk's
# per-split partials, summed once (no atomics: deterministic). Entries at or past a token's
# bound hi[b, t] (one past its last visible entry: the causal triangle, a document's start)
# score 0 and pass no gradient, and tiles wholly past every bound of their tokens are skipped:
# about half the products of a causal sequence. Dots of two fp32 operands: SCORE_PREC "tf32x3"
# (Triton's three TF32 products), "split3" (the same three products from operands split
# here by masking the low 13 bits), or "ieee". "bf16x3" (the default): those dots as split3,
# but where q is bf16 (the model's, from the Hadamard kernel) the forward's q . k and dk's
# dd^T q are bf16 dots with the fp32 operand in three bf16 pieces (mhc's _bf16x3 and _dot3,
# as the mHC mixes do): every product exact (8 x 8 bits), summed in fp32, at the bf16 rate
# (twice TF32's) and with no split of q; split3 there spends a third of its products on q's
# zero low half and keeps 11 of the up to 13 bits of k's low half (~2^-21 of k).
# The model's kernel path (`ops.indexer_scores(fused=True)`); `benchmarks/indexer_gpu.py` times the tiles.
# H100, benchmarks/indexer_gpu.py: the forward is fastest at 64-token tiles, the backward at 32
# (its e and dk accumulators are [tile, 128] fp32); "split3" 15% faster than tf32x3 there.
SCORE_PREC = "bf16x3"
SCORE_TILES = ({"fwd": dict(BT=16, BG=32, warps=4), "bwd": dict(BT=16, BG=64, SPLIT=2, warps=4)} if INTERPRET else
               {"fwd": dict(BT=64, BG=32, warps=4), "bwd": dict(BT=32, BG=32, SPLIT=16, warps=4)})


@triton.jit
def _q_rows(Q, b, t, h, S, H, D: tl.constexpr):
    """q[b, t, h, :] [BT, D] in q's dtype, of a contiguous [B, S, H, D] tensor (rows past S are 0)."""
    d = tl.arange(0, D)
    return tl.load(Q + ((b * S + t) * H + h)[:, None] * D + d[None, :], mask=(t < S)[:, None], other=0.0)


@triton.jit
def _q_tile(Q, b, t, h, S, H, D: tl.constexpr):
    """_q_rows in fp32."""
    return _q_rows(Q, b, t, h, S, H, D).to(tl.float32)


@triton.jit
def _k_tile(K, b, g, G, D: tl.constexpr):
    """k[b, g, :] [BG, D] fp32 of a contiguous [B, G, D] tensor (rows past G are 0)."""
    d = tl.arange(0, D)
    return tl.load(K + (b * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _w_col(W, b, t, h, S, H):
    """w[b, t, h] [BT] fp32 of a contiguous [B, S, H] tensor."""
    return tl.load(W + (b * S + t) * H + h, mask=t < S, other=0.0).to(tl.float32)


@triton.jit
def _ds_tile(DS, b, t, g, S, G):
    """The upstream gradient ds[b, t, g] [BT, BG] of a contiguous [B, S, G] tensor (0 outside)."""
    return tl.load(DS + (b * S + t)[:, None] * G + g[None, :], mask=(t < S)[:, None] & (g < G)[None, :], other=0.0)


@triton.jit
def _bits_at(BITS, b, t, h, g0, S, H, NW, BG: tl.constexpr):
    """Addresses [BT, BG / 32] of the gate words of entries g0 .. g0 + BG of rows (t, h), and
    their mask (rows past S, words past NW)."""
    wi = g0 // 32 + tl.arange(0, BG // 32)
    return BITS + ((b * S + t) * H + h)[:, None] * NW + wi[None, :], (t < S)[:, None] & (wi < NW)[None, :]


@triton.jit
def _pack(on, BT: tl.constexpr, BG: tl.constexpr):
    """[BT, BG] bool -> [BT, BG / 32] int32, entry j of a 32-run as bit j (distinct bits: the sum is an or)."""
    bits = on.to(tl.int32) << (tl.arange(0, BG) % 32)[None, :]
    return tl.sum(tl.reshape(bits, (BT, BG // 32, 32)), 2)


@triton.jit
def _unpack(words, BT: tl.constexpr, BG: tl.constexpr):
    """_pack's inverse: [BT, BG / 32] int32 -> [BT, BG] bool."""
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, (BT, BG)) != 0


@triton.jit
def _split(x):
    """x = hi + lo with hi x's top 10 mantissa bits (a TF32 value) and lo the rest (exact)."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # -8192: 0xFFFFE000
    return hi, x - hi


_UPCAST = tl.constexpr(INTERPRET)  # _dot3's: the interpreter misreads bf16 dot operands


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32: "split3" (and "bf16x3", for two fp32 operands) sums
    hi.hi + hi.lo + lo.hi (TF32 products, the one dropped lo.lo is 2^-20 of a product),
    otherwise tl.dot at input_precision PREC."""
    if PREC == "split3" or PREC == "bf16x3":
        ah, al = _split(a)
        bh, bl = _split(b)
        acc = tl.dot(al, bh, input_precision="tf32")
        acc = tl.dot(ah, bl, acc, input_precision="tf32")
        return tl.dot(ah, bh, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _bounds(HI, b, t, S):
    """hi[b, t] [BT] int32 of a contiguous [B, S] tensor (0 past S: no entry)."""
    return tl.load(HI + b * S + t, mask=t < S, other=0)


@triton.jit
def _scores_fwd(Q, K, W, HI, OUT, BITS, S, G, H, NW, D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr,
                PREC: tl.constexpr, PIECES: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    g0 = tl.program_id(1) * BG
    g = g0 + tl.arange(0, BG)
    hi = _bounds(HI, b, t, S)
    seen = g[None, :] < hi[:, None]  # [BT, BG]
    acc = tl.zeros([BT, BG], tl.float32)
    if g0 < tl.max(hi, 0):  # else no token of the tile sees an entry of it: zeros, gates off
        kt = tl.trans(_k_tile(K, b, g, G, D))  # [D, BG]
        if PIECES:
            k0, k1, k2 = _bf16x3(kt)
        for h in range(H):
            if PIECES:
                qh = _q_rows(Q, b, t, h, S, H, D)
                dots = _dot3(qh, qh, qh, k0, k1, k2, _UPCAST)  # [BT, BG]; 0 past G
            else:
                dots = _dot(_q_tile(Q, b, t, h, S, H, D), kt, PREC)
            acc += _w_col(W, b, t, h, S, H)[:, None] * tl.maximum(dots, 0.0)
            at, inside = _bits_at(BITS, b, t, h, g0, S, H, NW, BG)
            tl.store(at, _pack(seen & (dots > 0), BT, BG), mask=inside)
    else:
        for h in range(H):
            at, inside = _bits_at(BITS, b, t, h, g0, S, H, NW, BG)
            tl.store(at, tl.zeros([BT, BG // 32], tl.int32), mask=inside)
    tl.store(OUT + (b * S + t)[:, None] * G + g[None, :], tl.where(seen, acc, 0.0),
             mask=(t < S)[:, None] & (g < G)[None, :])


@triton.jit
def _scores_bwd_q(Q, K, W, HI, DS, BITS, DQ, DW, S, G, H, NW, D: tl.constexpr, BT: tl.constexpr,
                  BG: tl.constexpr, PREC: tl.constexpr):
    """e = sum_g [dot > 0] ds[t, g] k[g] over the entries the tile's tokens see (the gates past
    a token's bound are off); dq[b, t, h] = w e, dw[b, t, h] = q . e."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    e = tl.zeros([BT, D], tl.float32)
    for g0 in range(0, tl.minimum(tl.max(_bounds(HI, b, t, S), 0), G), BG):
        g = g0 + tl.arange(0, BG)
        at, inside = _bits_at(BITS, b, t, h, g0, S, H, NW, BG)
        on = _unpack(tl.load(at, mask=inside, other=0), BT, BG)
        e += _dot(tl.where(on, _ds_tile(DS, b, t, g, S, G), 0.0), _k_tile(K, b, g, G, D), PREC)  # [BT, D]
    dq_at = DQ + ((b * S + t) * H + h)[:, None] * D + d[None, :]
    tl.store(dq_at, _w_col(W, b, t, h, S, H)[:, None] * e, mask=(t < S)[:, None])
    tl.store(DW + (b * S + t) * H + h, tl.sum(_q_tile(Q, b, t, h, S, H, D) * e, 1), mask=t < S)


@triton.jit
def _scores_bwd_k(Q, W, HI, DS, BITS, DK, S, G, H, NW, span, D: tl.constexpr, BT: tl.constexpr,
                  BG: tl.constexpr, PREC: tl.constexpr, PIECES: tl.constexpr):
    """This token split's share of dk[b, g] = sum_{t, h} [dot > 0] ds[t, g] w[t, h] q[t, h]
    (token tiles that see no entry of this tile skipped)."""
    b = tl.program_id(2).to(tl.int64)
    g0 = tl.program_id(0) * BG
    g = g0 + tl.arange(0, BG)
    part = tl.program_id(1)
    d = tl.arange(0, D)
    dk = tl.zeros([BG, D], tl.float32)
    for t0 in range(part * span, tl.minimum(part * span + span, S), BT):
        t = t0 + tl.arange(0, BT)
        if g0 < tl.max(_bounds(HI, b, t, S), 0):
            ds = _ds_tile(DS, b, t, g, S, G)
            for h in range(H):
                at, inside = _bits_at(BITS, b, t, h, g0, S, H, NW, BG)
                on = _unpack(tl.load(at, mask=inside, other=0), BT, BG)
                dd = tl.where(on, ds * _w_col(W, b, t, h, S, H)[:, None], 0.0)  # [BT, BG]
                if PIECES:
                    d0, d1, d2 = _bf16x3(tl.trans(dd))  # [BG, BT] each
                    qh = _q_rows(Q, b, t, h, S, H, D)
                    dk += _dot3(d0, d1, d2, qh, qh, qh, _UPCAST)  # [BG, D]
                else:
                    dk += _dot(tl.trans(dd), _q_tile(Q, b, t, h, S, H, D), PREC)
    tl.store(DK + ((part * tl.num_programs(2) + b) * G + g)[:, None] * D + d[None, :], dk, mask=(g < G)[:, None])


def _pieces_apply(q: torch.Tensor) -> bool:
    """Whether q's dots take the other operand in bf16 pieces ("bf16x3" and a bf16 q)."""
    return SCORE_PREC == "bf16x3" and q.dtype == torch.bfloat16


class _Scores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        b, s, h, d = q.shape
        g, t = k.shape[1], SCORE_TILES["fwd"]
        nw = triton.cdiv(g, 32)
        q, k, w = (x.contiguous() for x in (q, k, w))  # as they come: bf16 q read as such (bf16x3) or widened
        out = new_output((b, s, g), q, torch.float32)
        bits = new_output((b, s, h, nw), q, torch.int32)  # every word written (tiles past the bounds: zeros)
        if out.numel():
            _scores_fwd[(triton.cdiv(s, t["BT"]), triton.cdiv(g, t["BG"]), b)](
                q, k, w, hi, out, bits, s, g, h, nw, D=d, BT=t["BT"], BG=t["BG"], PREC=SCORE_PREC,
                PIECES=_pieces_apply(q), num_warps=t["warps"])
        ctx.save_for_backward(q, k, w, bits, hi)
        return out

    @staticmethod
    def backward(ctx, ds: torch.Tensor):
        q, k, w, bits, hi = ctx.saved_tensors
        b, s, h, d = q.shape
        g, t, nw = k.shape[1], SCORE_TILES["bwd"], bits.shape[-1]
        ds = ds.float().contiguous()
        dq, dw = new_output(q.shape, q, torch.float32), new_output(w.shape, q, torch.float32)
        span = tile_span(s, t["SPLIT"], t["BT"])
        parts = triton.cdiv(max(s, 1), span)
        dk = new_output((parts, b, g, d), q, torch.float32)
        if s and g:
            _scores_bwd_q[(triton.cdiv(s, t["BT"]), h, b)](q, k, w, hi, ds, bits, dq, dw, s, g, h, nw, D=d, BT=t["BT"],
                                                           BG=t["BG"], PREC=SCORE_PREC, num_warps=t["warps"])
            _scores_bwd_k[(triton.cdiv(g, t["BG"]), parts, b)](q, w, hi, ds, bits, dk, s, g, h, nw, span, D=d,
                                                               BT=t["BT"], BG=t["BG"], PREC=SCORE_PREC,
                                                               PIECES=_pieces_apply(q), num_warps=t["warps"])
        else:
            for x in (dq, dw, dk):
                x.zero_()
        return dq.to(q.dtype), dk.sum(0).to(k.dtype), dw.to(w.dtype), None


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, hi: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `ops.indexer_scores`: q [B, S, h, d], k [B, G, d], w [B, S, h] ->
    [B, S, G] fp32 = sum_h w relu(q_h . k_g), differentiable in q, k and w; entries g >= hi[b, t]
    (hi [B, S] int, None: all G) score 0 and pass no gradient."""
    b, s, h, d = q.shape
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != d or w.shape != (b, s, h):
        raise ValueError(f"indexer_scores: q {list(q.shape)}, k {list(k.shape)}, w {list(w.shape)} do not fit")
    if hi is not None and hi.shape != (b, s):
        raise ValueError(f"indexer_scores: bounds hi {list(hi.shape)} do not fit q {list(q.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"indexer_scores: head dim {d} must be a power of two >= 16")
    if any(t["BG"] % 32 for t in SCORE_TILES.values()):
        raise ValueError(f"indexer_scores: entry tiles {SCORE_TILES} must be multiples of 32 (gate words)")
    hi = (torch.full((b, s), k.shape[1], device=q.device, dtype=torch.int32) if hi is None
          else hi.to(device=q.device, dtype=torch.int32).contiguous())
    return _Scores.apply(q, k, w, hi)
