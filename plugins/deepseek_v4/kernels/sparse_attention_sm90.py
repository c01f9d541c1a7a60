"""Hopper (sm_90) forward of the sparse attention core, in Gluon: the same contract as
`sparse_attention._fwd` (bf16 q [T, H, D], kv pool [N, D], compacted idx [T, K] with counts,
sink [H]; o [T, H, D], lse [T, H]), with the head dim split between two 4-warp partitions.

Why: with 64 heads as the single wgmma row block, Triton gives each warpgroup half of the
output columns, so each needs all of P and recomputes all of Q.K^T (3 units of tensor work
for 2 useful). Here partition p owns the D half p: it gathers kv[:, half] into its own
shared-memory stages (cp.async), computes the partial Q.K^T over its half, and the two halves
are summed through shared memory; both then run the same online softmax (a + b == b + a, so
they agree bitwise) and P.V for their own output half. Block i's Q.K^T is issued with
block i - 1's P.V, so the exchange runs while the tensor cores do that P.V (ptxas waits for
it before the softmax: the new P goes into the registers it reads).

Persistent: one program per SM walks items (token, block of 64 heads) pid, pid + #SMs, ...;
the next item's q comes by TMA into a second buffer while this one runs, and o leaves by a
TMA store through the buffer of its own q. BK = 32 keys a block, 2 stages of gathered rows.
Why these choices (same-process A/Bs on an H100, in NOTES.md): 2 stages beat 3 on all three
benchmark shapes; the persistent grid gains most on HCA (5 key blocks per token).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BH, BK, STAGES = 64, 32, 2
WORKER_REGS = 240
LOG2E = 1.4426950408889634


def supported(q: torch.Tensor, kv: torch.Tensor, *more: torch.Tensor) -> bool:
    """Contiguous bf16 q and kv (and o, dO for the backward: `more`), 16-byte aligned, on an
    sm_90 GPU; heads a multiple of 64 (the wgmma row block: fewer heads would leave rows idle,
    and the portable kernel tiles them finer); head dim a power of two in [64, 512] (each half
    a wgmma N <= 256)."""
    _, h, d = q.shape
    aligned = all(x.data_ptr() % 16 == 0 for x in (q, kv, *more))  # cp.async moves 16-byte pieces
    return (q.is_cuda and all(x.dtype == torch.bfloat16 for x in (q, kv, *more))
            and torch.cuda.get_device_capability(q.device) == (9, 0) and h % BH == 0 and 64 <= d <= 512
            and d & (d - 1) == 0 and aligned)


@triton.constexpr_function
def _rows_layout(cols):
    """[rows, cols] bf16 tiles moved as 16-byte pieces, a warp covering whole rows."""
    per_row = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [4, 1], [1, 0])


@triton.constexpr_function
def _acc_layout(cols):
    """One warpgroup's wgmma accumulator for [64 rows, cols]."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@triton.constexpr_function
def _gather_layout():
    """[rows, cols] of gathered kv rows: four lanes a row, each moving 16-byte pieces 64 bytes
    apart, so a thread needs one row's id (a warp a row took 8 ids a thread; the registers
    that frees made the forward and the dq pass faster on an H100: NOTES.md)."""
    return gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])


@gluon.jit
def _ids(IDX, t, si_t, k0, bound, BLOCK_K: gl.constexpr, DH: gl.constexpr):
    """Slots k0 .. k0 + BK of token t's compacted ids, -1 from `bound` on (the count, or the row
    length K: compact's rows hold -1 past the count, so K serves before the count is loaded)."""
    offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, _gather_layout()))
    return gl.load(IDX + t * si_t + offs_k, mask=offs_k < bound, other=-1)


@gluon.jit
def _item_head(IDX, CNT, t, K, si_t, BLOCK_K: gl.constexpr, DH: gl.constexpr):
    """Token t's key count and its first two blocks of compacted ids (-1 past the count)."""
    t = t.to(gl.int64)
    return gl.load(CNT + t), _ids(IDX, t, si_t, 0, K, BLOCK_K, DH), _ids(IDX, t, si_t, BLOCK_K, K, BLOCK_K, DH)


