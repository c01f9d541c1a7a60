"""Triton sparse attention core of DeepSeek-V4: MQA with shared K = V and an attention sink,
over per-query index sets into a key pool.

Shapes: q [T, H, D] (T query tokens, H heads, D head dim, a power of two), kv [N, D] key
pool, idx [T, K] int32 (-1 = empty slot), sink [H] fp32 in scaled-logit space.

Forward: one program per (token, block of heads); all heads of a token share the gathered
kv rows, so heads are the M dimension of the matmuls. On an H100 (bf16) the Gluon kernel in
`sparse_attention_sm90` runs instead: it splits D between two warpgroups, where this one
has each warpgroup recompute all of Q.K^T. Online softmax in fp32; the sink joins
the denominator at the end; a row with no key gives o = 0 and lse = sink.

Backward (FlashAttention-style recomputation from lse, delta = rowsum(dO * O)), over chunks
of tokens so the scratch stays bounded (`SCRATCH_BYTES`):
  * `_bwd_dq`: per (token, head block): delta, dq, the per-(token, head) sink-gradient terms,
    and P and dS*scale of every (slot, head) into scratch [Tc, K, H] (q.dtype, the precision
    the kv matmuls take them in anyway).
  * `_bwd_dkv`, key-major: per (D tile, tile of key rows, split of the chunk's tokens) the
    tile's gradient dkv = sum over tokens of P^T dO + dS^T Q ([BN, H] x [H, BD] per token,
    P and dS rows gathered through a slot map [Tc, N]) stays in registers; only the tokens
    between the first and last that pick a key of the tile are visited. The query-major
    version it replaced scattered one fp32 atomic per (token, slot, d): 2.7e9 of them at
    S = 8192, bound by L2. Fast mode adds each finished tile with atomics (order-dependent
    rounding); deterministic mode stores it per token split and sums the splits in order
    (no atomics: bit-identical across runs).
Optionally (`AttentionOptions.overlap_chunks`, off by default) two scratch sets let chunk i's
kv gradient run on a side stream beside chunk i + 1's dq pass (events order the reuse of a set).
A token's index set names each key at most once (window positions and a top-k are distinct):
the slot map keeps one slot per (token, key).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import INTERPRET as _INTERPRET
from . import new_output as _new
from . import sparse_attention_sm90 as _sm90
from . import within_head_dim


@dataclass(frozen=True)
class AttentionOptions:
    """Kernel choices of one call (a model config's sm90_kernels, sm90_kv_gradient and
    overlap_chunks; tests and benchmarks pass their own for A/B runs)."""

    # bf16 forward and dq pass on an H100 through the Gluon kernels (`sparse_attention_sm90`);
    # off: the portable Triton kernels
    sm90: bool = True
    # with them, the fast (atomic) backward's kv gradient on the H100 Gluon kernel too
    # (`sparse_attention_sm90._bwd_dkv`): as fast on CSA, faster on HCA (whole backward,
    # `benchmarks/attention_gpu.py`); the deterministic backward keeps the portable kernel,
    # which beats the Gluon one there (`benchmarks/kv_gradient_gpu.py`; NOTES has both)
    sm90_kv_gradient: bool = True
    # CUDA: two scratch sets of SCRATCH_BYTES, chunk i's kv gradient on a side stream beside
    # chunk i + 1's dq pass. Off by default since the dq pass got faster: at the same 256 MiB of
    # scratch one set of 2^28 (fewer, larger chunks) is as fast or faster (kernels/NOTES.md)
    overlap_chunks: bool = False


DEFAULT_OPTIONS = AttentionOptions()


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_H, BLOCK_K, num_warps, num_stages) candidates; one under the CPU interpreter."""
    if _INTERPRET:
        shapes = shapes[:1]
    return [triton.Config({"BLOCK_H": h, "BLOCK_K": k}, num_warps=w, num_stages=st) for h, k, w, st in shapes]


