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
def _rms_bwd(X, W, G, RSTD, DX, DWP, R, D, HAS_W: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr,
             X_IS_XH: tl.constexpr = False):
    """dx = rstd * (g*w - xh * mean(g*w*xh)), xh = x * rstd (X_IS_XH: X holds xh, the
    weightless norm's output); each program also sums g * xh over its row tiles into one row
    of the weight-gradient partials DWP [programs, D]."""
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
        xh = x if X_IS_XH else x * rstd[:, None]
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


def rms_backward_from_output(y: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The weightless RMSNorm's input gradient from its output y (= x rstd) instead of x:
    dx = rstd (g - y mean(g y)), in y.dtype."""
    d = y.shape[-1]
    r = rstd.numel()
    dp = triton.next_power_of_2(max(d, 1))
    br = _tile_rows(dp)
    dx = new_output(y.shape, y, y.dtype)
    if r:
        progs = _programs(triton.cdiv(r, br), y.device)
        _rms_bwd[(progs,)](y.contiguous(), y, g.contiguous(), rstd, dx, rstd, r, d, HAS_W=False, BR=br, DP=dp,
                           X_IS_XH=True)
    return dx


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
@triton.jit
def _rope(X, COS, SIN, Y, R, H, D, HALF, sign, BR: tl.constexpr, DP: tl.constexpr):
    """Rows r of X [R, D]; row r takes cos/sin row r // H. The last 2*HALF columns rotate in
    interleaved pairs (even column a, odd column b: a*c - b*s, a*s + b*c, s = sign*sin);
    the others are copied. One tile load of the row and one of the pair partners (column ^ 1)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, DP)
    start = D - 2 * HALF  # even: pairs are (even, odd) columns
    rot = (c >= start) & (c < D)
    m = (r < R)[:, None] & (c < D)[None, :]
    mr = m & rot[None, :]
    row = r.to(tl.int64)[:, None] * D
    x = tl.load(X + row + c[None, :], mask=m, other=0.0).to(tl.float32)
    partner = tl.load(X + row + (c ^ 1)[None, :], mask=mr, other=0.0).to(tl.float32)
    j = tl.where(rot, (c - start) // 2, 0)
    crow = (r // H).to(tl.int64)[:, None] * HALF + j[None, :]
    cs = tl.load(COS + crow, mask=mr, other=1.0)
    sn = tl.load(SIN + crow, mask=mr, other=0.0) * sign
    even = (c % 2 == 0)[None, :]
    out = tl.where(rot[None, :], tl.where(even, x * cs - partner * sn, partner * sn + x * cs), x)
    tl.store(Y + row + c[None, :], out.to(Y.dtype.element_ty), mask=m)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, sign: float) -> torch.Tensor:
    d, half = x.shape[-1], cos.shape[-1]
    r = x.numel() // d if d else 0
    y = new_output(x.shape, x, x.dtype)
    if r:
        dp = triton.next_power_of_2(d)
        br = _tile_rows(dp)
        _rope[(triton.cdiv(r, br),)](x, cos, sin, y, r, heads, d, half, sign, BR=br, DP=dp)
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Same contract as `ops.apply_rope` (x [..., D]; cos, sin [..., rd/2] fp32 broadcast
    against x[..., :rd/2]), for cos/sin that vary over leading dims of x only (tokens) and
    broadcast over the trailing ones (heads). cos and sin carry no gradient."""
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

    return _Rope.apply(x, table(cos), table(sin), heads, -1.0 if inverse else 1.0)


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