@gluon.jit
def _gather(KV, ids, buf, skv, P: gl.constexpr, DH: gl.constexpr):
    """Half P of the kv rows `ids` into `buf` [BK, DH] as one copy group; empty slots read as zeros."""
    offs_d = P * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, _gather_layout()))
    async_copy.async_copy_global_to_shared(buf, KV + ids.to(gl.int64)[:, None] * skv + offs_d[None, :],
                                           mask=(ids >= 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def _exchange(s_mine, x_smem, bars, j, P: gl.constexpr):
    """Q.K^T of block j: this half's partial sum plus the other half's, through shared memory
    (two slots per half, so a half can run one block ahead)."""
    slot = j % 2
    x_smem.index(P * 2 + slot).store(s_mine)
    gl.thread_barrier()  # all of this partition's rows are stored before the other half is told
    mbarrier.arrive(bars.index(P * 2 + slot), count=1)
    mbarrier.wait(bars.index((1 - P) * 2 + slot), phase=(j // 2) & 1)
    return s_mine + x_smem.index((1 - P) * 2 + slot).load(s_mine.type.layout)


@gluon.jit
def _softmax(s, i, kn, m, l, scale, BLOCK_K: gl.constexpr):
    """Online softmax of block i in base 2 (scale includes log2 e): p [BH, BK], the rescale of
    the earlier blocks, the new max and the new sum."""
    offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where((offs_k < kn)[None, :], s * scale, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # all-empty so far: no NaN
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l * alpha + gl.sum(p, 1)


@gluon.jit
def _half(P: gl.constexpr, QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K,
          skv, si_t):
    # sizes from the buffers: warp_specialize hands partitions plain values, not constexprs
    NS: gl.constexpr = kv_smem.type.shape[0] // 2
    BLOCK_K: gl.constexpr = kv_smem.type.shape[1]
    DH: gl.constexpr = kv_smem.type.shape[2]
    BLOCK_H: gl.constexpr = x_smem.type.shape[1]
    s_l: gl.constexpr = _acc_layout(BLOCK_K)
    o_l: gl.constexpr = _acc_layout(DH)
    pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    q_bytes: gl.constexpr = BLOCK_H * DH * 2
    n_hb = H // BLOCK_H
    n_items = T * n_hb  # (token, head block) pairs, item w -> token w // n_hb
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    # persistent: this program takes items pid, pid + nprog, ...; q of the next item comes by
    # TMA into the other of two buffers while this one runs, and o leaves through the buffer
    # of its own q by a TMA store that the next item does not wait for
    mbarrier.expect(qbars.index(P * 2), q_bytes)
    tma.async_copy_global_to_shared(QD, [pid * BLOCK_H, P * DH], qbars.index(P * 2), q_smem.index(P * 2))
    j = 0  # key blocks done by this program: the exchange slots' phase runs on across items
    n = 0  # items done by this program
    # an item's count and first two blocks of ids are loaded during the item before (compact's
    # rows hold -1 past the count, so they need no mask by it)
    gl.static_assert(NS == 2, "an item's first two blocks of ids come from the item before")
    kn_next, ids0_next, ids1_next = _item_head(IDX, CNT, pid // n_hb, K, si_t, BLOCK_K, DH)
    for w in range(pid, n_items, nprog):
        t = (w // n_hb).to(gl.int64)
        h0 = (w % n_hb) * BLOCK_H
        b = n % 2
        q = q_smem.index(P * 2 + b)  # [BH, DH]
        kn = kn_next
        nblk = gl.cdiv(kn, BLOCK_K)
        _gather(KV, ids0_next, kv_smem.index(P * NS), skv, P, DH)
        ids_next = ids1_next
        kn_next, ids0_next, ids1_next = _item_head(IDX, CNT, gl.minimum(w + nprog, n_items - 1) // n_hb, K, si_t,
                                                   BLOCK_K, DH)
        m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BLOCK_H, DH], gl.float32, o_l)
        zero_s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_l)
        mbarrier.wait(qbars.index(P * 2 + b), phase=(n // 2) & 1)
        # the next item's q, into the other buffer once the item before's o has left it: after
        # block 0's gather and the id loads are out, which gives that store the longest time
        if w + nprog < n_items:
            tma.store_wait(0)
            gl.thread_barrier()
            mbarrier.expect(qbars.index(P * 2 + 1 - b), q_bytes)
            tma.async_copy_global_to_shared(QD, [(w + nprog) * BLOCK_H, P * DH], qbars.index(P * 2 + 1 - b),
                                            q_smem.index(P * 2 + 1 - b))
        if nblk > 0:
            # block 0: Q.K^T and P; its P.V is issued together with block 1's Q.K^T
            async_copy.wait_group(NS - 2)
            gl.thread_barrier()
            fence_async_shared()
            s = _exchange(warpgroup_mma(q, kv_smem.index(P * NS).permute((1, 0)), zero_s, use_acc=False),
                          x_smem, bars, j, P)
            _gather(KV, ids_next, kv_smem.index(P * NS + NS - 1), skv, P, DH)
            ids_next = _ids(IDX, t, si_t, NS * BLOCK_K, kn, BLOCK_K, DH)
            p, alpha, m, l = _softmax(s, 0, kn, m, l, scale, BLOCK_K)
            p = gl.convert_layout(p.to(gl.bfloat16), pa_l)
            for i in range(1, nblk):
                async_copy.wait_group(NS - 2)  # block i's rows (this thread's copies) are in
                gl.thread_barrier()
                fence_async_shared()
                z = _opaque_zero(i)  # q's descriptors made here, not held in registers through the loop
                kv_t = kv_smem.index(P * NS + i % NS).permute((1, 0))
                s_tok = warpgroup_mma(q_smem.index(P * 2 + b + z), kv_t, zero_s, use_acc=False, is_async=True)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
                acc_tok = warpgroup_mma(p, kv_smem.index(P * NS + (i - 1) % NS), acc, is_async=True)
                # block i's exchange and softmax run while the tensor cores do block i - 1's P.V
                s = _exchange(warpgroup_mma_wait(1, deps=[s_tok]), x_smem, bars, j + i, P)
                p, alpha, m, l = _softmax(s, i, kn, m, l, scale, BLOCK_K)
                p = gl.convert_layout(p.to(gl.bfloat16), pa_l)
                acc = warpgroup_mma_wait(0, deps=[acc_tok])
                # block i + NS - 1 into the stage of block i - 1, whose P.V is done
                _gather(KV, ids_next, kv_smem.index(P * NS + (i + NS - 1) % NS), skv, P, DH)
                ids_next = _ids(IDX, t, si_t, (i + NS) * BLOCK_K, kn, BLOCK_K, DH)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(p, kv_smem.index(P * NS + (nblk - 1) % NS), acc)
        async_copy.wait_group(0)  # the (empty) copies past the last block land before the next item's
        gl.thread_barrier()  # and every warp's last Q.K^T has read q before o overwrites it
        offs_hs = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
        sink = gl.load(SINK + offs_hs) * 1.4426950408889634  # base 2, as m
        m_fin = gl.maximum(m, sink)  # the sink joins the denominator only
        alpha = gl.exp2(m - m_fin)
        l = l * alpha + gl.exp2(sink - m_fin)
        o = acc * gl.convert_layout(alpha / l, gl.SliceLayout(1, o_l))[:, None]
        q.store(o.to(gl.bfloat16))  # the last Q.K^T has read q: its buffer carries o out
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(OD, [w * BLOCK_H, P * DH], q)  # row w * BH = t * H + h0
        if P == 0:
            gl.store(LSE + t * H + offs_hs, (m_fin + gl.log2(l)) * 0.6931471805599453)
        j += nblk
        n += 1
    tma.store_wait(0)


@gluon.jit
def _half0(QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K, skv, si_t):
    _half(0, QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K, skv, si_t)


@gluon.jit
def _half1(QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K, skv, si_t):
    _half(1, QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K, skv, si_t)


@gluon.jit
def _fwd(QD, OD, KV, IDX, CNT, SINK, LSE, scale, T, H, K, skv, si_t, BLOCK_K: gl.constexpr, NS: gl.constexpr,
         REGS: gl.constexpr):
    BLOCK_H: gl.constexpr = QD.block_type.shape[0]
    DH: gl.constexpr = QD.block_type.shape[1]
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, BLOCK_K, DH],  # [half * stage, keys, D half]
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_K, DH], gl.bfloat16))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, DH], QD.layout)  # [half * buffer, heads, D half]
    # [half * slot, heads, keys] fp32. The accumulator layout writes 8 rows of 32 bytes per warp;
    # unswizzled, all 8 would share one group of banks. Swizzled in 32-byte pieces by row % 4,
    # each store takes the 2 wavefronts its 256 bytes need (padding rows would cost the 8 KB
    # that the second q buffer needs).
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H, BLOCK_K], x_layout)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    qbars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # [half * buffer]
    for j in gl.static_range(4):
        mbarrier.init(bars.index(j), count=1)
        mbarrier.init(qbars.index(j), count=1)
    args = (QD, OD, KV, IDX, CNT, SINK, LSE, kv_smem, q_smem, x_smem, bars, qbars, scale, T, H, K, skv, si_t)
    gl.warp_specialize([(_half0, args), (_half1, args)], [4], [REGS])


