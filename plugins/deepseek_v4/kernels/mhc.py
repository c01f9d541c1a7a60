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

from . import INTERPRET, new_output, tile_span

BLOCK_R = 16 if INTERPRET else 64


@triton.jit
def _start(L, r0, R, n, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets [BLOCK, NP, NP], mask, and softmax(logits, -1) (padding 0)."""
    r = (r0 + tl.arange(0, BLOCK)).to(tl.int64)
    i = tl.arange(0, NP)
    offs = r[:, None, None] * n * n + i[None, :, None] * n + i[None, None, :]
    mask = (r < R)[:, None, None] & (i < n)[None, :, None] & (i < n)[None, None, :]
    x = tl.load(L + offs, mask=mask, other=float("-inf"))
    return offs, mask, _softmax(x, mask)


@triton.jit
def _softmax(x, mask):
    """Row softmax of a [BLOCK, NP, NP] tile whose padding is -inf (padding -> 0)."""
    mx = tl.max(x, 2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # padded rows: no NaN
    e = tl.where(mask, tl.exp(x - mx[:, :, None]), 0.0)
    den = tl.sum(e, 2)
    return e / tl.where(den == 0.0, 1.0, den)[:, :, None]


@triton.jit
def _sinkhorn_tile(p, mask, iters, eps):
    """The normalisation steps after the softmax p (see the module docstring)."""
    m = _norm(tl.where(mask, p + eps, 0.0), eps, False)
    for _ in range(iters - 1):
        m = _norm(_norm(m, eps, True), eps, False)
    return m


@triton.jit
def _sinkhorn_tile_bwd(p, mask, dy, BUF, sb, live, iters, eps, NP: tl.constexpr):
    """d logits of the Sinkhorn of softmax p for the output gradient dy: recompute the steps,
    keeping each one's input in BUF (offsets sb, [BLOCK, steps, NP, NP]), and walk them back."""
    steps = 2 * iters - 1
    z = tl.where(mask, p + eps, 0.0)
    for k in range(steps):  # step 0 and even steps normalise columns, odd steps rows
        tl.store(BUF + sb + k * NP * NP, z, mask=live)
        if k % 2 == 1:
            z = _norm(z, eps, True)
        else:
            z = _norm(z, eps, False)
    for kk in range(steps):
        k = steps - 1 - kk
        z = tl.load(BUF + sb + k * NP * NP, mask=live, other=0.0)
        if k % 2 == 1:
            dy = _norm_bwd(z, dy, eps, True)
        else:
            dy = _norm_bwd(z, dy, eps, False)
        # padding (n < NP): z = 0 there but dy / eps would grow to inf and turn 0 * inf into NaN
        dy = tl.where(mask, dy, 0.0)
    return p * (dy - tl.sum(dy * p, 2)[:, :, None])  # d(p + eps) = dp; softmax backward


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
    tl.store(OUT + offs, _sinkhorn_tile(p, mask, iters, eps), mask=mask)


@triton.jit
def _bwd(L, DY, DL, BUF, R, n, iters, eps, NP: tl.constexpr, BLOCK: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK
    offs, mask, p = _start(L, r0, R, n, NP, BLOCK)
    sb, live = _scratch(r0, R, iters, NP, BLOCK)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    tl.store(DL + offs, _sinkhorn_tile_bwd(p, mask, dy, BUF, sb, live, iters, eps, NP), mask=mask)


@triton.jit
def _scratch(r0, R, iters, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets and mask of rows r0.. in the [R, 2 * iters - 1, NP, NP] step scratch (padding
    entries are stored, as 0, too)."""
    r = r0 + tl.arange(0, BLOCK)
    i = tl.arange(0, NP)
    sb = r.to(tl.int64)[:, None, None] * (2 * iters - 1) * NP * NP + i[None, :, None] * NP + i[None, None, :]
    live = (r < R)[:, None, None] & (i < NP)[None, :, None] & (i < NP)[None, None, :]
    return sb, live


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


# --------------------------------------------------------------------------- mHC gates
# From the mixes' projection mm = flat(X) @ fn^T [R, m] and the streams' norm nrm = |flat(X)|
# [R] (K = n * d wide): mix = mm * rsqrt(nrm^2 / K + norm_eps); pre = sigmoid(mix[:n] s0 +
# b[:n]) + hc_eps; post = 2 sigmoid(mix[n:2n] s1 + b[n:2n]); comb = Sinkhorn(mix[2n:] s2 +
# b[2n:]) [n, n]. The reference takes about 13 launches forward and 45 backward around its
# Sinkhorn per site; here one each way, plus the sums of the per-program base and scale
# gradients. FULL = False is hc_head's gate (m = n: pre only). PARTS: mm and the squared norm
# come as the mixes kernel's P partial sums over K ([P, R, m], [P, R]); the forward sums them
# in order, takes the root, and stores mm and nrm for the backward (two sums and a root
# fewer launches a site than summing them through torch).


@triton.jit
def _sum_parts(PTR, offs, mask, P, stride):
    """sum_p PTR[p stride + offs] in the order p = 0, 1, .. (fp32)."""
    acc = tl.load(PTR + offs, mask=mask, other=0.0)
    for p in range(1, P):
        acc += tl.load(PTR + p * stride + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _gate_inputs(MM, NRM, BASE, SCALE, r0, R, n, m, K, norm_eps, P, NP: tl.constexpr, BLOCK: tl.constexpr,
                 PARTS: tl.constexpr):
    """Rows r0..: their row index r, norm nrm, rs = rsqrt(nrm^2 / K + eps), the pre group's
    mask, raw mm and logits [BLOCK, NP]. PARTS: MM and NRM hold P partial sums of mm and of
    nrm^2."""
    r = (r0 + tl.arange(0, BLOCK)).to(tl.int64)
    i = tl.arange(0, NP)
    if PARTS:
        nrm = tl.sqrt_rn(_sum_parts(NRM, r, r < R, P, R))
    else:
        nrm = tl.load(NRM + r, mask=r < R, other=0.0)
    rs = tl.rsqrt(nrm * nrm / K + norm_eps)
    vm = (r < R)[:, None] & (i < n)[None, :]
    raw = _sum_parts(MM, r[:, None] * m + i[None, :], vm, P, R * m)
    logit = raw * rs[:, None] * tl.load(SCALE) + tl.load(BASE + i, mask=i < n, other=0.0)[None, :]
    return r, nrm, rs, vm, raw, logit


@triton.jit
def _comb_inputs(MM, BASE, SCALE, r, R, n, m, rs, P, NP: tl.constexpr):
    """comb's [BLOCK, NP, NP] tile: offsets ij within a matrix, mask, raw mm and logits."""
    i = tl.arange(0, NP)
    ij = i[:, None] * n + i[None, :]
    mask = (r < R)[:, None, None] & ((i < n)[:, None] & (i < n)[None, :])[None]
    raw = _sum_parts(MM, r[:, None, None] * m + 2 * n + ij[None], mask, P, R * m)
    b = tl.load(BASE + 2 * n + ij, mask=(i < n)[:, None] & (i < n)[None, :], other=0.0)
    logit = tl.where(mask, raw * rs[:, None, None] * tl.load(SCALE + 2) + b[None], float("-inf"))
    return ij, mask, raw, logit


@triton.jit
def _gates_fwd(MM, NRM, BASE, SCALE, PRE, POST, COMB, MMS, NRMS, R, n, m, K, P, iters, hc_eps, norm_eps,
               NP: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr, PARTS: tl.constexpr):
    """PARTS: MM, NRM are partial sums (see `_gate_inputs`); mm and nrm go to MMS, NRMS."""
    r, nrm, rs, vm, raw, a = _gate_inputs(MM, NRM, BASE, SCALE, tl.program_id(0) * BLOCK, R, n, m, K, norm_eps,
                                          P, NP, BLOCK, PARTS)
    i = tl.arange(0, NP)
    tl.store(PRE + r[:, None] * n + i[None, :], tl.sigmoid(a) + hc_eps, mask=vm)
    if PARTS:
        tl.store(NRMS + r, nrm, mask=r < R)
        tl.store(MMS + r[:, None] * m + i[None, :], raw, mask=vm)
    if FULL:
        raw_b = _sum_parts(MM, r[:, None] * m + n + i[None, :], vm, P, R * m)
        b = raw_b * rs[:, None] * tl.load(SCALE + 1) + tl.load(BASE + n + i, mask=i < n, other=0.0)[None, :]
        tl.store(POST + r[:, None] * n + i[None, :], 2 * tl.sigmoid(b), mask=vm)
        ij, mask, raw_c, c = _comb_inputs(MM, BASE, SCALE, r, R, n, m, rs, P, NP)
        comb = _sinkhorn_tile(_softmax(c, mask), mask, iters, hc_eps)
        tl.store(COMB + r[:, None, None] * n * n + ij[None], comb, mask=mask)
        if PARTS:
            tl.store(MMS + r[:, None] * m + n + i[None, :], raw_b, mask=vm)
            tl.store(MMS + r[:, None, None] * m + 2 * n + ij[None], raw_c, mask=mask)


@triton.jit
def _gates_bwd(MM, NRM, BASE, SCALE, DPRE, DPOST, DCOMB, DMM, DNRM, DBASE, DSCALE, BUF, R, n, m, K, iters,
               hc_eps, norm_eps, NP: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr, AS_C: tl.constexpr):
    """AS_C: DNRM takes dnrm / nrm (0 where nrm = 0), the factor of x in the norm's gradient
    (what the mixes' backward takes), instead of dnrm."""
    pid = tl.program_id(0)
    r0 = pid * BLOCK
    r, nrm, rs, vm, raw, a = _gate_inputs(MM, NRM, BASE, SCALE, r0, R, n, m, K, norm_eps, 1, NP, BLOCK, False)
    i = tl.arange(0, NP)
    sa = tl.sigmoid(a)
    da = tl.load(DPRE + r[:, None] * n + i[None, :], mask=vm, other=0.0) * sa * (1 - sa)  # d logit
    # per program: d base = sum of d logit, d scale = sum of d logit * mix; d mm = d mix * rs
    tl.store(DBASE + pid * m + i, tl.sum(da, 0), mask=i < n)
    s0 = tl.load(SCALE)
    tl.store(DMM + r[:, None] * m + i[None, :], da * s0 * rs[:, None], mask=vm)
    drs = tl.sum(da * s0 * raw, 1)  # [BLOCK]: d rs = sum over the row of d mix * mm
    if FULL:
        tl.store(DSCALE + pid * 3, tl.sum(tl.sum(da * raw, 1) * rs, 0))
        raw_b = tl.load(MM + r[:, None] * m + n + i[None, :], mask=vm, other=0.0)
        s1 = tl.load(SCALE + 1)
        sb = tl.sigmoid(raw_b * rs[:, None] * s1 + tl.load(BASE + n + i, mask=i < n, other=0.0)[None, :])
        db = tl.load(DPOST + r[:, None] * n + i[None, :], mask=vm, other=0.0) * 2 * sb * (1 - sb)
        tl.store(DBASE + pid * m + n + i, tl.sum(db, 0), mask=i < n)
        tl.store(DSCALE + pid * 3 + 1, tl.sum(tl.sum(db * raw_b, 1) * rs, 0))
        tl.store(DMM + r[:, None] * m + n + i[None, :], db * s1 * rs[:, None], mask=vm)
        drs += tl.sum(db * s1 * raw_b, 1)
        ij, mask, raw_c, c = _comb_inputs(MM, BASE, SCALE, r, R, n, m, rs, 1, NP)
        s2 = tl.load(SCALE + 2)
        sbuf, live = _scratch(r0, R, iters, NP, BLOCK)
        dy = tl.load(DCOMB + r[:, None, None] * n * n + ij[None], mask=mask, other=0.0)
        dc = tl.where(mask, _sinkhorn_tile_bwd(_softmax(c, mask), mask, dy, BUF, sbuf, live, iters, hc_eps, NP), 0.0)
        tl.store(DBASE + pid * m + 2 * n + ij, tl.sum(dc, 0), mask=(i < n)[:, None] & (i < n)[None, :])
        tl.store(DSCALE + pid * 3 + 2, tl.sum(tl.sum(tl.sum(dc * raw_c, 2), 1) * rs, 0))
        tl.store(DMM + r[:, None, None] * m + 2 * n + ij[None], dc * s2 * rs[:, None, None], mask=mask)
        drs += tl.sum(tl.sum(dc * s2 * raw_c, 2), 1)
    else:
        tl.store(DSCALE + pid, tl.sum(tl.sum(da * raw, 1) * rs, 0))
    # rs = (nrm^2 / K + eps)^(-1/2): d nrm = d rs * (-rs^3 nrm / K)
    dnrm = -drs * rs * rs * rs * nrm / K
    if AS_C:  # d|x| / dx = x / |x| (0 at x = 0, as torch's norm backward)
        dnrm = tl.where(nrm > 0, tl.div_rn(dnrm, tl.where(nrm > 0, nrm, 1.0)), 0.0)
    tl.store(DNRM + r, dnrm, mask=r < R)


def _gates_forward(mm, nrm, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float, width: int,
                   sq: torch.Tensor | None = None):
    """(pre, post, comb) fp32 and what the backward keeps (tensors, then the arguments): the
    first two kept tensors are mm [R, m] and nrm [R]. With sq, mm [P, ..., m] and sq [P, ...]
    are P partial sums of mm and of nrm^2 (fp32; nrm is not read)."""
    parts = sq is not None
    p = mm.shape[0] if parts else 1
    *lead, m = mm.shape[1:] if parts else mm.shape
    full = m != n
    if parts:
        mmp, nrmp = mm.reshape(p, -1, m).contiguous(), sq.reshape(p, -1).contiguous()
        r = nrmp.shape[1]
        mm2, nrm2 = new_output((r, m), mmp, torch.float32), new_output((r,), mmp, torch.float32)
    else:
        mm2, nrm2 = mm.float().reshape(-1, m).contiguous(), nrm.float().reshape(-1).contiguous()
        mmp, nrmp, r = mm2, nrm2, nrm2.numel()
    base, scale = base.float().contiguous(), scale.float().contiguous()
    pre = new_output((*lead, n), mm2, torch.float32)
    post = new_output((*lead, n if full else 0), mm2, torch.float32)
    comb = new_output((*lead, n if full else 0, n if full else 0), mm2, torch.float32)
    if r:
        _gates_fwd[(triton.cdiv(r, BLOCK_R),)](mmp, nrmp, base, scale, pre, post, comb, mm2, nrm2, r, n, m,
                                               float(width), p, iters, hc_eps, norm_eps,
                                               NP=triton.next_power_of_2(n), BLOCK=BLOCK_R, FULL=full, PARTS=parts)
    return pre, post, comb, (mm2, nrm2, base, scale), (n, iters, hc_eps, norm_eps, width, full, (*lead, m),
                                                       tuple(lead))


def _gates_backward(kept, args, dpre, dpost, dcomb, as_c: bool = False):
    """(dmm, dnrm, dbase, dscale) from the forward's kept tensors and arguments; as_c: dnrm /
    nrm (0 where nrm = 0) in dnrm's place."""
    mm2, nrm2, base, scale = kept
    n, iters, hc_eps, norm_eps, width, full, mm_shape, nrm_shape = args
    r, m = mm2.shape
    progs, np_ = triton.cdiv(r, BLOCK_R), triton.next_power_of_2(n)
    dmm, dnrm = new_output(mm2.shape, mm2, torch.float32), new_output(nrm2.shape, mm2, torch.float32)
    dbase = new_output((progs, m), mm2, torch.float32)
    dscale = new_output((progs, scale.numel()), mm2, torch.float32)
    if r:
        buf = torch.empty(r if full else 1, 2 * iters - 1 if full else 1, np_, np_, device=mm2.device,
                          dtype=torch.float32)
        _gates_bwd[(progs,)](mm2, nrm2, base, scale, dpre.float().contiguous(), dpost.float().contiguous(),
                             dcomb.float().contiguous(), dmm, dnrm, dbase, dscale, buf, r, n, m, float(width),
                             iters, hc_eps, norm_eps, NP=np_, BLOCK=BLOCK_R, FULL=full, AS_C=as_c)
    return dmm.view(mm_shape), dnrm.view(nrm_shape), dbase.sum(0), dscale.sum(0)


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mm, nrm, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float, width: int):
        pre, post, comb, kept, ctx.args = _gates_forward(mm, nrm, base, scale, n, iters, hc_eps, norm_eps, width)
        ctx.save_for_backward(*kept)
        return pre, post, comb

    @staticmethod
    def backward(ctx, dpre, dpost, dcomb):
        return (*_gates_backward(ctx.saved_tensors, ctx.args, dpre, dpost, dcomb), None, None, None, None, None)


def hc_gates(mm: torch.Tensor, nrm: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
             hc_eps: float, norm_eps: float, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's gates from mm = flat(X) @ fn^T [..., m] and nrm = |flat(X)|_2 [...] of a `width`
    = n * d wide flat(X): pre, post [..., n] and comb [..., n, n], fp32, as `ops.hc_pre` computes
    them (m = n(n + 2)); m = n is hc_head's gate (pre only; post and comb come back empty)."""
    m = mm.shape[-1]
    if m not in (n, n * (n + 2)):
        raise ValueError(f"hc_gates: mm has {m} columns; expected n = {n} or n(n + 2) = {n * (n + 2)}")
    if mm.shape[:-1] != nrm.shape or base.numel() != m or scale.numel() != (3 if m != n else 1):
        raise ValueError(f"hc_gates: mm {list(mm.shape)}, nrm {list(nrm.shape)}, base {list(base.shape)}, "
                         f"scale {list(scale.shape)} do not fit together")
    if iters < 1:
        raise ValueError(f"hc_gates: iters must be >= 1, got {iters}")
    return _Gates.apply(mm, nrm, base, scale, n, iters, hc_eps, norm_eps, width)


# --------------------------------------------------------------------------- mixes' inputs
# The gates read mm = flat(X) @ fn^T [R, m] and nrm = |flat(X)|_2 [R] of the flat streams
# [R, K] (K = n * d, m = 24 or 4 columns). Through torch these cost an fp32 copy of the
# streams for the projection and, in the backward, the norm's autograd chain (a div, a
# masked_fill, a mul and casts over [R, K] fp32: ~22 ms of the ~1B step's 250 on an H100)
# plus a separate [R, K] gradient from the projection. Here one pass reads the streams each
# way: mm and nrm forward; dx = dmm @ fn + (dnrm / nrm) x and fn's gradient (per-program
# partials over row groups, one sum: deterministic) backward.
# The dots: bf16 streams are exact in bf16, so "bf16x3" splits only the fp32 operand (fn
# forward, dmm in fn's gradient) into three bf16 pieces that sum to it exactly and runs three
# bf16 dots: exact products summed in fp32, at the bf16 tensor-core rate. The streams'
# gradient dmm @ fn (both fp32, an inner dimension of m) takes the first two pieces of each
# (`dx_pieces`: four bf16 dots, ~2^-16 relative, for a gradient stored in bf16); fp32 streams
# take "tf32x3" for every dot (three TF32 products). "ieee" FMA dots measured 4x slower.
# The tiles: `benchmarks/mixes_gpu.py`'s fastest over the model's calls at V4's widths
# ([4096, 16384] bf16; a block's two hc_pre at m = 24, the heads' hc_head at m = 4; alone, each
# m has a slightly faster backward tile); docs/performance.md has the sweep and the floor.
# The forward may split K over SPLIT programs a row block (per-split partials, summed by the
# gates kernel); each backward program owns a column block of a row group (GROUPS groups;
# fn's partials per group).
MIX_FWD = dict(BS=16, BK=16, SPLIT=1, warps=4) if INTERPRET else dict(BS=64, BK=64, SPLIT=8, warps=4)
MIX_BWD = (dict(BS=16, BK=16, GROUPS=2, warps=4, prefetch=True, dx_pieces=True) if INTERPRET else
           dict(BS=16, BK=128, GROUPS=8, warps=4, stages=1, prefetch=True, dx_pieces=True))
MIX_PREC = "bf16x3"


@triton.jit
def _bf16x3(v):
    """Three bf16 tensors summing exactly to fp32 v (each piece takes the next 8 significant
    bits; exact for normal v whether .to rounds or truncates, as Triton's interpreter does)."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot3(a0, a1, a2, b0, b1, b2, UPCAST: tl.constexpr):
    """sum_i a_i @ b_i of bf16 operands (exact products, fp32 sums): one side is the three
    pieces of `_bf16x3`, the other the same bf16 tensor thrice. From a zero accumulator, the
    small pieces first: the caller adds the result to its running sum in fp32. The H100's MMA
    loses low bits when it accumulates (measured: chaining a 6144-long row's products through
    its accumulator erred by 2.1e-5, halving with each halving of the chain), so a long sum
    must not run inside it. UPCAST: Triton 3.6's interpreter misreads bf16 dot operands
    (garbage, measured), so there the same exact values go in as fp32."""
    if UPCAST:
        a0, a1, a2 = a0.to(tl.float32), a1.to(tl.float32), a2.to(tl.float32)
        b0, b1, b2 = b0.to(tl.float32), b1.to(tl.float32), b2.to(tl.float32)
    return tl.dot(a0, b0, tl.dot(a1, b1, tl.dot(a2, b2)))


@triton.jit
def _mixes_fwd(X, FN, MM, SQ, R, K, m, kspan, MP: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program (row block, K split): partial mm [BS, m] and sum of squares [BS] of its slab."""
    r = tl.program_id(0) * BS + tl.arange(0, BS)
    part = tl.program_id(1)
    j = tl.arange(0, MP)
    rows = r < R
    acc = tl.zeros([BS, MP], tl.float32)
    sq = tl.zeros([BS], tl.float32)
    for k0 in range(part * kspan, tl.minimum(part * kspan + kspan, K), BK):
        c = k0 + tl.arange(0, BK)
        x = tl.load(X + r.to(tl.int64)[:, None] * K + c[None, :], mask=rows[:, None] & (c < K)[None, :],
                    other=0.0)  # [BS, BK]
        w = tl.load(FN + j[:, None] * K + c[None, :], mask=(j < m)[:, None] & (c < K)[None, :], other=0.0)
        xf = x.to(tl.float32)
        if PREC == "bf16x3":
            hi, mid, lo = _bf16x3(tl.trans(w))  # [BK, MP] each
            acc += _dot3(x, x, x, hi, mid, lo, UPCAST)  # [BS, MP]
        else:
            acc += tl.dot(xf, tl.trans(w), input_precision=PREC)  # [BS, MP]
        sq += tl.sum(xf * xf, 1)
    tl.store(MM + (part * R + r)[:, None] * m + j[None, :], acc, mask=rows[:, None] & (j < m)[None, :])
    tl.store(SQ + part * R + r, sq, mask=rows)


@triton.jit
def _bwd_loads(X, DMM, C, W, DU, DXP, r0, hi, K, m, n, d, c, cols, j, e, stream, BS: tl.constexpr,
               ADD_WDU: tl.constexpr, ADD_DXP: tl.constexpr, IN_STREAM: tl.constexpr):
    """One row step's loads of `_mixes_bwd` (rows r0.. below hi), raw: a prefetch of the next
    step is consumed only in that step."""
    r = r0 + tl.arange(0, BS)
    rows = r < hi
    offs = r.to(tl.int64)[:, None] * K + c[None, :]
    mask = rows[:, None] & cols[None, :]
    xs = tl.load(X + offs, mask=mask, other=0.0)
    g = tl.load(DMM + r[:, None] * m + j[None, :], mask=rows[:, None] & (j < m)[None, :], other=0.0)
    s = tl.load(C + r, mask=rows, other=0.0)
    if ADD_WDU:
        if IN_STREAM:
            wi = tl.load(W + r * n + stream, mask=rows, other=0.0)[:, None]  # [BS, 1]
        else:
            wi = tl.load(W + r[:, None] * n + (c // d)[None, :], mask=mask, other=0.0)
        du = tl.load(DU + r.to(tl.int64)[:, None] * d + e[None, :], mask=mask, other=0.0)
    else:
        wi = tl.zeros([BS, 1], tl.float32)
        du = xs
    if ADD_DXP:
        dxp = tl.load(DXP + offs, mask=mask, other=0.0)
    else:
        dxp = xs
    return xs, g, s, wi, du, dxp


@triton.jit
def _dot2x2(a0, a1, b0, b1, UPCAST: tl.constexpr):
    """(a0 + a1) @ (b0 + b1) of bf16 pieces: the four products, the small ones first from a zero
    accumulator (exact products, fp32 sums). With a and b each the first two pieces of
    `_bf16x3`, that is a @ b to ~2^-16 relative (the third pieces' terms left out). UPCAST: as
    `_dot3`'s."""
    if UPCAST:
        a0, a1, b0, b1 = a0.to(tl.float32), a1.to(tl.float32), b0.to(tl.float32), b1.to(tl.float32)
    return tl.dot(a0, b0, tl.dot(a0, b1, tl.dot(a1, b0, tl.dot(a1, b1))))


@triton.jit
def _mixes_bwd(X, FN, DMM, C, DX, DFN, W, DU, DXP, R, K, m, span, n, d, MP: tl.constexpr, BS: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, ADD_WDU: tl.constexpr,
               ADD_DXP: tl.constexpr, IN_STREAM: tl.constexpr, PREFETCH: tl.constexpr, DX_PIECES: tl.constexpr):
    """Program (column block, row group): dx of its [span, BK] slab, fn's partial gradient.
    dx's dmm @ fn: DX_PIECES (bf16 streams) as the four bf16 products of dmm's and fn's first
    two pieces (fn's split once, out of the loop), ~2^-16 relative, far below dx's bf16 store;
    otherwise tf32x3. At V4's widths ([4096, 16384], m = 24, H200) the tf32x3 dot was half of
    this kernel's 281 us (the kernel without it: 144; without any dot: 132); as pieces on a
    16 x 128 tile, 211 (benchmarks/mixes_gpu.py, docs/performance.md).
    ADD_WDU: dx also takes the stream sum's gradient W[r, i] DU[r, e] at column i d + e (X [R,
    n d] flat, W [R, n], DU [R, d]), the other use of X in hc_pre; IN_STREAM: each column
    block lies in one stream (BK divides d), so W is one column and DU's columns are a
    contiguous run (loads the compiler can vectorise; c // d and c % d hide that). ADD_DXP:
    and DXP [R, K], the gradient of X from its use after hc_pre (hc_post's), added in fp32
    before the store. PREFETCH: the next row step's loads go out before this step's work
    (Triton's pipelining covers the dots' operands only; dxp, du and w waited each step)."""
    c = tl.program_id(0) * BK + tl.arange(0, BK)
    grp = tl.program_id(1)
    j = tl.arange(0, MP)
    cols, fm = c < K, (j < m)[:, None] & (c < K)[None, :]
    w = tl.load(FN + j[:, None] * K + c[None, :], mask=fm, other=0.0)  # [MP, BK]
    if DX_PIECES:  # fn's first two bf16 pieces, once
        w0 = w.to(tl.bfloat16)
        w1 = (w - w0.to(tl.float32)).to(tl.bfloat16)
    dw = tl.zeros([MP, BK], tl.float32)
    if IN_STREAM:
        stream = tl.program_id(0) * BK // d
        e = tl.program_id(0) * BK - stream * d + tl.arange(0, BK)  # columns within the stream
    else:
        stream = 0
        e = c % d
    lo = grp * span
    hi = tl.minimum(lo + span, R)
    if PREFETCH:
        xs, g, s, wi, du, dxp = _bwd_loads(X, DMM, C, W, DU, DXP, lo, hi, K, m, n, d, c, cols, j, e, stream, BS,
                                           ADD_WDU, ADD_DXP, IN_STREAM)
    for r0 in range(lo, hi, BS):
        if PREFETCH:
            nx = _bwd_loads(X, DMM, C, W, DU, DXP, r0 + BS, hi, K, m, n, d, c, cols, j, e, stream, BS, ADD_WDU,
                            ADD_DXP, IN_STREAM)
        else:
            xs, g, s, wi, du, dxp = _bwd_loads(X, DMM, C, W, DU, DXP, r0, hi, K, m, n, d, c, cols, j, e, stream,
                                               BS, ADD_WDU, ADD_DXP, IN_STREAM)
        r = r0 + tl.arange(0, BS)
        offs = r.to(tl.int64)[:, None] * K + c[None, :]
        mask = (r < hi)[:, None] & cols[None, :]
        x = xs.to(tl.float32)
        if DX_PIECES:
            g0, g1, g2 = _bf16x3(g)  # [BS, MP] each
            dx = _dot2x2(g0, g1, w0, w1, UPCAST)  # [BS, BK]
        else:
            dx = tl.dot(g, w, input_precision="tf32x3" if PREC == "bf16x3" else PREC)  # [BS, BK]
        dx += s[:, None] * x
        if ADD_WDU:
            dx += wi * du.to(tl.float32)
        if ADD_DXP:
            dx += dxp.to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if PREC == "bf16x3":
            if DX_PIECES:  # the same pieces, transposed
                dw += _dot3(tl.trans(g0), tl.trans(g1), tl.trans(g2), xs, xs, xs, UPCAST)  # [MP, BK]
            else:
                h0, h1, h2 = _bf16x3(tl.trans(g))  # [MP, BS] each
                dw += _dot3(h0, h1, h2, xs, xs, xs, UPCAST)  # [MP, BK]
        else:
            dw += tl.dot(tl.trans(g), x, input_precision=PREC)  # [MP, BK]
        if PREFETCH:
            xs, g, s, wi, du, dxp = nx
    tl.store(DFN + grp * m * K + j[:, None] * K + c[None, :], dw, mask=fm)


def _in_stream(d: int, bk: int) -> bool:
    """Whether each BK-wide column block of the flat streams lies within one stream of d."""
    return d % bk == 0


def _precision(x: torch.Tensor) -> str:
    """MIX_PREC, except that "bf16x3" needs bf16 streams (fp32 streams take tf32x3)."""
    return "tf32x3" if MIX_PREC == "bf16x3" and x.dtype != torch.bfloat16 else MIX_PREC


def _mixes_partials(x: torch.Tensor, fn: torch.Tensor):
    """P partial sums over K of mm = flat(X) @ fn^T [P, R, m] and of the squared norm [P, R]
    (fp32), the flat streams x2 [R, K] and fn32 [m, K] (what the backward keeps)."""
    k, m = x.shape[-1], fn.shape[0]
    x2, fn32 = x.reshape(-1, k).contiguous(), fn.float().contiguous()
    r, t = x2.shape[0], MIX_FWD
    kspan = tile_span(k, t["SPLIT"], t["BK"])
    parts = triton.cdiv(max(k, 1), kspan)
    mm, sq = new_output((parts, r, m), x2, torch.float32), new_output((parts, r), x2, torch.float32)
    if r:
        _mixes_fwd[(triton.cdiv(r, t["BS"]), parts)](x2, fn32, mm, sq, r, k, m, kspan,
                                                     MP=max(16, triton.next_power_of_2(m)), BS=t["BS"],
                                                     BK=t["BK"], PREC=_precision(x2), UPCAST=INTERPRET,
                                                     num_warps=t["warps"], num_stages=t.get("stages", 3))
    return mm, sq, x2, fn32


def _mixes_forward(x: torch.Tensor, fn: torch.Tensor):
    """(mm [..., m], nrm [...]) fp32 of flat streams x [..., K], and what the backward keeps."""
    *lead, m = (*x.shape[:-1], fn.shape[0])
    mm, sq, x2, fn32 = _mixes_partials(x, fn)
    mm, nrm = (mm[0], sq[0].sqrt()) if mm.shape[0] == 1 else (mm.sum(0), sq.sum(0).sqrt())
    return mm.view(*lead, m), nrm.view(lead), (x2, fn32, nrm)


def _mixes_backward(kept, dmm, dnrm, fn_dtype: torch.dtype, w: torch.Tensor | None = None,
                    du: torch.Tensor | None = None, dxp: torch.Tensor | None = None, c: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [R, K] in x's dtype, dfn [m, K]) from the forward's `kept`; with w [R, n] and du
    [R, d] (K = n d), dx also takes w[r, i] du[r, :] in stream i (the stream sum's gradient);
    with dxp [R, K], dx also takes it (x's gradient from its other users); c [R] fp32 in
    place of dnrm: dnrm / nrm, as `_gates_backward(as_c=True)` gives it."""
    x2, fn32, nrm = kept
    (r, k), m, t = x2.shape, fn32.shape[0], MIX_BWD
    dmm = torch.zeros(r, m, device=x2.device) if dmm is None else dmm.float().reshape(r, m).contiguous()
    # d|x| / dx = x / |x| (0 at x = 0, as torch's norm backward)
    if c is None:
        c = (torch.zeros_like(nrm) if dnrm is None
             else torch.where(nrm > 0, dnrm.float().reshape(r) / nrm, 0.0).contiguous())
    span = tile_span(r, t["GROUPS"], t["BS"])
    groups = triton.cdiv(max(r, 1), span)
    dx = new_output((r, k), x2, x2.dtype)
    dfn = new_output((groups, m, k), x2, torch.float32)
    add = w is not None
    n = w.shape[-1] if add else 1
    pieces = t.get("dx_pieces", False) and _precision(x2) == "bf16x3"
    if r:
        _mixes_bwd[(triton.cdiv(k, t["BK"]), groups)](x2, fn32, dmm, c, dx, dfn, w if add else c,
                                                      du.contiguous() if add else c,
                                                      c if dxp is None else dxp.reshape(r, k).contiguous(),
                                                      r, k, m, span, n, k // n,
                                                      MP=max(16, triton.next_power_of_2(m)), BS=t["BS"],
                                                      BK=t["BK"], PREC=_precision(x2), UPCAST=INTERPRET, ADD_WDU=add,
                                                      ADD_DXP=dxp is not None,
                                                      IN_STREAM=_in_stream(k // n, t["BK"]),
                                                      PREFETCH=t.get("prefetch", False), DX_PIECES=pieces,
                                                      num_warps=t["warps"],
                                                      num_stages=t.get("stages", 3))
    else:
        dfn.zero_()
    return dx, dfn.sum(0).to(fn_dtype)


class _Mixes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: torch.Tensor):
        mm, nrm, kept = _mixes_forward(x, fn)
        ctx.save_for_backward(*kept)
        ctx.shapes = (x.shape, fn.dtype)
        return mm, nrm

    @staticmethod
    def backward(ctx, dmm, dnrm):
        x_shape, fn_dtype = ctx.shapes
        dx, dfn = _mixes_backward(ctx.saved_tensors, dmm, dnrm, fn_dtype)
        return dx.view(x_shape), dfn


def stream_mixes(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat(X) @ fn^T [..., m], |flat(X)|_2 [...]) in fp32 from the flat streams x [..., K]
    (any float dtype) and fn [m, K]: the inputs of `hc_gates`, one read of x each way."""
    if fn.dim() != 2 or fn.shape[1] != x.shape[-1]:
        raise ValueError(f"stream_mixes: fn {list(fn.shape)} does not fit x {list(x.shape)} (expected [m, K])")
    return _Mixes.apply(x, fn)


# --------------------------------------------------------------------------- stream mixing
# Per token: u = sum_i pre_i X_i (hc_pre, hc_head) and X'_j = post_j F + sum_i comb[i, j] X_i
# (hc_post), in fp32 registers over D chunks, stored in x.dtype. The reference upcasts the
# [R, n, d] streams to fp32 and runs tiny batched matmuls (several full passes each way).
# H100, [4096, 4, 1536] bf16, us (train_gpu's shape): BD 256 and 4 warps ran the stream sum
# forward in 225 and hc_post's backward in 323 (a tenth of the copy bandwidth); BD 512 and 2
# warps 29 and 76 (hc_post forward and the stream sum's backward ~45 either way).
BLOCK_D = 32 if INTERPRET else 512
MIX_WARPS = 2


@triton.jit
def _rows(X, r, n, d, d0, NP: tl.constexpr, BD: tl.constexpr):
    """Offsets and mask of X[r, :n, d0:d0+BD] in a contiguous [R, n, d] tensor."""
    i = tl.arange(0, NP)
    c = d0 + tl.arange(0, BD)
    return r * n * d + i[:, None] * d + c[None, :], (i < n)[:, None] & (c < d)[None, :]


@triton.jit
def _wsum_fwd(W, X, U, n, d, NP: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BD
    i = tl.arange(0, NP)
    w = tl.load(W + r * n + i, mask=i < n, other=0.0)
    offs, m = _rows(X, r, n, d, d0, NP, BD)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    c = d0 + tl.arange(0, BD)
    tl.store(U + r * d + c, tl.sum(w[:, None] * x, 0).to(U.dtype.element_ty), mask=c < d)


@triton.jit
def _wsum_bwd(W, X, DU, DW, DX, n, d, NP: tl.constexpr, BD: tl.constexpr, WRITE_DX: tl.constexpr = True):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    w = tl.load(W + r * n + i, mask=i < n, other=0.0)
    dw = tl.zeros([NP], tl.float32)
    for d0 in range(0, d, BD):
        offs, m = _rows(X, r, n, d, d0, NP, BD)
        c = d0 + tl.arange(0, BD)
        du = tl.load(DU + r * d + c, mask=c < d, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        if WRITE_DX:  # else the caller adds w du into X's gradient itself
            tl.store(DX + offs, (w[:, None] * du[None, :]).to(DX.dtype.element_ty), mask=m)
        dw += tl.sum(x * du[None, :], 1)
    tl.store(DW + r * n + i, dw, mask=i < n)


@triton.jit
def _post_fwd(F, X, P, C, OUT, n, d, NP: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BD
    i = tl.arange(0, NP)
    post = tl.load(P + r * n + i, mask=i < n, other=0.0)
    comb = tl.load(C + r * n * n + i[:, None] * n + i[None, :], mask=(i < n)[:, None] & (i < n)[None, :], other=0.0)
    offs, m = _rows(X, r, n, d, d0, NP, BD)
    c = d0 + tl.arange(0, BD)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)  # [NP(i), BD]
    f = tl.load(F + r * d + c, mask=c < d, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], 0)  # [NP(j), BD]: sum_i comb[i, j] X_i
    tl.store(OUT + offs, (post[:, None] * f[None, :] + mixed).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _post_bwd(F, X, P, C, DO, DF, DX, DP, DC, n, d, NP: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    nn = (i < n)[:, None] & (i < n)[None, :]
    post = tl.load(P + r * n + i, mask=i < n, other=0.0)
    comb = tl.load(C + r * n * n + i[:, None] * n + i[None, :], mask=nn, other=0.0)
    dpost = tl.zeros([NP], tl.float32)
    dcomb = tl.zeros([NP, NP], tl.float32)
    for d0 in range(0, d, BD):
        offs, m = _rows(X, r, n, d, d0, NP, BD)
        c = d0 + tl.arange(0, BD)
        do = tl.load(DO + offs, mask=m, other=0.0).to(tl.float32)  # [NP(j), BD]
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)  # [NP(i), BD]
        f = tl.load(F + r * d + c, mask=c < d, other=0.0).to(tl.float32)
        tl.store(DX + offs, tl.sum(comb[:, :, None] * do[None, :, :], 1).to(DX.dtype.element_ty), mask=m)
        tl.store(DF + r * d + c, tl.sum(post[:, None] * do, 0).to(DF.dtype.element_ty), mask=c < d)
        dpost += tl.sum(do * f[None, :], 1)
        dcomb += tl.sum(x[:, None, :] * do[None, :, :], 2)
    tl.store(DP + r * n + i, dpost, mask=i < n)
    tl.store(DC + r * n * n + i[:, None] * n + i[None, :], dcomb, mask=nn)


def _mix(kernel, grid, *args, **flags) -> None:
    """Launch a stream-mixing kernel; args end with (n, d)."""
    kernel[grid](*args, NP=triton.next_power_of_2(args[-2]), BD=BLOCK_D, num_warps=MIX_WARPS, **flags)


def _grid_rows(r: int, d: int) -> tuple[int, int]:
    return (r, triton.cdiv(d, BLOCK_D))


def _wsum_forward(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """u [..., d] = sum_i w[..., i] x[..., i, :] (w fp32 contiguous, x contiguous)."""
    *lead, n, d = x.shape
    r = x.numel() // (n * d) if n * d else 0
    u = new_output((*lead, d), x, x.dtype)
    if r and d:
        _mix(_wsum_fwd, _grid_rows(r, d), w, x, u, n, d)
    return u


def _wsum_backward(w: torch.Tensor, x: torch.Tensor, du: torch.Tensor, write_dx: bool = True):
    """(dw fp32, dx or None): dx = w du per stream, left to the caller when not write_dx."""
    n, d = x.shape[-2:]
    r = x.numel() // (n * d) if n * d else 0
    dw = new_output(w.shape, x, torch.float32)
    dx = new_output(x.shape, x, x.dtype) if write_dx else None
    if r and d:
        _mix(_wsum_bwd, (r,), w, x, du.contiguous(), dw, dx if write_dx else dw, n, d, WRITE_DX=write_dx)
    else:
        for t in (dw, dx):
            if t is not None:
                t.zero_()
    return dw, dx


class _WeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x, w = x.contiguous(), w.float().contiguous()
        ctx.save_for_backward(w, x)
        return _wsum_forward(w, x)

    @staticmethod
    def backward(ctx, du: torch.Tensor):
        return _wsum_backward(*ctx.saved_tensors, du)


class _PreStreams(torch.autograd.Function):
    """mHC before a sublayer on the kernels as one autograd node: (mm, nrm) = the mixes of the
    streams X, (pre, post, comb) = the gates of them, u = sum_i pre_i X_i. X's gradient is
    written once: the mixes' backward adds the stream sum's pre_i du to its own (as separate
    nodes, autograd added two [R, n, d] gradients in another pass). X also comes out of the
    node (a view of the input, or its contiguous copy): a user of it (hc_post) has its X
    gradient added in the same pass, where autograd would add it to this node's in one more."""

    @staticmethod
    def forward(ctx, x, fn, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float):
        ctx.set_materialize_grads(False)  # no zeros for an unused output (the view, hc_head's post)
        x = x.contiguous()
        flat = x.flatten(-2)  # [..., n d]
        mm, sq, x2, fn32 = _mixes_partials(flat, fn)  # [P, R, m], [P, R]: the gates sum them
        lead = flat.shape[:-1]
        pre, post, comb, kept_g, ctx.args = _gates_forward(mm.view(-1, *lead, mm.shape[-1]), None, base, scale, n,
                                                           iters, hc_eps, norm_eps, flat.shape[-1],
                                                           sq=sq.view(-1, *lead))
        # detached: a saved view of an output (x is one when the input was not contiguous) would
        # hold this node through its base until the backward ran
        ctx.save_for_backward(x2.detach(), fn32, kept_g[1], *kept_g, pre)
        ctx.shapes, ctx.gate_shapes = (x.shape, fn.dtype), (post.shape, comb.shape)
        return _wsum_forward(pre, x), post, comb, x

    @staticmethod
    def backward(ctx, du, dpost, dcomb, dxp):
        *kept, pre = ctx.saved_tensors
        kept_m, kept_g = kept[:3], kept[3:]
        x_shape, fn_dtype = ctx.shapes
        x = kept_m[0].view(x_shape)  # the streams the mixes kept (flat, contiguous)
        post_shape, comb_shape = ctx.gate_shapes
        du = x.new_zeros(*x_shape[:-2], x_shape[-1]) if du is None else du
        dpost = pre.new_zeros(post_shape) if dpost is None else dpost
        dcomb = pre.new_zeros(comb_shape) if dcomb is None else dcomb
        dpre, _ = _wsum_backward(pre, x, du, write_dx=False)
        dmm, c, dbase, dscale = _gates_backward(kept_g, ctx.args, dpre, dpost, dcomb, as_c=True)
        n = x_shape[-2]
        dx, dfn = _mixes_backward(kept_m, dmm, None, fn_dtype, w=pre.reshape(-1, n),
                                  du=du.reshape(-1, x_shape[-1]), dxp=dxp, c=c.reshape(-1))
        return dx.view(x_shape), dfn, dbase, dscale, None, None, None, None


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, x, post, comb):
        n, d = x.shape[-2:]
        f, x = f.contiguous(), x.contiguous()
        post, comb = post.float().contiguous(), comb.float().contiguous()
        r = x.numel() // (n * d) if n * d else 0
        out = new_output(x.shape, x, x.dtype)
        if r and d:
            _mix(_post_fwd, _grid_rows(r, d), f, x, post, comb, out, n, d)
        ctx.save_for_backward(f, x, post, comb)
        return out

    @staticmethod
    def backward(ctx, do):
        f, x, post, comb = ctx.saved_tensors
        n, d = x.shape[-2:]
        r = x.numel() // (n * d) if n * d else 0
        df, dx = new_output(f.shape, f, f.dtype), new_output(x.shape, x, x.dtype)
        dp, dc = new_output(post.shape, x, torch.float32), new_output(comb.shape, x, torch.float32)
        if r and d:
            _mix(_post_bwd, (r,), f, x, post, comb, do.contiguous(), df, dx, dp, dc, n, d)
        else:
            for t in (df, dx, dp, dc):
                t.zero_()
        return df, dx, dp, dc


def pre_streams(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.hc_pre` on the kernels: streams x [..., n, d], fn [m, n d], base [m], scale [3]
    (m = n (n + 2)) -> u [..., d] in x.dtype, post [..., n], comb [..., n, n] fp32, and x again
    as this node's output (hc_post given it has its x gradient added in this node's backward);
    m = n is hc_head's collapse (u only; post and comb come back empty)."""
    if x.dim() < 2:
        raise ValueError(f"pre_streams: streams must be [..., n, d], got {list(x.shape)}")
    n, d = x.shape[-2:]
    if fn.dim() != 2 or fn.shape[1] != n * d or fn.shape[0] not in (n, n * (n + 2)):
        raise ValueError(f"pre_streams: fn {list(fn.shape)} does not fit streams {list(x.shape)} "
                         f"(expected [n or n(n + 2), n d])")
    if base.numel() != fn.shape[0] or scale.numel() != (3 if fn.shape[0] != n else 1) or iters < 1:
        raise ValueError(f"pre_streams: base {list(base.shape)}, scale {list(scale.shape)}, iters {iters} do not "
                         f"fit fn {list(fn.shape)}")
    return _PreStreams.apply(x, fn, base, scale, n, iters, hc_eps, norm_eps)


def weighted_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """u [..., d] = sum_i w[..., i] * x[..., i, :] in fp32, stored in x.dtype (w fp32 [..., n])."""
    return _WeightedSum.apply(w, x)


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as `ops.hc_post`: X'_j = post_j * f + sum_i comb[i, j] * X_i, x.dtype."""
    return _Post.apply(f, x, post, comb)
