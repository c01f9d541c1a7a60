"""Fused elementwise chains of a block: RMSNorm, RoPE and the clamped SwiGLU (with its
routing weight), forward and backward.

The PyTorch references (`ops.rms_norm`, `ops.apply_rope`, `ops.swiglu`) run each as 7-10
launches forward and 17-21 backward (casts, slices, products and sums over the same rows);
at the ~1B config's 4,096 tokens the step is bound by the host's launch rate, not the GPU.
Here each is one launch forward and one backward (RMSNorm's weight gradient: one more, the
sum of per-program partials). Same contracts as the references: math in fp32 registers,
outputs and input gradients stored in the inputs' dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output

TILE = 256 if INTERPRET else 4096  # elements of one program's [rows, columns] tile


def _tile_rows(cols_p2: int) -> int:
    return max(1, TILE // cols_p2)


def _programs(tiles: int, device: torch.device) -> int:
    """Programs of a backward that loops over row tiles and reduces a weight gradient: enough
    to fill the GPU, few enough that the partials to sum stay small."""
    if INTERPRET or device.type != "cuda":
        return min(tiles, 4)
    return min(tiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


# --------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_fwd(X, W, Y, RSTD, R, D, eps, HAS_W: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, DP)
    m = (r < R)[:, None] & (c < D)[None, :]
    offs = r.to(tl.int64)[:, None] * D + c[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)  # [BR]
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + r, rstd, mask=r < R)


@triton.jit
def _rms_bwd(X, W, G, RSTD, DX, DWP, R, D, HAS_W: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr):
    """dx = rstd * (g*w - xh * mean(g*w*xh)), xh = x * rstd; each program also sums g * xh
    over its row tiles into one row of the weight-gradient partials DWP [programs, D]."""
    pid = tl.program_id(0)
    c = tl.arange(0, DP)
    w = tl.load(W + c, mask=c < D, other=0.0).to(tl.float32) if HAS_W else tl.full([DP], 1.0, tl.float32)
    dw = tl.zeros([DP], tl.float32)
    for t in range(pid, tl.cdiv(R, BR), tl.num_programs(0)):
        r = t * BR + tl.arange(0, BR)
        m = (r < R)[:, None] & (c < D)[None, :]
        offs = r.to(tl.int64)[:, None] * D + c[None, :]
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < R, other=0.0)
        xh = x * rstd[:, None]
        gw = g * w[None, :]
        dot = tl.sum(gw * xh, 1) / D
        tl.store(DX + offs, (rstd[:, None] * (gw - xh * dot[:, None])).to(DX.dtype.element_ty), mask=m)
        if HAS_W:
            dw += tl.sum(g * xh, 0)
    if HAS_W:
        tl.store(DWP + pid * D + c, dw, mask=c < D)


def rms_forward(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's forward alone (no graph): y [..., D] in x.dtype and rstd [rows] fp32."""
    d = x.shape[-1]
    x = x.contiguous()
    r = x.numel() // d if d else 0
    dp = triton.next_power_of_2(max(d, 1))
    y, rstd = new_output(x.shape, x, x.dtype), new_output((r,), x, torch.float32)
    if r:
        br = _tile_rows(dp)
        _rms_fwd[(triton.cdiv(r, br),)](x, w if w is not None else x, y, rstd, r, d, eps,
                                        HAS_W=w is not None, BR=br, DP=dp)
    return y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, rstd = rms_forward(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, rstd = ctx.saved_tensors
        d = x.shape[-1]
        r = rstd.numel()
        dp = triton.next_power_of_2(max(d, 1))
        br = _tile_rows(dp)
        progs = _programs(triton.cdiv(r, br), x.device) if r else 0
        dx = new_output(x.shape, x, x.dtype)
        dwp = new_output((progs, d), x, torch.float32) if w is not None else None
        if r:
            _rms_bwd[(progs,)](x, w if w is not None else x, g.contiguous(), rstd, dx,
                               dwp if dwp is not None else rstd, r, d, HAS_W=w is not None, BR=br, DP=dp)
        dw = dwp.sum(0).to(w.dtype) if w is not None else None
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as `ops.rms_norm`: RMSNorm over the last dim in fp32, stored in x.dtype."""
    return _RMSNorm.apply(x, weight, eps)


# --------------------------------------------------------------------------- RoPE
# A row [D] is its first D - 2*HALF columns, copied (or only normalised), then HALF pairs
# (even column a, odd column b) rotated: (a c - b s, a s + b c). The kernels move the whole row
# as one tile and the rotated columns as one contiguous [rows, 2*HP] tile split into its pairs
# in registers, so no register holds a column's partner or its cos/sin where nothing rotates
# (the first version loaded both for all D columns: the norm's fused backward ran at half the
# bandwidth), and the loads stay contiguous along the row (two strided [rows, HP] tiles, the
# second version, ran at 1/6-1/9 of the bandwidth where a program's tile had 32-64 rows).
@triton.jit
def _pair_tiles(X, row, start, k, mk, BR: tl.constexpr, HP: tl.constexpr):
    """The rotated pairs of rows `row` (offsets [BR, 1]) as fp32 [BR, HP] tiles a, b (columns
    k [2*HP] from `start`, mask mk [BR, 2*HP])."""
    x = tl.load(X + row + start + k[None, :], mask=mk, other=0.0).to(tl.float32)  # [BR, 2*HP]
    return tl.split(tl.reshape(x, [BR, HP, 2]))


@triton.jit
def _store_rotated(Y, row, start, k, mk, a, b, cs, sn, BR: tl.constexpr, HP: tl.constexpr):
    """Pairs (a, b) rotated, (a c - b s, a s + b c), stored at their columns of rows `row`."""
    y = tl.reshape(tl.join(a * cs - b * sn, a * sn + b * cs), [BR, 2 * HP])  # [BR, HP, 2] -> [BR, 2*HP]
    tl.store(Y + row + start + k[None, :], y.to(Y.dtype.element_ty), mask=mk)


@triton.jit
def _row_tile(R, D, HALF, BR: tl.constexpr, DP: tl.constexpr):
    """This program's rows r [BR], columns c [DP], the first rotated column, the rows' offsets
    [BR, 1] and the tile's mask [BR, DP] in an [R, D] tensor."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, DP)
    return r, c, D - 2 * HALF, r.to(tl.int64)[:, None] * D, (r < R)[:, None] & (c < D)[None, :]


@triton.jit
def _rotation(COS, SIN, r, R, H, HALF, sign, HP: tl.constexpr):
    """The rotated columns k [2*HP] and their mask [BR, 2*HP]; cos and sign*sin [BR, HP] of the
    pairs (row r takes table row r // H of COS, SIN [R / H, HALF])."""
    j = tl.arange(0, HP)
    k = tl.arange(0, 2 * HP)
    mj = (r < R)[:, None] & (j < HALF)[None, :]
    crow = (r // H).to(tl.int64)[:, None] * HALF + j[None, :]
    return (k, (r < R)[:, None] & (k < 2 * HALF)[None, :], tl.load(COS + crow, mask=mj, other=1.0),
            tl.load(SIN + crow, mask=mj, other=0.0) * sign)


@triton.jit
def _rope(X, COS, SIN, Y, KEEP, R, H, D, HALF, sign, BR: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr,
          COPY: tl.constexpr, KEPT: tl.constexpr):
    """Y = X with its last 2*HALF columns rotated (the others copied where COPY; Y is X
    otherwise: a rotation in place, which touches only the rotated columns). KEPT: those
    columns as they were also go to KEEP [R, 2*HALF] (a rotation in place to be undone)."""
    r, c, start, row, m = _row_tile(R, D, HALF, BR, DP)
    if COPY:
        keep = m & (c < start)[None, :]
        tl.store(Y + row + c[None, :], tl.load(X + row + c[None, :], mask=keep), mask=keep)
    k, mk, cs, sn = _rotation(COS, SIN, r, R, H, HALF, sign, HP)
    a, b = _pair_tiles(X, row, start, k, mk, BR, HP)
    if KEPT:  # a and b are the loaded values upcast: cast back, the same bits
        was = tl.reshape(tl.join(a, b), [BR, 2 * HP])
        tl.store(KEEP + r.to(tl.int64)[:, None] * (2 * HALF) + k[None, :], was.to(KEEP.dtype.element_ty), mask=mk)
    _store_rotated(Y, row, start, k, mk, a, b, cs, sn, BR, HP)


@triton.jit
def _put_rotated(KEEP, X, R, D, HALF, BR: tl.constexpr, HP: tl.constexpr):
    """X's last 2*HALF columns of each of its R rows set to KEEP's row [R, 2*HALF]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.arange(0, 2 * HP)
    mk = (r < R)[:, None] & (k < 2 * HALF)[None, :]
    was = tl.load(KEEP + r.to(tl.int64)[:, None] * (2 * HALF) + k[None, :], mask=mk)
    tl.store(X + r.to(tl.int64)[:, None] * D + (D - 2 * HALF) + k[None, :], was, mask=mk)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, sign: float,
                 out: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """x rotated into a new tensor, or into out = x (in place: the tile spans the rotated
    columns only, so a row costs its 2*half columns, not d), the rotated columns as they were
    into keep [rows, 2*half] where given."""
    d, half = x.shape[-1], cos.shape[-1]
    r = x.numel() // d if d else 0
    y = new_output(x.shape, x, x.dtype) if out is None else out
    if r:
        hp = triton.next_power_of_2(max(half, 1))
        dp = triton.next_power_of_2(d) if out is None else 2 * hp
        br = _tile_rows(dp)
        _rope[(triton.cdiv(r, br),)](x, cos, sin, y, y if keep is None else keep, r, heads, d, half, sign, BR=br,
                                     DP=dp, HP=hp, COPY=out is None, KEPT=keep is not None)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, sign: float):
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.sign = heads, sign
        return _rope_launch(x.contiguous(), cos, sin, heads, sign)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors  # the rotation is orthogonal: its gradient is the inverse rotation
        return _rope_launch(g.contiguous(), cos, sin, ctx.heads, -ctx.sign), None, None, None, None


def rope_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos, sin [..., rd/2] (broadcast against x[..., :rd/2], varying over leading dims of x
    only) as the kernels' tables [rows, rd/2] fp32, and `heads`: the rows of x [rows*heads, D]
    that share one table row."""
    d, half = x.shape[-1], cos.shape[-1]
    if 2 * half > d or (d - 2 * half) % 2:
        raise ValueError(f"rope kernel: {2 * half} rotated dims do not fit an even split of {d}")
    lead = (1,) * (x.dim() - cos.dim()) + tuple(cos.shape[:-1])
    k = len(lead)
    while k and lead[k - 1] == 1:
        k -= 1
    rows = x.shape[:k]
    heads = 1
    for n in x.shape[k:-1]:
        heads *= n

    def table(t: torch.Tensor) -> torch.Tensor:  # [prod(rows), rd/2] fp32
        return t.float().reshape(lead[:k] + (half,)).expand(rows + (half,)).reshape(-1, half).contiguous()

    return table(cos), table(sin), heads


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Same contract as `ops.apply_rope` (x [..., D]; cos, sin [..., rd/2] fp32 broadcast
    against x[..., :rd/2]), for cos/sin that vary over leading dims of x only (tokens) and
    broadcast over the trailing ones (heads). cos and sin carry no gradient."""
    cos_t, sin_t, heads = rope_tables(x, cos, sin)
    return _Rope.apply(x, cos_t, sin_t, heads, -1.0 if inverse else 1.0)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """apply_rope in place on a contiguous x outside autograd (a gradient a backward has just
    made, or rope_kept_'s x): only the rotated columns are read and written."""
    if not x.is_contiguous():
        raise ValueError("apply_rope_: x must be contiguous")
    cos_t, sin_t, heads = rope_tables(x, cos, sin)
    return _rope_launch(x, cos_t, sin_t, heads, -1.0 if inverse else 1.0, out=x)


def rope_kept_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """apply_rope_, and the rotated columns as they were [..., rd] (x's dtype, contiguous) from
    the same pass, for put_rotated_ to undo the rotation bit for bit."""
    if not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rope_kept_: x must be contiguous fp32, bf16 or fp16 (the kernel holds the columns "
                         f"in fp32 registers: wider ones would come back rounded), not {x.dtype}")
    cos_t, sin_t, heads = rope_tables(x, cos, sin)
    kept = new_output((*x.shape[:-1], 2 * cos.shape[-1]), x, x.dtype)
    _rope_launch(x, cos_t, sin_t, heads, -1.0 if inverse else 1.0, out=x, keep=kept)
    return kept


def put_rotated_(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """x's last kept.shape[-1] columns set to kept (rope_kept_'s), in place; x contiguous."""
    if (not x.is_contiguous() or not kept.is_contiguous() or kept.shape[:-1] != x.shape[:-1] or kept.shape[-1] % 2
            or kept.shape[-1] > x.shape[-1] or kept.dtype != x.dtype or kept.device != x.device):
        raise ValueError(f"put_rotated_: x {list(x.shape)} {x.dtype} and kept {list(kept.shape)} {kept.dtype} must be "
                         "contiguous on one device, of one dtype, with the same rows, kept an even width within x's")
    d, w = x.shape[-1], kept.shape[-1]
    r = x.numel() // d if d else 0
    if r and w:
        hp = triton.next_power_of_2(max(w // 2, 1))
        br = _tile_rows(2 * hp)
        _put_rotated[(triton.cdiv(r, br),)](kept, x, r, d, w // 2, BR=br, HP=hp)
    return x


# --------------------------------------------------------------------------- RMSNorm then RoPE
@triton.jit
def _norm_rope_fwd(X, COS, SIN, OUT, RSTD, R, H, D, HALF, eps, BR: tl.constexpr, DP: tl.constexpr,
                   HP: tl.constexpr):
    """OUT = rotate(x rstd), RSTD = 1 / rms(x), one read of each row (rotated in fp32)."""
    r, c, start, row, m = _row_tile(R, D, HALF, BR, DP)
    x = tl.load(X + row + c[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)  # [BR]
    keep = m & (c < start)[None, :]
    tl.store(OUT + row + c[None, :], (x * rstd[:, None]).to(OUT.dtype.element_ty), mask=keep)
    tl.store(RSTD + r, rstd, mask=r < R)
    k, mk, cs, sn = _rotation(COS, SIN, r, R, H, HALF, 1.0, HP)
    a, b = _pair_tiles(X, row, start, k, mk, BR, HP)
    _store_rotated(OUT, row, start, k, mk, a * rstd[:, None], b * rstd[:, None], cs, sn, BR, HP)


@triton.jit
def _norm_rope_bwd(OUT, G, COS, SIN, RSTD, DX, R, H, D, HALF, BR: tl.constexpr, DP: tl.constexpr,
                   HP: tl.constexpr):
    """dx = rotate^-1(t), t = rstd (g - out mean(g out)): the norm's backward from its output
    y = rotate^-1(out) and gradient dy = rotate^-1(g) is rstd (dy - y mean(dy y)), and the
    rotation is orthogonal (mean(dy y) = mean(g out), and it commutes with the rest)."""
    r, c, start, row, m = _row_tile(R, D, HALF, BR, DP)
    o = tl.load(OUT + row + c[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + row + c[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + r, mask=r < R, other=0.0)
    dot = tl.sum(g * o, 1) / D
    keep = m & (c < start)[None, :]
    tl.store(DX + row + c[None, :], (rstd[:, None] * (g - o * dot[:, None])).to(DX.dtype.element_ty), mask=keep)
    k, mk, cs, sn = _rotation(COS, SIN, r, R, H, HALF, -1.0, HP)
    oa, ob = _pair_tiles(OUT, row, start, k, mk, BR, HP)
    ga, gb = _pair_tiles(G, row, start, k, mk, BR, HP)
    _store_rotated(DX, row, start, k, mk, rstd[:, None] * (ga - oa * dot[:, None]),
                   rstd[:, None] * (gb - ob * dot[:, None]), cs, sn, BR, HP)


def norm_rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """apply_rope(weightless rms_norm(x)) as one pass (no graph): out [..., D] in x.dtype,
    rstd [rows] fp32, and the tables and heads the backward takes."""
    cos_t, sin_t, heads = rope_tables(x, cos, sin)
    x = x.contiguous()
    d = x.shape[-1]
    r = x.numel() // d if d else 0
    out, rstd = new_output(x.shape, x, x.dtype), new_output((r,), x, torch.float32)
    if r:
        dp = triton.next_power_of_2(d)
        br = _tile_rows(dp)
        half = cos_t.shape[-1]
        _norm_rope_fwd[(triton.cdiv(r, br),)](x, cos_t, sin_t, out, rstd, r, heads, d, half, eps, BR=br, DP=dp,
                                              HP=triton.next_power_of_2(max(half, 1)))
    return out, rstd, cos_t, sin_t, heads


def norm_rope_backward(out: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor, cos_t: torch.Tensor,
                       sin_t: torch.Tensor, heads: int) -> torch.Tensor:
    """The input gradient of norm_rope_forward from its output and rstd, in out.dtype."""
    d = out.shape[-1]
    r = rstd.numel()
    dx = new_output(out.shape, out, out.dtype)
    if r:
        dp = triton.next_power_of_2(d)
        br = _tile_rows(dp)
        half = cos_t.shape[-1]
        _norm_rope_bwd[(triton.cdiv(r, br),)](out, g.contiguous(), cos_t, sin_t, rstd, dx, r, heads, d, half,
                                              BR=br, DP=dp, HP=triton.next_power_of_2(max(half, 1)))
    return dx


# --------------------------------------------------------------------------- clamped SwiGLU
@triton.jit
def _swiglu_fwd(G, U, WT, H, M, I, limit, HAS_W: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < M)[:, None] & (c < I)[None, :]
    offs = r.to(tl.int64)[:, None] * I + c[None, :]
    g = tl.minimum(tl.load(G + offs, mask=m, other=0.0).to(tl.float32), limit)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * tl.minimum(tl.maximum(u, -limit), limit)
    if HAS_W:
        h = h * tl.load(WT + r, mask=r < M, other=0.0)[:, None]
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(G, U, WT, DH, DG, DU, DWT, M, I, limit, HAS_W: tl.constexpr, BR: tl.constexpr,
                BI: tl.constexpr):
    """Gradients of h = w * silu(min(g, l)) * clamp(u, -l, l); clamp passes the gradient where
    the input is inside its bounds, bounds included (torch's rule). dw sums over the row."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    w = tl.load(WT + r, mask=r < M, other=0.0) if HAS_W else tl.full([BR], 1.0, tl.float32)
    dw = tl.zeros([BR], tl.float32)
    for c0 in range(0, I, BI):
        c = c0 + tl.arange(0, BI)
        m = (r < M)[:, None] & (c < I)[None, :]
        offs = r.to(tl.int64)[:, None] * I + c[None, :]
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
        dh = tl.load(DH + offs, mask=m, other=0.0).to(tl.float32)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid(gc)
        silu = gc * sig
        dhw = dh * w[:, None]
        dg = tl.where(g <= limit, dhw * uc * sig * (1.0 + gc * (1.0 - sig)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dhw * silu, 0.0)
        tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=m)
        tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=m)
        if HAS_W:
            dw += tl.sum(dh * silu * uc, 1)
    if HAS_W:
        tl.store(DWT + r, dw, mask=r < M)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, w, limit: float, dtype: torch.dtype):
        g, u = g.contiguous(), u.contiguous()
        w = w.float().contiguous() if w is not None else None
        m, i = g.shape
        h = new_output(g.shape, g, dtype)
        if m and i:
            bi = min(triton.next_power_of_2(i), TILE)
            br = _tile_rows(bi)
            _swiglu_fwd[(triton.cdiv(m, br), triton.cdiv(i, bi))](g, u, w if w is not None else g, h, m, i, limit,
                                                                   HAS_W=w is not None, BR=br, BI=bi)
        ctx.save_for_backward(g, u, w)
        ctx.limit = limit
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u, w = ctx.saved_tensors
        m, i = g.shape
        dg, du = new_output(g.shape, g, g.dtype), new_output(u.shape, u, u.dtype)
        dw = new_output((m,), g, torch.float32) if w is not None else None
        if m and i:
            bi = min(triton.next_power_of_2(i), 1024 if not INTERPRET else 64)
            br = max(1, min(16, TILE // bi))
            _swiglu_bwd[(triton.cdiv(m, br),)](g, u, w if w is not None else g, dh.contiguous(), dg, du,
                                               dw if dw is not None else g, m, i, ctx.limit,
                                               HAS_W=w is not None, BR=br, BI=bi)
        elif dw is not None:
            dw.zero_()
        return dg, du, dw, None, None


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `ops.swiglu`: g, u [M, I]; weight [M] fp32 or None -> [M, I] in dtype."""
    if g.dim() != 2 or g.shape != u.shape:
        raise ValueError(f"swiglu kernel: expected g, u of one [M, I] shape, got {list(g.shape)}, {list(u.shape)}")
    return _SwiGLU.apply(g, u, weight, limit, dtype)


# --------------------------------------------------------------------------- fp32 as two bf16 terms
@triton.jit
def _split_bf16(G, OUT, R, N, BR: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (r < R)[:, None] & (c < N)[None, :]
    g = tl.load(G + r.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0).to(tl.float32)
    hi = g.to(tl.bfloat16, fp_downcast_rounding="rtne")  # as torch rounds
    lo = (g - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")  # g - hi: exact in fp32
    out = OUT + r.to(tl.int64)[:, None] * (2 * N) + c[None, :]
    tl.store(out, hi, mask=m)
    tl.store(out + N, lo, mask=m)


def split_bf16(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `ops.split_bf16`: g [R, N] -> [R, 2N] bf16, hi | lo, one pass (into
    `out`, contiguous, where given)."""
    if g.dim() != 2:
        raise ValueError(f"split_bf16 kernel: expected [R, N], got {list(g.shape)}")
    g = g.contiguous()
    r, n = g.shape
    if out is None:
        out = new_output((r, 2 * n), g, torch.bfloat16)
    elif out.shape != (r, 2 * n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"split_bf16 kernel: out {list(out.shape)} {out.dtype} for g {list(g.shape)}")
    if r and n:
        bn = min(triton.next_power_of_2(n), TILE)
        br = _tile_rows(bn)
        _split_bf16[(triton.cdiv(r, br), triton.cdiv(n, bn))](g, out, r, n, BR=br, BN=bn)
    return out