def _head_halves(x: torch.Tensor, cols: int | None = None) -> TensorDescriptor:
    """TMA descriptor of a contiguous [T, H, D] tensor viewed as rows (token, head) x D, in
    blocks of 64 heads x one D half (what each partition loads or stores per item), or x
    `cols` of D."""
    t, h, d = x.shape
    cols = cols or d // 2
    layout = gl.NVMMASharedLayout.get_default_for([BH, cols], gl.bfloat16)
    return TensorDescriptor.from_tensor(x.view(t * h, d), [BH, cols], layout)


def forward_into(q, kv, idx, cnt, sink, scale, o, lse):
    """Fills o [T, H, D] and lse [T, H] (contiguous q, o, kv; idx, cnt as `compact` returns
    them); a persistent grid of one program per SM."""
    t, h, _ = q.shape
    qd, od = _head_halves(q), _head_halves(o)
    grid = min(t * (h // BH), torch.cuda.get_device_properties(q.device).multi_processor_count)
    _fwd[(grid,)](qd, od, kv, idx, cnt, sink, lse, scale * LOG2E, t, h, idx.shape[1], kv.stride(0), idx.stride(0),
                  BLOCK_K=BK, NS=STAGES, REGS=WORKER_REGS, num_warps=4)


# --- backward: dq, P and dS ------------------------------------------------------------------
# Same split of D: partition p holds q[:, half p] and dO[:, half p] in shared memory (by TMA)
# and computes the partial S = Q.K^T and dP = dO.K^T over its half. Partition 1 hands its partials
# to partition 0 through shared memory (fp32); partition 0 forms P = exp(S - lse) and
# dS = P (dP - delta) scale and puts P and dS (bf16) in shared memory, where both take dS as
# the A operand of dq[:, half p] += dS.K[:, half p], and partition 1 copies P and dS into the
# scratch [Tc, K, H] that the key-major kv-gradient kernel reads. One slot per buffer, so four
# mbarriers order the hand-overs (phase = block & 1); a fifth hands partition 1's half of
# delta = rowsum(dO * O) to partition 0 once per token, and one per partition says its q and dO
# have landed. dq[:, half p] leaves through q's buffer by a TMA store. With two kv stages,
# block i + 1's rows can only come into the stage that block i - 1's dq product frees: in the
# key loop partition 0 issues that product before block i's S and dP and gathers as soon as
# it is done, while partition 1 issues S and dP first (its partials are what partition 0
# waits on) and gathers right after handing them over: a few percent faster than both
# partitions issuing S and dP first and gathering at the iteration's end (whose rows then
# waited their L2 latency at the next iteration's start).
DQ_BK, DQ_STAGES = 32, 2


@gluon.jit
def _opaque_zero(x):
    """0, computed where the compiler cannot see it. A loop-invariant shared buffer used as a
    wgmma A operand gets one 64-bit descriptor per 16-wide k step; the compiler hoists them all
    out of the loop (64 registers for q and dO over a 256-wide half) and ptxas spills them, and
    with 220 KB of shared memory the spills live in L2. Indexed by this inside the loop, the
    descriptors are made there in a few uniform-register adds instead."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_scores(q, do, kv, zero_s, WAIT: gl.constexpr):
    """Partial S = q.kv^T and dP = dO.kv^T over this half, once the block's rows are in."""
    async_copy.wait_group(WAIT)
    gl.thread_barrier()
    fence_async_shared()
    s_tok = warpgroup_mma(q, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return warpgroup_mma_wait(1, deps=[s_tok]), warpgroup_mma_wait(0, deps=[dp_tok])


@gluon.jit
def _dq_put_partials(s, dp, x_s, x_dp, b_part):
    """Partition 1: its partial S and dP to partition 0."""
    x_s.store(s)
    x_dp.store(dp)
    gl.thread_barrier()
    mbarrier.arrive(b_part, count=1)


@gluon.jit
def _dq_grads(s, dp, x_s, x_dp, b_part, b_xfree, i, kn, scale, lse2, delta, s_l: gl.constexpr):
    """Partition 0: whole S and dP of block i (its partials plus partition 1's), then
    P = exp(S - lse) (zero on empty slots) and dS = P (dP - delta) scale."""
    BLOCK_K: gl.constexpr = s.type.shape[1]
    mbarrier.wait(b_part, phase=i & 1)
    s = s + x_s.load(s_l)
    dp = dp + x_dp.load(s_l)
    gl.thread_barrier()
    mbarrier.arrive(b_xfree, count=1)
    offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
    p = gl.where((offs_k < kn)[None, :], gl.exp2(s * scale - lse2[:, None]), 0.0)
    return p, p * (dp - delta[:, None]) * (scale * 0.6931471805599453)  # scale carried log2 e


@gluon.jit
def _dq_put_pds(p, ds, p_smem, ds_smem, b_ds):
    """Partition 0: P and dS (bf16) into shared memory, for both dq products and the scratch."""
    p_smem.store(p.to(gl.bfloat16))
    ds_smem.store(ds.to(gl.bfloat16))
    gl.thread_barrier()
    fence_async_shared()
    mbarrier.arrive(b_ds, count=1)


@gluon.jit
def _dq_store_scratch(PT, DST, p_smem, ds_smem, tc, i, h0, H, K, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr):
    """Partition 1: P and dS of block i into the scratch [Tc, K, H], as [BK, BH] rows of
    16-byte pieces."""
    sc: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_H // 8), BLOCK_H // 8], [4, 1], [1, 0])
    offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, sc))
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, sc))
    so = (tc * K + offs_k[:, None]) * H + offs_h[None, :]
    smask = (offs_k < K)[:, None] & (offs_h < H)[None, :]
    gl.store(PT + so, p_smem.permute((1, 0)).load(sc), mask=smask)
    gl.store(DST + so, ds_smem.permute((1, 0)).load(sc), mask=smask)