# Heads are the matmul M dim (>= 16 for tl.dot); a [BLOCK_H, D] fp32 accumulator bounds BLOCK_H * D.
# At D = 512 BH64/BK64/w8/s2 fits without spills; 16 warps, Triton's warp specialisation and
# keys as the M dim (cross-warpgroup max/sum every block) were all slower (kernels/NOTES.md).
_Q_CONFIGS = _configs([(16, 16, 4, 1), (16, 64, 8, 2), (32, 64, 8, 3), (64, 32, 8, 2), (64, 64, 8, 2),
                       (64, 64, 8, 1), (64, 128, 8, 1)])
# dq kernel (transposed tiles): H100, BH64/BK32/w8/s2, no spills; the whole backward 1-4% faster
# than with the untransposed kernel (whose BH64 tiles spilled 70 registers)
_DQ_CONFIGS = _configs([(64, 32, 8, 2), (64, 64, 8, 1), (64, 16, 8, 3), (32, 32, 8, 2), (16, 32, 4, 2)])
# (BLOCK_N, BLOCK_D, num_warps, num_stages) of the key-major kv-gradient kernel. At D = 512 CSA
# layers tune to BN128/BD128/w8/s3, HCA layers to BN64/BD128/w4/s2; BD 256 spills (pointer
# tensors of the gathers).
# The narrow tiles keep a config for every head dim down to 16 (the tiny test model's is 32).
_KV_CONFIGS = ([triton.Config({"BLOCK_N": 16, "BLOCK_D": 16}, num_warps=4, num_stages=1)] if _INTERPRET else
               [triton.Config({"BLOCK_N": bn, "BLOCK_D": bd}, num_warps=w, num_stages=st)
                for bn, bd, w, st in [(128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (64, 128, 4, 3),
                                      (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (32, 16, 4, 2)]])
GROUP = 16  # keys per entry of the per-chunk token ranges (the smallest BLOCK_N)
# tokens per kv-gradient program: its tile goes out by fp32 atomics (fast) or into a slot of
# the per-split buffer (deterministic, summed in split order afterwards)
TOKENS_PER_PROGRAM = 64
DETERMINISTIC_TOKENS_PER_PROGRAM = 256
# Bounds on the backward's per-chunk scratch: P and dS [Tc, K, H] with the slot map [Tc, N],
# and the deterministic mode's per-split kv-gradient tiles [splits, N, D] fp32 (above it, the
# splits grow longer: fewer programs).
SCRATCH_BYTES = 2 ** 28
DETERMINISTIC_SCRATCH_BYTES = 2 ** 30


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; exact fp32 products when the inputs are fp32 (tests)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gather_kv(KV, IDX, t, si_t, skv, k0, K, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """Key slots k0..k0+BLOCK_K of token t: (slot offsets, key ids, valid mask, kv rows [BK, D];
    empty or out-of-range slots read as zero rows)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ids = tl.load(IDX + t * si_t + offs_k, mask=offs_k < K, other=-1)
    valid = ids >= 0
    kv = tl.load(KV + ids.to(tl.int64)[:, None] * skv + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    return offs_k, ids, valid, kv


@triton.jit
def _online_softmax(m, l, s):
    """One block of scaled logits s [BH, BK] into the running max m and sum l [BH]: (new m,
    new l, alpha [BH] to rescale the accumulator by, p [BH, BK]). Callers pass s as fp32: under
    torch.compile a Python-float `scale` arrives as fp64, and a loop-carried m may not change type."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-empty so far: no NaN
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, l * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _with_sink(m, l, SINK, offs_h, hmask):
    """The sink joins the denominator: (the factor [BH] that turns the accumulator into o, lse [BH])."""
    sink = tl.load(SINK + offs_h, mask=hmask, other=0.0)
    m_fin = tl.maximum(m, sink)
    alpha = tl.exp(m - m_fin)
    l = l * alpha + tl.exp(sink - m_fin)
    return alpha / l, m_fin + tl.log(l)


@triton.autotune(_Q_CONFIGS, key=["H", "D"])
@triton.jit
def _fwd(Q, KV, IDX, CNT, SINK, O, LSE, scale, H, K, sq_t, sq_h, skv, si_t, so_t, so_h,
         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for k0 in range(0, tl.load(CNT + t), BLOCK_K):  # slots past the count are empty
        _, _, valid, kv = _gather_kv(KV, IDX, t, si_t, skv, k0, K, BLOCK_K, D)
        s = tl.where(valid[None, :], (_mm(q, tl.trans(kv), IEEE) * scale).to(tl.float32), float("-inf"))  # [BH, BK]
        m, l, alpha, p = _online_softmax(m, l, s)
        acc = acc * alpha[:, None] + _mm(p.to(kv.dtype), kv, IEEE)
    f, lse = _with_sink(m, l, SINK, offs_h, hmask)
    o = acc * f[:, None]
    tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE + t * H + offs_h, lse, mask=hmask)


@triton.jit
def _e4m3_value(codes):
    """FP8 e4m3fn codes (uint8) -> their values in fp32, exactly, by bit arithmetic (the
    interpreter has no fp8 type). Codes 0x7F / 0xFF (NaN) never occur: quantizing clamps to 448."""
    b = codes.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)  # subnormal m x 2^-9; else (8 + m) x 2^(e - 10)
    return tl.where(b >= 128, -mag, mag)


@triton.autotune(_Q_CONFIGS, key=["H", "DN"])
@triton.jit
def _fwd_fp8(Q, CODES, SCALES, ROPE, IDX, CNT, SINK, O, LSE, scale, H, K, DN, sq_t, sq_h, sc, ss, sr, si_t, so_t,
             so_h, DNB: tl.constexpr, R: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """_fwd over an FP8 key pool (kv_pool.Fp8KeyPool): each chosen row's first DN channels
    from its codes and per-QBLOCK scales, dequantized in registers as fp8_kv_dequant does (the
    fp32 product rounded to the RoPE channels' dtype), its last R channels as stored. Q.K^T and
    P.V run as two products, the FP8 part (DNB = DN rounded up to a power of two, masked) and
    the RoPE part."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_n = tl.arange(0, DNB)
    nmask = offs_n < DN
    offs_r = tl.arange(0, R)
    q_at = Q + t * sq_t + offs_h[:, None] * sq_h
    q_n = tl.load(q_at + offs_n[None, :], mask=hmask[:, None] & nmask[None, :], other=0.0)
    q_r = tl.load(q_at + DN + offs_r[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc_n = tl.zeros([BLOCK_H, DNB], tl.float32)
    acc_r = tl.zeros([BLOCK_H, R], tl.float32)
    for k0 in range(0, tl.load(CNT + t), BLOCK_K):  # slots past the count are empty
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(IDX + t * si_t + offs_k, mask=offs_k < K, other=-1)
        valid = ids >= 0
        rows = ids.to(tl.int64)[:, None]
        kmask = valid[:, None] & nmask[None, :]
        codes = tl.load(CODES + rows * sc + offs_n[None, :], mask=kmask, other=0)
        scales = tl.load(SCALES + rows * ss + (offs_n // QBLOCK)[None, :], mask=kmask, other=0.0)
        kn = (_e4m3_value(codes) * scales).to(ROPE.dtype.element_ty)  # [BK, DNB]
        kr = tl.load(ROPE + rows * sr + offs_r[None, :], mask=valid[:, None], other=0.0)  # [BK, R]
        s = _mm(q_n, tl.trans(kn), IEEE) + _mm(q_r, tl.trans(kr), IEEE)
        s = tl.where(valid[None, :], (s * scale).to(tl.float32), float("-inf"))  # [BH, BK]
        m, l, alpha, p = _online_softmax(m, l, s)
        acc_n = acc_n * alpha[:, None] + _mm(p.to(kn.dtype), kn, IEEE)
        acc_r = acc_r * alpha[:, None] + _mm(p.to(kr.dtype), kr, IEEE)
    f, lse = _with_sink(m, l, SINK, offs_h, hmask)
    o_at = O + t * so_t + offs_h[:, None] * so_h
    tl.store(o_at + offs_n[None, :], (acc_n * f[:, None]).to(O.dtype.element_ty),
             mask=hmask[:, None] & nmask[None, :])
    tl.store(o_at + DN + offs_r[None, :], (acc_r * f[:, None]).to(O.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE + t * H + offs_h, lse, mask=hmask)


@triton.autotune(_DQ_CONFIGS, key=["H", "D"])
@triton.jit
def _bwd_dq(Q, KV, IDX, CNT, SINK, O, DO, LSE, DQ, DSINK, PT, DST, T0, scale, H, K, sq_t, sq_h, skv, si_t,
            D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    tc = tl.program_id(0).to(tl.int64)  # token within the chunk
    t = T0 + tc
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    qo = t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :]
    q = tl.load(Q + qo, mask=hmask[:, None], other=0.0)
    do = tl.load(DO + qo, mask=hmask[:, None], other=0.0)
    lse = tl.load(LSE + t * H + offs_h, mask=hmask, other=0.0)
    o = tl.load(O + qo, mask=hmask[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO * O)
    dq = tl.zeros([BLOCK_H, D], tl.float32)
    for k0 in range(0, tl.load(CNT + t), BLOCK_K):
        offs_k, _, valid, kv = _gather_kv(KV, IDX, t, si_t, skv, k0, K, BLOCK_K, D)
        # transposed, keys as the M dim: [BK, BH] tiles need no reduction over keys (lse is
        # known), so the warps split the keys instead of each recomputing all of Q.K^T
        pt = tl.where(valid[:, None], tl.exp(_mm(kv, tl.trans(q), IEEE) * scale - lse[None, :]), 0.0)
        dst = pt * (_mm(kv, tl.trans(do), IEEE) - delta[None, :])
        dq += _mm(tl.trans(dst.to(kv.dtype)), kv, IEEE)
        so = (tc * K + offs_k[:, None]) * H + offs_h[None, :]  # [BK, BH] into scratch [Tc, K, H]
        smask = (offs_k < K)[:, None] & hmask[None, :]
        tl.store(PT + so, pt.to(PT.dtype.element_ty), mask=smask)
        tl.store(DST + so, (dst * scale).to(DST.dtype.element_ty), mask=smask)
    tl.store(DQ + qo, (dq * scale).to(DQ.dtype.element_ty), mask=hmask[:, None])
    # d lse / d sink = p_sink; the sink's logit gradient is p_sink * (0 - delta).
    sink = tl.load(SINK + offs_h, mask=hmask, other=0.0)
    tl.store(DSINK + t * H + offs_h, -tl.exp(sink - lse) * delta, mask=hmask)


# Tuned per slot-count class too (`SLOTS`: the index-set width rounded up to a power of two):
# the best tile differs between CSA and HCA layers (HCA ran ~5% slower in CSA's), and keying on
# the exact width would retune whenever a sequence length changes it.
@triton.autotune(_KV_CONFIGS, key=["H", "D", "SLOTS", "DETERMINISTIC"], reset_to_zero=["DKV"],
                 prune_configs_by={"early_config_prune": within_head_dim("BLOCK_D")})
@triton.jit
def _bwd_dkv(Q, DO, PT, DST, SMAP, FIRST, LAST, DKV, BUF, T0, H, K, N, TSPLIT, sq_t, sq_h, ss_t, SLOTS,
             D: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             GROUP: tl.constexpr, IEEE: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """Key-major: program (D tile, key tile, token split) sums the [BN, BD] gradient of its keys
    over the split's tokens in registers; per token, P^T and dS^T rows are gathered from the
    scratch by the slot map (zero where the token did not pick the key) and the contraction is
    over the token's heads: [BN, BH] x [BH, BD]."""
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    # tokens of this chunk that pick any key of the tile: the union of its key groups' ranges
    groups = n0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
    gmask = groups < tl.cdiv(N, GROUP)
    lo = tl.maximum(tl.min(tl.load(FIRST + groups, mask=gmask, other=2 ** 30), 0), split * TSPLIT)
    hi = tl.minimum(tl.max(tl.load(LAST + groups, mask=gmask, other=-1), 0) + 1, split * TSPLIT + TSPLIT)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_h = tl.arange(0, BH)  # all heads (padded to >= 16 with zero rows): the contraction dim
    hmask = offs_h < H
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for tc in range(lo.to(tl.int64), hi):  # int64 offsets from the token index
        slots = tl.load(SMAP + tc * ss_t + offs_n, mask=nmask, other=-1)  # [BN]; -1: not picked
        so = (tc * K + slots)[:, None] * H + offs_h[None, :]  # [BN, BH] rows of scratch [Tc, K, H]
        smask = (slots >= 0)[:, None] & hmask[None, :]
        pt = tl.load(PT + so, mask=smask, other=0.0)
        dst = tl.load(DST + so, mask=smask, other=0.0)
        qo = (T0 + tc) * sq_t + offs_h[:, None] * sq_h + offs_d[None, :]  # [BH, BD]
        q = tl.load(Q + qo, mask=hmask[:, None], other=0.0)
        do = tl.load(DO + qo, mask=hmask[:, None], other=0.0)
        acc += _mm(pt, do, IEEE) + _mm(dst, q, IEEE)
    out = offs_n.to(tl.int64)[:, None] * D + offs_d[None, :]
    if DETERMINISTIC:  # every program writes its slot (zeros if it had no token)
        tl.store(BUF + split.to(tl.int64) * N * D + out, acc, mask=nmask[:, None])
    elif hi > lo:
        tl.atomic_add(DKV + out, acc, mask=nmask[:, None])


def _check(q, kv, idx, sink):
    t, h, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"sparse attention kernel: head dim {d} must be a power of two >= 16")
    if kv.shape[-1] != d or idx.shape[0] != t or sink.shape != (h,):
        raise ValueError(f"sparse attention kernel: shapes q {list(q.shape)}, kv {list(kv.shape)}, "
                         f"idx {list(idx.shape)}, sink {list(sink.shape)} do not fit")


@triton.jit
def _compact(IDX, OUT, CNT, K, BLOCK: tl.constexpr):
    """One token's valid slots moved first, in their order; -1 after them; their count."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ids = tl.load(IDX + t * K + offs, mask=offs < K, other=-1)
    valid = ids >= 0
    n = tl.sum(valid.to(tl.int32), 0)
    tl.store(OUT + t * K + tl.cumsum(valid.to(tl.int32), 0) - 1, ids, mask=valid)
    tl.store(OUT + t * K + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= n) & (offs < K))
    tl.store(CNT + t, n)


def compact(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [T, K] with each token's valid slots moved first (in their order), and their count
    [T] int32: the kernels' loops stop at the count, so empty slots (early tokens see few
    compressed entries: 20% of a CSA layer's slots at S = 4096) cost nothing."""
    idx = idx.to(torch.int32).contiguous()  # the kernel reads and writes rows of K adjacent slots
    t, k = idx.shape
    out = torch.empty_like(idx)
    cnt = torch.zeros(t, device=idx.device, dtype=torch.int32)
    if t and k:
        _compact[(t,)](idx, out, cnt, k, BLOCK=triton.next_power_of_2(k))
    return out, cnt


def sparse_attn_fwd(q, kv, idx, cnt, sink, scale, options: AttentionOptions = DEFAULT_OPTIONS):
    """idx, cnt: as `compact` returns them."""
    _check(q, kv, idx, sink)
    q, kv = q.contiguous(), kv.contiguous()
    t, h, d = q.shape
    k = idx.shape[1]
    o = _new(q.shape, q, q.dtype)
    lse = _new((t, h), q, torch.float32)
    if t and options.sm90 and _sm90.supported(q, kv):
        _sm90.forward_into(q, kv, idx, cnt, sink.float().contiguous(), scale, o, lse)
    elif t:
        _fwd[lambda m: (t, triton.cdiv(h, m["BLOCK_H"]))](
            q, kv, idx, cnt, sink.float().contiguous(), o, lse, scale, h, k, q.stride(0), q.stride(1), kv.stride(0),
            idx.stride(0), o.stride(0), o.stride(1), D=d, IEEE=q.dtype == torch.float32)
    return o, lse


def sparse_attention_fp8(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor,
                         idx: torch.Tensor, sink: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward (decoding: no gradient) over an FP8 key pool read in place: codes [N, dn]
    uint8, scales [N, dn / block] fp32, rope [N, r] (kv_pool.Fp8KeyPool's tensors, flattened to
    rows), idx [T, K] into the rows. Equal to sparse_attention over the rows fp8_kv_dequant
    gives, up to the order of fp32 sums. o [T, H, dn + r] (q.dtype), lse [T, H] fp32."""
    t, h, d = q.shape
    dn, r = codes.shape[-1], rope.shape[-1]
    if dn + r != d or r & (r - 1) or r < 16 or dn < 16 or dn % scales.shape[-1]:
        raise ValueError(f"FP8 sparse attention kernel: q {list(q.shape)}, codes {list(codes.shape)}, scales "
                         f"{list(scales.shape)}, rope {list(rope.shape)} do not fit (RoPE width a power of two >= 16)")
    if idx.shape[0] != t or sink.shape != (h,):
        raise ValueError(f"FP8 sparse attention kernel: idx {list(idx.shape)}, sink {list(sink.shape)} for q "
                         f"{list(q.shape)}")
    idx, cnt = compact(idx)
    q, codes, scales, rope = q.contiguous(), codes.contiguous(), scales.contiguous(), rope.contiguous()
    o = _new(q.shape, q, q.dtype)
    lse = _new((t, h), q, torch.float32)
    if t:
        _fwd_fp8[lambda m: (t, triton.cdiv(h, m["BLOCK_H"]))](
            q, codes, scales, rope, idx, cnt, sink.float().contiguous(), o, lse, scale, h, idx.shape[1], dn,
            q.stride(0), q.stride(1), codes.stride(0), scales.stride(0), rope.stride(0), idx.stride(0), o.stride(0),
            o.stride(1), DNB=triton.next_power_of_2(dn), R=r, QBLOCK=dn // scales.shape[-1],
            IEEE=q.dtype == torch.float32)
    return o, lse


@triton.jit
def _key_map_fill(IDX, SMAP, TOUCH, T0, K, si_t, ss_t, st_g, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Token tc of the chunk: SMAP[tc, key] = its slot, TOUCH[key // GROUP, tc] = 1."""
    tc = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ids = tl.load(IDX + (T0 + tc) * si_t + offs, mask=offs < K, other=-1)
    valid = ids >= 0
    tl.store(SMAP + tc * ss_t + ids, offs, mask=valid)
    tl.store(TOUCH + (ids // GROUP).to(tl.int64) * st_g + tc, tl.full([BLOCK], 1, tl.int8), mask=valid)


@triton.jit
def _token_range(TOUCH, FIRST, LAST, TC, st_g, BLOCK_T: tl.constexpr):
    """Group g of keys: the first and last token of the chunk that picks one of them
    (first > last when none does)."""
    g = tl.program_id(0).to(tl.int64)
    lo = TC
    hi = -1
    for t0 in range(0, TC, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        hit = tl.load(TOUCH + g * st_g + offs, mask=offs < TC, other=0) != 0
        lo = tl.minimum(lo, tl.min(tl.where(hit, offs, TC), 0))
        hi = tl.maximum(hi, tl.max(tl.where(hit, offs, -1), 0))
    tl.store(FIRST + g, lo)
    tl.store(LAST + g, hi)


def _slot_type(k: int) -> torch.dtype:
    return torch.int16 if k <= 2 ** 15 else torch.int32  # int16: half the bytes to fill and read


def _key_map(idx: torch.Tensor, t0: int, tc: int, n: int):
    """The key-major view of the index sets of tokens t0 .. t0 + tc: slot map [tc, N] (the
    slot where token tc picked key j, or -1) and, per group of GROUP keys, the first and
    last token of the chunk that picks one of them."""
    k = idx.shape[1]
    n_groups = triton.cdiv(n, GROUP)
    smap = torch.full((tc, n), -1, device=idx.device, dtype=_slot_type(k))
    touch = torch.zeros(n_groups, tc, device=idx.device, dtype=torch.int8)
    first = torch.empty(n_groups, device=idx.device, dtype=torch.int32)
    last = torch.empty_like(first)
    _key_map_fill[(tc,)](idx, smap, touch, t0, k, idx.stride(0), smap.stride(0), touch.stride(0), GROUP=GROUP,
                         BLOCK=triton.next_power_of_2(k))
    _token_range[(n_groups,)](touch, first, last, tc, touch.stride(0), BLOCK_T=256 if tc > 64 else 16)
    return smap, first, last


def chunking(q: torch.Tensor, n: int, k: int, deterministic: bool) -> tuple[int, int]:
    """Tokens per backward chunk (its scratch, P and dS [Tc, K, H] and the slot map [Tc, N],
    under SCRATCH_BYTES) and per kv-gradient program (deterministic: the per-split buffer
    [splits, N, D] fp32 under DETERMINISTIC_SCRATCH_BYTES)."""
    t, h, d = q.shape
    chunk = max(1, min(t, SCRATCH_BYTES // (k * 2 * h * q.element_size() + n * _slot_type(k).itemsize)))
    if not deterministic:
        return chunk, TOKENS_PER_PROGRAM
    return chunk, max(DETERMINISTIC_TOKENS_PER_PROGRAM,
                      triton.cdiv(chunk, max(1, DETERMINISTIC_SCRATCH_BYTES // (n * d * 4))))


def kv_gradient_into(q, do, pt, dst, smap, first, last, dkv, buf, t0, tsplit, deterministic, sm90: bool):
    """One chunk's kv gradient from the dq pass's scratch (tokens t0 .. t0 + smap's rows): into
    dkv [N, D] fp32 by atomics, or (deterministic) per split of tsplit tokens into buf; on the
    H100 Gluon kernel (`sm90`) or the portable key-major `_bwd_dkv`."""
    if sm90:
        _sm90.bwd_dkv_into(q, do, pt, dst, smap, first, last, dkv, buf, t0, tsplit, GROUP, deterministic)
        return
    h, d = q.shape[1:]
    tc, n = smap.shape
    k = pt.shape[1]
    _bwd_dkv[lambda m: (triton.cdiv(d, m["BLOCK_D"]), triton.cdiv(n, m["BLOCK_N"]), triton.cdiv(tc, tsplit))](
        q, do, pt, dst, smap, first, last, dkv, buf, t0, h, k, n, tsplit, q.stride(0), q.stride(1), smap.stride(0),
        triton.next_power_of_2(k), D=d, BH=max(16, triton.next_power_of_2(h)), GROUP=GROUP,
        IEEE=q.dtype == torch.float32, DETERMINISTIC=deterministic)


def sparse_attn_bwd(q, kv, idx, cnt, sink, scale, o, lse, do, deterministic: bool,
                    options: AttentionOptions = DEFAULT_OPTIONS):
    """idx, cnt: as `compact` returns them."""
    q, kv, do = q.contiguous(), kv.contiguous(), do.contiguous()
    t, h, d = q.shape
    n, k = kv.shape[0], idx.shape[1]
    o = o.contiguous()
    dq = _new(q.shape, q, q.dtype)
    dsink_terms = _new((t, h), q, torch.float32)
    dkv = torch.zeros(n, d, device=q.device, dtype=torch.float32)
    ieee = q.dtype == torch.float32
    sinkf = sink.float().contiguous()
    if not (t and k and n):  # no keys at all: o = 0, so delta = 0 and every gradient is zero
        dq.zero_()
        dsink_terms.zero_()
        return dq, dkv.to(kv.dtype), dsink_terms.sum(0)
    chunk, tsplit = chunking(q, n, k, deterministic)
    sm90 = options.sm90 and _sm90.supported(q, kv, o, do)
    n_sets = 2 if options.overlap_chunks and q.is_cuda and t > chunk else 1  # 2: overlap (see the options)
    scratch = [(torch.empty(chunk, k, h, device=q.device, dtype=q.dtype),  # P, then dS * scale: [Tc, K, H]
                torch.empty(chunk, k, h, device=q.device, dtype=q.dtype)) for _ in range(n_sets)]
    buf = torch.empty(triton.cdiv(chunk, tsplit) if deterministic else 1, n, d, device=q.device,
                      dtype=torch.float32)
    main = torch.cuda.current_stream(q.device) if n_sets == 2 else None
    side = torch.cuda.Stream(q.device) if n_sets == 2 else None
    freed = [None] * n_sets  # per set: the event after the last kv gradient that read it
    for i, t0 in enumerate(range(0, t, chunk)):
        tc = min(chunk, t - t0)
        pt, dst = scratch[i % n_sets]
        if freed[i % n_sets] is not None:
            main.wait_event(freed[i % n_sets])  # the kv gradient of chunk i - 2 has read this set
        if sm90:
            _sm90.bwd_dq_into(q, kv, idx, cnt, sinkf, scale, o, do, lse, dq, dsink_terms, pt, dst, t0, tc)
        else:
            _bwd_dq[lambda m, tc=tc: (tc, triton.cdiv(h, m["BLOCK_H"]))](
                q, kv, idx, cnt, sinkf, o, do, lse, dq, dsink_terms, pt, dst, t0, scale, h, k, q.stride(0),
                q.stride(1), kv.stride(0), idx.stride(0), D=d, IEEE=ieee)
        smap, first, last = _key_map(idx, t0, tc, n)
        if side is not None:
            side.wait_stream(main)  # this chunk's P, dS and slot map are written
            for x in (smap, first, last):
                x.record_stream(side)  # the allocator reuses their memory only after the side stream's reads
        with torch.cuda.stream(side):  # no-op when side is None
            kv_gradient_into(q, do, pt, dst, smap, first, last, dkv, buf, t0, tsplit, deterministic,
                             sm90 and options.sm90_kv_gradient and not deterministic)
            if deterministic:
                dkv += buf[:triton.cdiv(tc, tsplit)].sum(0)  # in split order: no atomics anywhere
        if side is not None:
            freed[i % n_sets] = side.record_event()
    if side is not None:
        main.wait_stream(side)
    return dq, dkv.to(kv.dtype), dsink_terms.sum(0)


class SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, sink, scale, deterministic, options):
        idx, cnt = compact(idx)
        o, lse = sparse_attn_fwd(q, kv, idx, cnt, sink, scale, options)
        ctx.save_for_backward(q, kv, idx, cnt, sink, o, lse)
        ctx.scale, ctx.deterministic, ctx.options = scale, deterministic, options
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, idx, cnt, sink, o, lse = ctx.saved_tensors
        dq, dkv, dsink = sparse_attn_bwd(q, kv, idx, cnt, sink, ctx.scale, o, lse, do, ctx.deterministic,
                                         ctx.options)
        return dq, dkv, None, dsink.to(sink.dtype), None, None, None


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                     deterministic: bool = False, options: AttentionOptions = DEFAULT_OPTIONS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [T, H, D] (q.dtype), lse [T, H] fp32; differentiable in q, kv and sink."""
    return SparseAttention.apply(q, kv, idx, sink, scale, deterministic, options)
