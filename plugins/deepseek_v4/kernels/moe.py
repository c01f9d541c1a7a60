"""The MoE's row moves between tokens and expert groups (`ops.routed_experts`), one pass each,
and the expert weights' gradient added into Megatron's fp32 gradient buffer.

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
def _sum_rows(Y, Y2, ROWS, OUT, N, D, K: tl.constexpr, TWO: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[t] = sum over slots s of Y[ROWS[t * K + s]] (+ Y2's same row where TWO) in fp32
    (slot order, Y before Y2; -1 adds nothing)."""
    t = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = (c < D)[None, :]
    acc = tl.zeros([BR, BD], tl.float32)
    for s in tl.static_range(K):
        src = tl.load(ROWS + t.to(tl.int64) * K + s, mask=t < N, other=-1)
        at, m = src.to(tl.int64)[:, None] * D + c[None, :], (src >= 0)[:, None] & cm
        acc += tl.load(Y + at, mask=m, other=0.0).to(tl.float32)
        if TWO:
            acc += tl.load(Y2 + at, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64)[:, None] * D + c[None, :], acc.to(OUT.dtype.element_ty), mask=(t < N)[:, None] & cm)


def gather_rows(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, d], idx [M] (int, -1: a zero row) -> x[idx] [M, d] in `dtype` (x's by default)."""
    m, d = idx.numel(), x.shape[1]
    out = new_output((m, d), x, dtype or x.dtype)
    if m and d:
        _gather_rows[(triton.cdiv(m, BR), triton.cdiv(d, BD))](x.contiguous(), idx.contiguous(), out, m, d,
                                                              BR=BR, BD=BD)
    return out


def sum_rows(y: torch.Tensor, rows: torch.Tensor, k: int, dtype: torch.dtype,
             also: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, d], rows [N * k] (int, -1: no row) -> [N, d] in `dtype`: row t is the fp32 sum of
    y[rows[t * k + s]] over its k slots, plus also's same rows where given (also [M, d]: two
    gradients of one [M, d] tensor summed here, not added into a third first)."""
    n, d = rows.numel() // k, y.shape[1]
    if also is not None and also.shape != y.shape:
        raise ValueError(f"sum_rows: also {list(also.shape)} is not y's shape {list(y.shape)}")
    out = new_output((n, d), y, dtype)
    if n and d:
        y = y.contiguous()
        _sum_rows[(triton.cdiv(n, BR), triton.cdiv(d, BD))](y, y if also is None else also.contiguous(),
                                                           rows.contiguous(), out, n, d, K=k, TWO=also is not None,
                                                           BR=BR, BD=BD)
    return out


# --------------------------------------------------------------------------- expert groups, small batches
# A decoding step routes a few hundred (token, slot) pairs a layer. ops.expert_rows lays them
# out with a sort, searches, scans and gathers, and routed_experts derives its row maps from
# that layout: ~35 small kernels a layer, most of a decode step's MoE time that is not GEMM.
# Here one program does all of it for up to LAYOUT_MAX one-hot cells (pairs x experts).
LAYOUT_MAX = 1 << 15


@triton.jit
def _expert_layout(IDX, W, OFFS, COUNTS, PAIR_OF_ROW, TOKEN_OF_ROW, ROW_OF_PAIR, WG, P, M, n_local,
                   K: tl.constexpr, ALIGN: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """One program: pairs i < P with local experts IDX[i] (0..n_local-1, others not here) as
    expert groups, each group's pairs in pair order, its rows padded to a multiple of ALIGN
    (one block at least), the last group ending at M."""
    i = tl.arange(0, BP)
    e = tl.arange(0, BE)
    live = i < P
    ex = tl.load(IDX + i, mask=live, other=-1)
    local = live & (ex >= 0) & (ex < n_local)
    hit = (ex[:, None] == e[None, :]) & local[:, None]  # [BP, BE] one-hot of the local pairs
    ones = hit.to(tl.int32)
    counts = tl.sum(ones, axis=0)  # [BE]
    rank = tl.sum(tl.where(hit, tl.cumsum(ones, axis=0), 0), axis=1) - 1  # [BP] place in its group
    is_e = e < n_local
    padded = tl.where(is_e, (tl.maximum(counts, 1) + ALIGN - 1) // ALIGN * ALIGN, 0)
    end = tl.cumsum(padded, axis=0)
    start = tl.sum(tl.where(hit, (end - padded)[None, :], 0), axis=1)  # [BP] its group's first row
    row = tl.where(local, start + rank, -1)
    tl.store(OFFS + e, tl.where(e == n_local - 1, M, end).to(tl.int32), mask=is_e)
    tl.store(COUNTS + e, counts.to(tl.int64), mask=is_e)
    tl.store(ROW_OF_PAIR + i, row.to(tl.int64), mask=live)
    for r0 in range(0, M, BM):  # every row a padding row first
        r = r0 + tl.arange(0, BM)
        tl.store(PAIR_OF_ROW + r, tl.full([BM], -1, tl.int64), mask=r < M)
        tl.store(TOKEN_OF_ROW + r, tl.full([BM], -1, tl.int64), mask=r < M)
        tl.store(WG + r, tl.zeros([BM], tl.float32), mask=r < M)
    tl.debug_barrier()  # then the real rows (other threads wrote their padding)
    w = tl.load(W + i, mask=live, other=0.0)
    tl.store(PAIR_OF_ROW + row, i.to(tl.int64), mask=local)
    tl.store(TOKEN_OF_ROW + row, (i // K).to(tl.int64), mask=local)
    tl.store(WG + row, w.to(tl.float32), mask=local)


def layout_fits(pairs: int, n_local: int) -> bool:
    """Whether expert_layout takes `pairs` pairs over n_local experts (one program's one-hot)."""
    return triton.next_power_of_2(max(pairs, 1)) * triton.next_power_of_2(n_local) <= LAYOUT_MAX


def expert_layout(idx: torch.Tensor, weight: torch.Tensor, first: int, n_local: int, align: int):
    """What ops.routed_experts reads of ops.expert_rows' layout when every pair is local, in
    one program: idx [N, k] global expert ids (first..first+n_local-1), weight [N, k] ->
    (offs [E] int32 group ends, counts [E], M, pair_of_row [M], token_of_row [M] (-1: a
    padding row), row_of_pair [N*k], wg [M] fp32 each row's routing weight, 0 on padding)."""
    n, k = idx.shape
    p = n * k
    m = p + align * n_local  # as expert_rows: >= the padded total, the last group takes the rest
    offs = new_output((n_local,), idx, torch.int32)
    counts = new_output((n_local,), idx, torch.int64)
    pair_of_row, token_of_row = new_output((m,), idx, torch.int64), new_output((m,), idx, torch.int64)
    row_of_pair, wg = new_output((p,), idx, torch.int64), new_output((m,), idx, torch.float32)
    flat = (idx.reshape(-1) - first).contiguous()
    _expert_layout[(1,)](flat, weight.reshape(-1).float().contiguous(), offs, counts, pair_of_row, token_of_row,
                         row_of_pair, wg, p, m, n_local, K=k, ALIGN=align, BP=triton.next_power_of_2(max(p, 1)),
                         BE=triton.next_power_of_2(n_local), BM=1024 if not INTERPRET else 64)
    return offs, counts, m, pair_of_row, token_of_row, row_of_pair, wg


# --------------------------------------------------------------------------- expert weight gradient
# dW[g] = dY_g^T A_g over each expert group's rows, added into the weight's fp32 main_grad by
# the GEMM's epilogue. torch's grouped GEMM writes dW in bf16 and DDP (or the backward graph)
# then adds it into main_grad in a second pass: per parameter a bf16 write, then a bf16 read
# and an fp32 read and write (the ~1B step's experts: 54 adds of 37.7M parameters, 8.4 ms on
# an H100), and the sum loses the bf16 rounding. Autotuned per (N, K) over output tiles only:
# every config of one path sums each element's rows in the same BM-row steps, so the choice
# (which may differ between processes) does not change the bits.
# Two ways to load the rows. Pointer tiles (any GPU, the interpreter's default): their address
# and mask tensors take registers, which held the tile's row step to 32 (benchmarks/moe_gpu.py).
# TMA (sm_90+, `TMA`): each group's rows as a tensor descriptor of their own, made on the device
# from OFFS, so the copy engine zero-fills the rows past the group's end and no address is kept in
# registers; longer row steps then fit. At flash_slice's shapes (moe_gpu.py, H200) the rows' L2
# traffic bounds it: a 128 x 128 tile takes 64 FLOP a byte loaded, 256 x 128 (two warpgroups) 85.
# The tuning runs restore D. The interpreter's dot mishandles bf16: it multiplies fp32 copies (UPCAST).
WGRAD_ROWS, WGRAD_ROWS_TMA = 32, 64
_WGRAD_CONFIGS = ([triton.Config({"BN": 16, "BK": 16, "BM": 16}, num_warps=1, num_stages=1)] if INTERPRET else
                  [triton.Config({"BN": bn, "BK": bk, "BM": WGRAD_ROWS}, num_warps=w, num_stages=st)
                   for bn, bk, w, st in [(128, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (128, 256, 8, 4),
                                         (256, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 3)]])
_WGRAD_TMA_CONFIGS = ([triton.Config({"BN": 16, "BK": 16, "BM": 16}, num_warps=1, num_stages=1)] if INTERPRET else
                      [triton.Config({"BN": bn, "BK": bk, "BM": WGRAD_ROWS_TMA}, num_warps=w, num_stages=st)
                       for bn, bk, w, st in [(128, 128, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3),
                                             (256, 128, 8, 4)]])


@triton.jit
def _grouped_wgrad_body(DY, A, OFFS, D, N, K, UPCAST: tl.constexpr, TMA: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, BM: tl.constexpr):
    """Program (tile of D[g], group g): D[g][n, k] += sum over the group's rows m of DY[m, n] A[m, k]."""
    tiles_k = tl.cdiv(K, BK)
    g = tl.program_id(1)
    n0 = (tl.program_id(0) // tiles_k) * BN
    k0 = (tl.program_id(0) % tiles_k) * BK
    n = n0 + tl.arange(0, BN)
    k = k0 + tl.arange(0, BK)
    start = tl.load(OFFS + g - 1, mask=g > 0, other=0)  # OFFS: each group's end row
    end = tl.load(OFFS + g)
    acc = tl.zeros([BN, BK], tl.float32)
    if TMA:  # the group's rows [start, end) as tensors [rows, N], [rows, K] (a descriptor wants >= 1 row)
        rows = end - start
        dy_rows = tl.make_tensor_descriptor(DY + start.to(tl.int64) * N, shape=[tl.maximum(rows, 1), N],
                                            strides=[N, 1], block_shape=[BM, BN])
        a_rows = tl.make_tensor_descriptor(A + start.to(tl.int64) * K, shape=[tl.maximum(rows, 1), K],
                                           strides=[K, 1], block_shape=[BM, BK])
        for m0 in range(0, rows, BM):
            dy = dy_rows.load([m0, n0])  # [BM, BN], zeros past the group's end
            a = a_rows.load([m0, k0])  # [BM, BK]
            if UPCAST:
                dy, a = dy.to(tl.float32), a.to(tl.float32)
            acc = tl.dot(tl.trans(dy), a, acc)  # [BN, BM] @ [BM, BK]
    else:
        for m0 in range(start, end, BM):
            m = m0 + tl.arange(0, BM)
            rm = (m < end)[:, None]
            dy = tl.load(DY + m.to(tl.int64)[:, None] * N + n[None, :], mask=rm & (n < N)[None, :], other=0.0)
            a = tl.load(A + m.to(tl.int64)[:, None] * K + k[None, :], mask=rm & (k < K)[None, :], other=0.0)
            if UPCAST:
                dy, a = dy.to(tl.float32), a.to(tl.float32)
            acc = tl.dot(tl.trans(dy), a, acc)  # [BN, BM] @ [BM, BK]
    out = D + g.to(tl.int64) * N * K + n[:, None] * K + k[None, :]
    dm = (n < N)[:, None] & (k < K)[None, :]
    tl.store(out, (tl.load(out, mask=dm, other=0.0).to(tl.float32) + acc).to(D.dtype.element_ty), mask=dm)


_grouped_wgrad = triton.autotune(_WGRAD_CONFIGS, key=["N", "K"], restore_value=["D"])(_grouped_wgrad_body)
_grouped_wgrad_tma = triton.autotune(_WGRAD_TMA_CONFIGS, key=["N", "K"], restore_value=["D"])(_grouped_wgrad_body)


def _scratch_on(device: torch.device):
    """Triton's allocator for the global scratch of the descriptors a TMA program makes (128
    bytes each; torch's blocks are 512-byte aligned, past what TMA asks)."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def wgrad_takes_tma(dy: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the TMA loads apply: sm_90+ (or the interpreter, which runs the same path) and
    rows whose starts and strides are 16-byte aligned (N, K multiples of 8, bf16/fp16)."""
    if not (INTERPRET or (dy.is_cuda and torch.cuda.get_device_capability(dy.device)[0] >= 9)):
        return False
    return (dy.element_size() == a.element_size() == 2 and dy.shape[1] % 8 == 0 and a.shape[1] % 8 == 0
            and dy.data_ptr() % 16 == 0 and a.data_ptr() % 16 == 0)


def add_grouped_wgrad(dy: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, d: torch.Tensor,
                      tma: bool | None = None) -> None:
    """d[g] += dy[rows of g]^T @ a[rows of g] for dy [M, N], a [M, K] (rows grouped, group g
    ending at offs[g], int32) and d [G, N, K] contiguous (fp32: Megatron's main_grad), the
    products summed in fp32 and added once. `tma`: the loads' path (None: TMA where it applies)."""
    (m, n), k, groups = dy.shape, a.shape[1], offs.numel()
    if a.shape[0] != m or tuple(d.shape) != (groups, n, k) or not d.is_contiguous():
        raise ValueError(f"grouped wgrad: dy {list(dy.shape)}, a {list(a.shape)}, d {list(d.shape)} "
                         f"(contiguous: {d.is_contiguous()}) for {groups} groups")
    if not (m and n and k and groups):
        return
    dy, a = dy.contiguous(), a.contiguous()
    tma = wgrad_takes_tma(dy, a) if tma is None else tma
    grid = lambda meta: (triton.cdiv(n, meta["BN"]) * triton.cdiv(k, meta["BK"]), groups)  # noqa: E731
    if tma:  # Triton's allocator is a context variable: set where the launch runs (autograd's thread)
        triton.set_allocator(_scratch_on(dy.device))
    kernel = _grouped_wgrad_tma if tma else _grouped_wgrad
    kernel[grid](dy, a, offs.contiguous(), d, n, k, UPCAST=INTERPRET, TMA=tma)