@gluon.jit
def _dq_half(P: gl.constexpr, QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h,
             skv, si_t, kv_smem, q_smem, do_smem, x_smem, pd_smem, d_smem, bars):
    NS: gl.constexpr = kv_smem.type.shape[0] // 2
    BLOCK_K: gl.constexpr = kv_smem.type.shape[1]
    DH: gl.constexpr = kv_smem.type.shape[2]
    BLOCK_H: gl.constexpr = q_smem.type.shape[1]
    s_l: gl.constexpr = _acc_layout(BLOCK_K)
    o_l: gl.constexpr = _acc_layout(DH)
    tc = gl.program_id(0).to(gl.int64)  # token within the chunk
    t = T0 + tc
    h0 = gl.program_id(1) * BLOCK_H
    row = (t * H + h0).to(gl.int32)  # of the [T * H, D] views behind the descriptors
    q = q_smem.index(P)
    do = do_smem.index(P)
    # q and dO by TMA (no address registers). O, read only for delta = rowsum(dO * O), comes
    # into registers by loads issued before anything waits and meets dO in shared memory: dO
    # crosses HBM once (it was also read a second time for delta, in pieces). The threads' own
    # loads (the first blocks' rows, O, the count and ids; partition 0's lse and sink) go out
    # before the two 32 KB TMA copies, not behind them, so their latency overlaps the copies
    for st in gl.static_range(NS):  # bounded by K, not the count: no wait for the count's load
        _gather(KV, _ids(IDX, t, si_t, st * BLOCK_K, K, BLOCK_K, DH), kv_smem.index(P * NS + st), skv, P, DH)
    rows: gl.constexpr = _rows_layout(DH)
    offs_hr = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    offs_d = P * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, rows))
    o_half = gl.load(O + t * so_t + offs_hr[:, None] * so_h + offs_d[None, :])  # [BH, DH]
    kn = gl.load(CNT + t)
    nblk = gl.cdiv(kn, BLOCK_K)
    ids_next = _ids(IDX, t, si_t, NS * BLOCK_K, K, BLOCK_K, DH)  # loaded a block ahead of its gather
    offs_hs = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    if P == 0:
        lse = gl.load(LSE + t * H + offs_hs)
        sink = gl.load(SINK + offs_hs)
    b_qdo = bars.index(5 + P)
    mbarrier.expect(b_qdo, 2 * BLOCK_H * DH * 2)
    tma.async_copy_global_to_shared(QD, [row, P * DH], b_qdo, q)
    tma.async_copy_global_to_shared(DOD, [row, P * DH], b_qdo, do)
    x_s = x_smem.index(0)
    x_dp = x_smem.index(1)
    p_smem = pd_smem.index(0)
    ds_smem = pd_smem.index(1)
    b_part, b_xfree, b_ds, b_dsfree = bars.index(0), bars.index(1), bars.index(2), bars.index(3)
    mbarrier.wait(b_qdo, phase=0)
    # each partition sums its D half; partition 1 hands its part to partition 0, which alone
    # forms P and dS
    delta_c = gl.sum(do.load(rows).to(gl.float32) * o_half.to(gl.float32), 1)
    if P == 1:
        d_smem.store(delta_c)
        gl.thread_barrier()
        mbarrier.arrive(bars.index(4), count=1)
    else:
        mbarrier.wait(bars.index(4), phase=0)
        delta = gl.convert_layout(delta_c + d_smem.load(delta_c.type.layout), gl.SliceLayout(1, s_l))
        gl.store(DSINK + t * H + offs_hs, -gl.exp(sink - lse) * delta)
        lse2 = lse * 1.4426950408889634
    zero_s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_l)
    acc = gl.zeros([BLOCK_H, DH], gl.float32, o_l)
    if nblk > 0:
        # block 0: S, dP, the hand-over, P and dS; its dq product is issued with block 1's S, dP
        s, dp = _dq_scores(q, do, kv_smem.index(P * NS), zero_s, NS - 1)
        if P == 1:
            _dq_put_partials(s, dp, x_s, x_dp, b_part)
            mbarrier.wait(b_ds, phase=0)
        else:
            p, ds = _dq_grads(s, dp, x_s, x_dp, b_part, b_xfree, 0, kn, scale, lse2, delta, s_l)
            _dq_put_pds(p, ds, p_smem, ds_smem, b_ds)
        for i in range(1, nblk):
            stage = P * NS + i % NS
            prev = P * NS + (i - 1) % NS
            async_copy.wait_group(NS - 2)  # block i's rows are in
            gl.thread_barrier()
            fence_async_shared()
            z = _opaque_zero(i)  # the A operands' descriptors made here, not held in (spilled) registers
            kv_t = kv_smem.index(stage).permute((1, 0))
            if P == 1:  # S and dP first: its partials are what partition 0 waits on
                s_tok = warpgroup_mma(q_smem.index(P + z), kv_t, zero_s, use_acc=False, is_async=True)
                dp_tok = warpgroup_mma(do_smem.index(P + z), kv_t, zero_s, use_acc=False, is_async=True)
                acc_tok = warpgroup_mma(pd_smem.index(1 + z), kv_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(2, deps=[s_tok])
                dp = warpgroup_mma_wait(1, deps=[dp_tok])
                mbarrier.wait(b_xfree, phase=(i - 1) & 1)
                _dq_put_partials(s, dp, x_s, x_dp, b_part)
                acc = warpgroup_mma_wait(0, deps=[acc_tok])
                gl.thread_barrier()  # every warp's dq product has read the stage
                _gather(KV, ids_next, kv_smem.index(prev), skv, P, DH)
                ids_next = _ids(IDX, t, si_t, (i + NS) * BLOCK_K, kn, BLOCK_K, DH)
                _dq_store_scratch(PT, DST, p_smem, ds_smem, tc, i - 1, h0, H, K, BLOCK_H, BLOCK_K)
                gl.thread_barrier()
                mbarrier.arrive(b_dsfree, count=1)
                mbarrier.wait(b_ds, phase=i & 1)
            else:  # dq of block i - 1 first: block i + 1's rows come in while S and dP run
                acc_tok = warpgroup_mma(pd_smem.index(1 + z), kv_smem.index(prev), acc, is_async=True)
                s_tok = warpgroup_mma(q_smem.index(P + z), kv_t, zero_s, use_acc=False, is_async=True)
                dp_tok = warpgroup_mma(do_smem.index(P + z), kv_t, zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(2, deps=[acc_tok])
                gl.thread_barrier()  # every warp's dq product has read the stage
                _gather(KV, ids_next, kv_smem.index(prev), skv, P, DH)
                ids_next = _ids(IDX, t, si_t, (i + NS) * BLOCK_K, kn, BLOCK_K, DH)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                dp = warpgroup_mma_wait(0, deps=[dp_tok])
                p, ds = _dq_grads(s, dp, x_s, x_dp, b_part, b_xfree, i, kn, scale, lse2, delta, s_l)
                mbarrier.wait(b_dsfree, phase=(i - 1) & 1)
                _dq_put_pds(p, ds, p_smem, ds_smem, b_ds)
        acc = warpgroup_mma(ds_smem, kv_smem.index(P * NS + (nblk - 1) % NS), acc)
        if P == 1:
            _dq_store_scratch(PT, DST, p_smem, ds_smem, tc, nblk - 1, h0, H, K, BLOCK_H, BLOCK_K)
    async_copy.wait_group(0)  # the (empty) copies past the last block have landed
    # dS carried scale already; dq leaves through q's buffer by a TMA store
    q.store(acc.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(DQD, [row, P * DH], q)
    tma.store_wait(0)


@gluon.jit
def _dq_half0(QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t, kv_smem,
              q_smem, do_smem, x_smem, pd_smem, d_smem, bars):
    _dq_half(0, QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t,
             kv_smem, q_smem, do_smem, x_smem, pd_smem, d_smem, bars)


@gluon.jit
def _dq_half1(QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t, kv_smem,
              q_smem, do_smem, x_smem, pd_smem, d_smem, bars):
    _dq_half(1, QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t,
             kv_smem, q_smem, do_smem, x_smem, pd_smem, d_smem, bars)


@gluon.jit
def _bwd_dq(QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t,
            BLOCK_K: gl.constexpr, NS: gl.constexpr, REGS: gl.constexpr):
    BLOCK_H: gl.constexpr = QD.block_type.shape[0]
    DH: gl.constexpr = QD.block_type.shape[1]
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, BLOCK_K, DH],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_K, DH], gl.bfloat16))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, DH], QD.layout)  # [half, heads, D half]
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, DH], QD.layout)
    padded: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BLOCK_K, 8]], [BLOCK_H, BLOCK_K], [1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H, BLOCK_K], padded)  # partials S, dP of half 1
    pd_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_K],  # P, dS
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], gl.bfloat16))
    d_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # delta part
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())  # 4 hand-overs, delta, q and dO x 2
    for j in gl.static_range(7):
        mbarrier.init(bars.index(j), count=1)
    args = (QD, DOD, DQD, KV, IDX, CNT, SINK, O, LSE, DSINK, PT, DST, T0, scale, H, K, so_t, so_h, skv, si_t, kv_smem,
            q_smem, do_smem, x_smem, pd_smem, d_smem, bars)
    gl.warp_specialize([(_dq_half0, args), (_dq_half1, args)], [4], [REGS])


def bwd_dq_into(q, kv, idx, cnt, sink, scale, o, do, lse, dq, dsink_terms, pt, dst, t0, tc):
    """Tokens t0 .. t0 + tc of the backward's first pass: dq, the sink-gradient terms, and P,
    dS * scale into the scratch pt, dst [Tc, K, H] (contiguous q, kv, o, do, dq; idx, cnt as
    `compact` returns them: the first blocks' ids are read before the count, relying on its -1
    past the count)."""
    h = q.shape[1]
    qd, dod, dqd = _head_halves(q), _head_halves(do), _head_halves(dq)
    _bwd_dq[(tc, h // BH)](qd, dod, dqd, kv, idx, cnt, sink, o, lse, dsink_terms, pt, dst, t0, scale * LOG2E, h,
                           idx.shape[1], o.stride(0), o.stride(1), kv.stride(0), idx.stride(0), BLOCK_K=DQ_BK,
                           NS=DQ_STAGES, REGS=WORKER_REGS, num_warps=4)


# --- backward: kv gradient -------------------------------------------------------------------
# Key-major like the portable `_bwd_dkv` (program = D tile, key tile, split of the chunk's
# tokens; the tile's gradient summed over the tokens in registers), in tiles of BN keys x BD
# of D with the products on wgmma from shared memory. Why: the portable kernel's 64 x 128 tiles
# read each token's q and dO once per key tile that the token touches and P, dS once per D
# tile, about L2's rate at HCA S = 8192; larger tiles read less (128 x 256: ~70% of it). Per
# item (token, 64-head block) a stage holds P and dS rows [BN keys, 64 heads] (cp.async
# through the slot map: zeros where the token did not pick the key, the wgmma A operands as
# stored) and q, dO [64 heads, BD] by TMA (the B operands). Items run in a ring: item i + NS -
# 1 comes into the stage of item i - 1 once item i's products are issued and item i - 1's are
# done, so the tensor cores always have a pair queued. The tile by the index-set width K
# (`benchmarks/kv_gradient_gpu.py`, fast mode, kernels/NOTES.md): wide sets (CSA's top-k) 128
# keys x 128 of D in 3 stages, narrow ones (HCA's few compressed blocks) 64 x 256 in 2.
KV_TILES = {"wide": (128, 128, 3), "narrow": (64, 256, 2)}
KV_NARROW = 256  # K at most this: the narrow tile


def kv_tile(k: int) -> tuple[int, int, int]:
    """(keys, D columns, stages) of the kv-gradient tile for index sets of width k."""
    return KV_TILES["narrow" if k <= KV_NARROW else "wide"]


@triton.constexpr_function
def _pd_rows_layout(warps):
    """[keys, 64 heads] bf16 rows of P or dS moved as 16-byte pieces, eight lanes a row."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _kv_slots(SMAP, tc, ss_t, n0, N, ok, BLOCK_N: gl.constexpr):
    """Token tc's slots of keys n0 .. n0 + BN (-1: not picked; all -1 unless ok)."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _pd_rows_layout(gl.num_warps())))
    return gl.load(SMAP + tc * ss_t + offs_n, mask=(offs_n < N) & ok, other=-1).to(gl.int32)


@gluon.jit
def _kv_issue(QD, DOD, PT, DST, slots, tc, T0, hb, H, K, dcol, p_s, ds_s, q_s, do_s, bar, ok):
    """Item (token tc, head block hb) into one stage: its P and dS rows as one copy group
    (empty when not ok, to keep the group count), q and dO by TMA."""
    BLOCK_H: gl.constexpr = q_s.type.shape[0]
    BD: gl.constexpr = q_s.type.shape[1]
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, _pd_rows_layout(gl.num_warps())))
    so = ((tc * K + slots.to(gl.int64)) * H)[:, None] + offs_h[None, :]  # rows of the scratch [Tc, K, H]
    picked = (slots >= 0)[:, None]
    async_copy.async_copy_global_to_shared(p_s, PT + so, mask=picked)
    async_copy.async_copy_global_to_shared(ds_s, DST + so, mask=picked)
    async_copy.commit_group()
    if ok:
        row = ((T0 + tc) * H + hb * BLOCK_H).to(gl.int32)
        mbarrier.expect(bar, 2 * BLOCK_H * BD * 2)
        tma.async_copy_global_to_shared(QD, [row, dcol], bar, q_s)
        tma.async_copy_global_to_shared(DOD, [row, dcol], bar, do_s)


@gluon.jit
def _bwd_dkv(QD, DOD, PT, DST, SMAP, FIRST, LAST, DKV, BUF, T0, H, K, N, D, TSPLIT, ss_t,
             BLOCK_N: gl.constexpr, GROUP: gl.constexpr, NS: gl.constexpr, DETERMINISTIC: gl.constexpr):
    BLOCK_H: gl.constexpr = QD.block_type.shape[0]
    BD: gl.constexpr = QD.block_type.shape[1]
    n0 = gl.program_id(1) * BLOCK_N
    dcol = gl.program_id(0) * BD
    split = gl.program_id(2)
    # tokens of this split that pick any key of the tile: the union of its key groups' ranges
    g_l: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    groups = n0 // GROUP + gl.arange(0, BLOCK_N // GROUP, layout=g_l)
    gmask = groups < gl.cdiv(N, GROUP)
    lo = gl.maximum(gl.min(gl.load(FIRST + groups, mask=gmask, other=2 ** 30), 0), split * TSPLIT)
    hi = gl.minimum(gl.max(gl.load(LAST + groups, mask=gmask, other=-1), 0) + 1, split * TSPLIT + TSPLIT)
    n_hb = H // BLOCK_H
    n_items = gl.maximum(hi - lo, 0) * n_hb  # (token, head block), token-major
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, BD, 16])
    acc = gl.zeros([BLOCK_N, BD], gl.float32, acc_l)  # a warpgroup per 64 keys
    pd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BLOCK_N, BLOCK_H], pd_layout)
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BLOCK_N, BLOCK_H], pd_layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BLOCK_H, BD], QD.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BLOCK_H, BD], QD.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NS):
        mbarrier.init(bars.index(j), count=1)
    if n_items > 0:
        for st in gl.static_range(NS - 1):
            ok = st < n_items
            tc = (lo + st // n_hb).to(gl.int64)
            _kv_issue(QD, DOD, PT, DST, _kv_slots(SMAP, tc, ss_t, n0, N, ok, BLOCK_N), tc, T0, st % n_hb, H, K,
                      dcol, p_s.index(st), ds_s.index(st), q_s.index(st), do_s.index(st), bars.index(st), ok)
        slots_next = _kv_slots(SMAP, (lo + (NS - 1) // n_hb).to(gl.int64), ss_t, n0, N, NS - 1 < n_items, BLOCK_N)
        for i in range(n_items):
            s = i % NS
            async_copy.wait_group(NS - 2)  # item i's P and dS rows are in
            mbarrier.wait(bars.index(s), phase=(i // NS) & 1)  # and its q and dO
            gl.thread_barrier()
            fence_async_shared()
            # dkv[keys, d] += P^T[keys, heads] dO[heads, d] + dS^T[keys, heads] q[heads, d]
            acc = warpgroup_mma(p_s.index(s), do_s.index(s), acc, is_async=True)
            acc = warpgroup_mma(ds_s.index(s), q_s.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(2, deps=[acc])  # item i - 1's products are done
            gl.thread_barrier()  # in every warp: its stage is free
            nxt = i + NS - 1
            ok = nxt < n_items
            r = nxt % NS
            _kv_issue(QD, DOD, PT, DST, slots_next, (lo + nxt // n_hb).to(gl.int64), T0, nxt % n_hb, H, K, dcol,
                      p_s.index(r), ds_s.index(r), q_s.index(r), do_s.index(r), bars.index(r), ok)
            slots_next = _kv_slots(SMAP, (lo + (nxt + 1) // n_hb).to(gl.int64), ss_t, n0, N, nxt + 1 < n_items,
                                   BLOCK_N)  # a whole item ahead of its copies
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)  # the empty groups past the last item
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    offs_d = dcol + gl.arange(0, BD, layout=gl.SliceLayout(0, acc_l))
    out = offs_n.to(gl.int64)[:, None] * D + offs_d[None, :]
    nmask = (offs_n < N)[:, None]
    if DETERMINISTIC:  # every program writes its slot (zeros if it had no token)
        gl.store(BUF + split.to(gl.int64) * N * D + out, acc, mask=nmask)
    elif n_items > 0:
        gl.atomic_add(DKV + out, acc, mask=nmask, sem="relaxed")  # only the sum matters


def bwd_dkv_into(q, do, pt, dst, smap, first, last, dkv, buf, t0, tsplit, group, deterministic, bn=None, bd=None,
                 ns=None):
    """The kv gradient of tokens t0 .. t0 + Tc (Tc = smap's rows) from the dq pass's scratch pt,
    dst [Tc, K, H]: added to dkv [N, D] fp32 by atomics, or (deterministic) stored per split of
    tsplit tokens into buf [splits, N, D] fp32 for the caller to sum in order. smap, first, last:
    as `sparse_attention._key_map` makes them, with `group` keys per entry. bn, bd, ns: the
    tile (bn // 16 warps) and the stages (the benchmark's sweep); None: `kv_tile`'s."""
    tile = kv_tile(pt.shape[1])
    bn, bd, ns = bn or tile[0], bd or tile[1], ns or tile[2]
    h, d = q.shape[1:]
    tc, n = smap.shape
    bd = min(d, bd)
    qd, dod = _head_halves(q, bd), _head_halves(do, bd)
    grid = (d // bd, triton.cdiv(n, bn), triton.cdiv(tc, tsplit))
    _bwd_dkv[grid](qd, dod, pt, dst, smap, first, last, dkv, buf, t0, h, pt.shape[1], n, d, tsplit, smap.stride(0),
                   BLOCK_N=bn, GROUP=group, NS=ns, DETERMINISTIC=deterministic, num_warps=bn // 16)
