"""DeepSeek-V4's numerical building blocks as pure functions (the PyTorch reference).

Each function returns a new tensor in its input's dtype (never writes into an input),
does its sensitive math in fp32 as DSV4.md prescribes, and is tested against float64
gradcheck. These are the CPU path and the oracle for GPU kernels.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .config import YarnScaling
from .layout import sort_key_dtype


# --------------------------------------------------------------------------- norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, fused: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in fp32; `weight=None` is the weightless variant. fused:
    the Triton kernel (one launch each way)."""
    if fused:
        from .kernels.elementwise import rms_norm as kernel

        return kernel(x, weight, eps)
    xf = x.float()
    y = xf * _rstd(xf, eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last dim of fp32 x, [..., 1]."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class _NormRope(torch.autograd.Function):
    """apply_rope(rms_norm(x, None, eps), cos, sin): the attention's q. Keeps its output (the
    attention core keeps that tensor anyway) and rstd [rows], not the norm's input: the
    backward rotates the output back to the norm's output y and takes dx = rstd (dy - y
    mean(dy y)) from it (one [B, S, H, D] tensor less a layer until the backward). fused: one
    kernel each way, the rotations in its registers."""

    @staticmethod
    def forward(ctx, x, cos, sin, eps: float, fused: bool):
        ctx.fused = fused
        if fused:
            from .kernels.elementwise import norm_rope_forward

            out, rstd, cos_t, sin_t, ctx.heads = norm_rope_forward(x, cos, sin, eps)
            ctx.save_for_backward(out, rstd, cos_t, sin_t)
            return out
        xf = x.float()
        rstd = _rstd(xf, eps)  # [..., 1]: rms_norm's own
        out = apply_rope((xf * rstd).to(x.dtype), cos, sin)
        ctx.save_for_backward(out, rstd.reshape(-1), cos, sin)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out, rstd, cos, sin = ctx.saved_tensors
        if ctx.fused:
            from .kernels.elementwise import norm_rope_backward

            return norm_rope_backward(out, g, rstd, cos, sin, ctx.heads), None, None, None, None
        # the rotation is orthogonal: y is the output rotated back, dy the gradient rotated back
        yf = apply_rope(out.float(), cos, sin, inverse=True)
        gf = apply_rope(g, cos, sin, inverse=True).float()
        dx = rstd.reshape(yf.shape[:-1])[..., None] * (gf - yf * (gf * yf).mean(-1, keepdim=True))
        return dx.to(out.dtype), None, None, None, None


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, fused: bool = False) -> torch.Tensor:
    """The weightless RMSNorm of x [..., D] then RoPE of its last dims (cos/sin as apply_rope
    takes them), keeping only the output and rstd for the backward."""
    return _NormRope.apply(x, cos, sin, eps, fused)


# --------------------------------------------------------------------------- fp32 products
@contextmanager
def _cuda_matmul_precision(tf32: bool):
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    m.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        m.fp32_precision = old


class _Fp32Linear(torch.autograd.Function):
    """fp32 x @ w^T from inputs of any dtype. Saves the inputs as given (a bf16 model keeps
    its bf16 activations, not fp32 copies) and casts again in the backward. `tf32`: the
    fp32 products on tensor cores (CUDA): with bf16 x and w as bf16 products forward
    (bf16_products) and backward (split_products), else on TF32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, tf32: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.tf32, ctx.weight = tf32, w  # the parameter itself (the note above main_grad_written)
        z = bf16_products(x, w) if tf32 else None
        if z is not None:
            return z
        with _cuda_matmul_precision(tf32):
            return F.linear(x.float(), w.float())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        split = split_products(g, x, w, ctx.needs_input_grad[:2]) if ctx.tf32 else None
        if split is not None:
            gx, gw = split
        else:
            gx = gw = None
            with _cuda_matmul_precision(ctx.tf32):
                if ctx.needs_input_grad[0]:
                    gx = (g @ w.float()).to(x.dtype)  # [..., K]
                if ctx.needs_input_grad[1]:
                    gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()  # [N, K] fp32
        return gx, None if gw is None else _into_main_grad(ctx.weight, gw), None


def bf16_on_cuda(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x and w are bf16 CUDA tensors: the fp32 projections' products then run exact
    on bf16 tensor cores (bf16_products, split_products, the heads' parallel.head_split)."""
    return x.is_cuda and x.dtype == w.dtype == torch.bfloat16


def bf16_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] @ w [N, K]^T -> fp32 [..., N] on bf16 tensor cores when both are bf16 CUDA
    tensors, else None. A product of two bf16 numbers is exact in fp32 and the GEMM sums in
    fp32, so this is the TF32 path's result (its operands are exact in TF32 too) at twice
    the tensor-core rate. Callers look it up on this module at call time (the A/B swaps it)."""
    if not bf16_on_cuda(x, w):
        return None
    return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])


def bf16_terms(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x (fp32) as n bf16 terms, each the nearest bf16 of what the earlier ones left (8
    significant bits a term; three hold all of fp32's 24 but where a term is subnormal)."""
    terms, rest = [], x.float()
    for _ in range(n):
        terms.append(rest.to(torch.bfloat16))
        rest = rest - terms[-1].float()
    return terms


def split_bf16(g: torch.Tensor, fused: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """g [R, N] fp32 -> [R, 2N] bf16: hi | lo with hi = bf16(g) and lo = bf16(g - hi), g to
    16 significant bits (2^-17 relative) as the sum of two bf16 numbers (into `out` where
    given). fused: one kernel."""
    if fused:
        from .kernels.elementwise import split_bf16 as kernel

        return kernel(g, out)
    return torch.cat(bf16_terms(g, 2), -1, out=out)


def split_products(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   needs: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The backward of the fp32 projection x [..., K] @ w [N, K]^T for bf16 CUDA x and w on
    bf16 tensor cores, else None: the fp32 gradient g [..., N] as two bf16 terms (split_bf16)
    makes every product exact in fp32 and the GEMMs sum in fp32, so the gradients are those
    of g to 2^-17, where TF32 rounds g to 2^-11 and needs fp32 copies of x and w (a cast of
    x each way). (dx [..., K] in x's dtype, rounded once by its GEMM; dw [N, K] in fp32.)
    Callers look it up on this module at call time (the A/B swaps it)."""
    if not bf16_on_cuda(x, w):
        return None
    n, k = w.shape
    g2 = split_bf16(g.reshape(-1, n).float(), fused=True)  # [T, 2N]
    gx = gw = None
    if needs[0]:
        gx = torch.mm(g2, torch.cat((w, w))).view(*g.shape[:-1], k)  # [T, 2N] @ [2N, K]
    if needs[1]:
        p = torch.mm(g2.t(), x.reshape(-1, k), out_dtype=torch.float32)  # [2N, K]: hi's and lo's
        gw = p[:n] + p[n:]
    return gx, gw


def main_grad_of(w: torch.Tensor) -> torch.Tensor | None:
    """w's `main_grad` (Megatron DDP's fp32 gradient buffer: the trainer) where it has a
    contiguous one, else None: ops that take it add their weight gradient there themselves
    and return none (DDP's hook has nothing to add for them)."""
    main = getattr(w, "main_grad", None)
    return main if main is not None and main.is_contiguous() else None


# Where an op looks for main_grad: on the weight its forward was given, kept as `ctx.weight`.
# The tensors saved for the backward are not that parameter under recompute (torch's
# non-reentrant checkpoint hands back a detached copy, with no main_grad and nothing to
# announce): looked up there, the gradient would go back through DDP's hook in bf16.


def main_grad_written(w: torch.Tensor) -> None:
    """Tell the trainer's DDP that w's gradient of this backward is in w.main_grad, from the op
    that put it there and returns none (miles/train/ddp.py: the overlapped reduction counts w
    ready, on this thread); nothing where w has no `main_grad_ready`."""
    ready = getattr(w, "main_grad_ready", None)
    if ready is not None:
        ready()


@lru_cache(maxsize=1)
def _addmm_takes_fp32_addend() -> bool:
    """Whether this torch's CUDA addmm adds bf16 products into an fp32 tensor in place
    (`out_dtype`, cuBLAS's beta = 1 on an fp32 C; older versions want the addend in the
    inputs' dtype)."""
    a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
    c = torch.ones(16, 16, dtype=torch.float32, device="cuda")
    try:
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError):
        return False
    return bool((c == 17).all())  # added into, not overwritten


def accumulate_wgrad(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """main [N, K] += dy [T, N]^T @ x [T, K], summed in main's dtype (fp32). bf16 dy and x on
    CUDA: one GEMM whose epilogue adds into main (no [N, K] gradient in bf16, so no rounding
    of it before the sum and no second pass); the same products through an fp32 temporary
    where this torch cannot add into an fp32 addend."""
    if dy.dtype == x.dtype == main.dtype:
        main.addmm_(dy.t(), x)
    elif (dy.is_cuda and main.dtype == torch.float32 and dy.dtype == x.dtype
          and dy.dtype in (torch.bfloat16, torch.float16)):
        if _addmm_takes_fp32_addend():
            torch.addmm(main, dy.t(), x, out_dtype=main.dtype, out=main)
        else:
            main.add_(torch.mm(dy.t(), x, out_dtype=main.dtype))
    else:
        main.addmm_(dy.t().to(main.dtype), x.to(main.dtype))


def projection_main_grad(w: torch.Tensor) -> torch.Tensor | None:
    """main_grad_of(w) for the projections' backwards (linear, fp32_linear, unrope_out_proj):
    where w has one they add their weight gradient into it, summed in fp32 (the micro-batches'
    gradients are not each rounded to bf16 first, and DDP's hook has no add to do). Callers
    look it up on this module at call time (the A/B swaps it)."""
    return main_grad_of(w)


def _into_main_grad(w: torch.Tensor, gw: torch.Tensor) -> torch.Tensor | None:
    """A custom backward's weight gradient gw (fp32, w's shape): added into w.main_grad where w
    has one (None returned, w announced), else gw in w's dtype."""
    main = projection_main_grad(w)
    if main is None:
        return gw.to(w.dtype)
    main.add_(gw.view_as(main))
    main_grad_written(w)
    return None


class _Linear(torch.autograd.Function):
    """x @ w^T whose weight gradient, where w has a `main_grad` (the trainer), is added into it
    by the GEMM (accumulate_wgrad) as Megatron's linears do theirs (gradient_accumulation_fusion),
    not returned in w's dtype for DDP's hook to add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.weight = w
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dy @ w  # [..., K]
        if ctx.needs_input_grad[1]:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # [T, N], [T, K]
            main = projection_main_grad(ctx.weight)
            if main is None:
                dw = dy2.t() @ x2
            else:
                accumulate_wgrad(main, dy2, x2)
                main_grad_written(ctx.weight)
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (x [..., K], w [N, K]) whose weight gradient goes into w.main_grad where
    there is one (_Linear); without autograd, F.linear itself."""
    if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
        return _Linear.apply(x, w)
    return F.linear(x, w)


def fp32_linear(x: torch.Tensor, w: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in fp32 (the projections DSV4.md keeps in fp32:
    compressor, gate, mHC mixes, LM/MTP heads). With bf16 x and w every product is exact
    in TF32 (8 mantissa bits fit in TF32's 10), so `tf32` changes only the rounding of fp32
    operands (an fp32 weight, the backward's fp32 gradient) and the summation order; such a
    forward runs as a bf16 GEMM with fp32 output (`bf16_products`: the same exact products)."""
    if x.dtype == w.dtype == torch.float32 and not tf32:
        return F.linear(x, w)
    return _Fp32Linear.apply(x, w, tf32)


# --------------------------------------------------------------------------- embedding
ADD_ROWS_PIECE = 32  # rows of one id summed together before its pieces are (add_rows)


def add_rows(main: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """main[ids[t]] += rows[t] for ids [T], rows [T, d]: each id's rows summed in main's dtype
    in t order, then added once, so every run gives the same bits (atomic adds of the rows
    would not). Rows sorted by id (stable); an id's run summed in pieces of ADD_ROWS_PIECE rows,
    then its pieces in order (segment_reduce loops over a segment in one thread a column: a run
    of thousands of one id, padding or another TP rank's ids, would be one long loop); index_add_
    adds each run's sum and zeros for the other rows, which any order of adding leaves alike."""
    t, piece = ids.numel(), ADD_ROWS_PIECE
    if t == 0:
        return
    order_ids, order = torch.sort(ids, stable=True)  # [T]
    pos = torch.arange(t, device=ids.device)
    start = torch.searchsorted(order_ids, order_ids)  # [T] each row's run: [start, end)
    end = torch.searchsorted(order_ids, order_ids, right=True)
    opens = (pos - start) % piece == 0  # a piece begins here (a run's first row among them)
    lengths = torch.where(opens, (end - pos).clamp(max=piece), 0)
    pieces = torch.segment_reduce(rows[order].to(main.dtype), "sum", lengths=lengths, unsafe=True)  # [T, d]
    # the pieces' sums to the front in order, the other rows (zeros) behind them
    at = torch.sort((~opens).to(torch.int8), stable=True).indices  # [T]
    n_pieces = opens.sum()
    lengths = torch.where(pos < n_pieces, torch.where(start[at] == at, (end[at] - at + piece - 1) // piece, 0), 1)
    sums = torch.segment_reduce(pieces[at], "sum", lengths=lengths, unsafe=True)  # [T, d]: a run's sum at its first
    main.index_add_(0, order_ids[at], sums)


class _Embedding(torch.autograd.Function):
    """weight[ids] whose weight gradient, where the weight has a `main_grad` (the trainer), is
    added into it row by row (add_rows); torch's embedding backward builds a dense [V, d]
    gradient in the weight's dtype that DDP then adds into main_grad (V = 129,280: ~1.3 ms a
    call on an H200 for 4,096 rows, and the sum rounded to bf16 first)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ids, weight = ctx.saved_tensors
        main = main_grad_of(ctx.weight)
        if main is None:
            return None, torch.ops.aten.embedding_backward(g, ids, weight.shape[0], -1, False, False)
        add_rows(main, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
        main_grad_written(ctx.weight)
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids] ([...] -> [..., d]); its weight gradient goes into weight.main_grad where
    there is one (_Embedding), else as F.embedding's."""
    return _Embedding.apply(ids, weight)


# --------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2], fp32. YaRN only blends frequencies between the
    fast/slow correction dims (no mscale in V4); it is used on compressed layers only."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    if yarn is not None and yarn.factor > 1:
        def corr_dim(rotations: float) -> float:
            return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1 = high-frequency dims kept, 0 = interpolated by `factor`
        inv = inv / yarn.factor * (1 - keep) + inv * keep
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., rope_dim/2] in fp32."""
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               fused: bool = False) -> torch.Tensor:
    """Rotate the LAST 2*cos.shape[-1] dims of x in interleaved pairs (x[2i], x[2i+1]).

    x [..., D]; cos/sin broadcast against x[..., :rd/2] with the head dims inserted by the
    caller. `inverse` rotates by the negative angle (the conjugate), used on attention
    outputs because V carries rotated dims. Builds a new tensor (no in-place on views).
    fused: the Triton kernel (one launch each way).
    """
    if fused:
        from .kernels.elementwise import apply_rope as kernel

        return kernel(x, cos, sin, inverse)
    rd = 2 * cos.shape[-1]
    nope, rot = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd:]
    # Real pairs, not a complex multiply: that one saves its complex factor e^(i angle) for the
    # backward, a tensor per call that plan_memory's ledger (and the GPU's unfused path) would pay.
    pairs = rot.float().unflatten(-1, (rd // 2, 2))  # [..., rd/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    s = -sin if inverse else sin
    out = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                fused: bool = False) -> torch.Tensor:
    """apply_rope in place, for a tensor outside autograd (a gradient inside a backward, or
    _unroped's o.data): its rotated columns only, where apply_rope copies the whole of x. x
    contiguous."""
    if fused:
        from .kernels.elementwise import apply_rope_ as kernel

        return kernel(x, cos, sin, inverse)
    rd = 2 * cos.shape[-1]
    x[..., x.shape[-1] - rd:] = apply_rope(x[..., x.shape[-1] - rd:], cos, sin, inverse)
    return x


# --------------------------------------------------------------------------- KV quantization
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KV_QUANT_BLOCK = 64  # channels sharing one scale


def _kv_block(d: int) -> int:
    return KV_QUANT_BLOCK if d % KV_QUANT_BLOCK == 0 else d  # test models narrower than 64: one block


def fp8_kv_quant(x: torch.Tensor, rope_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-RoPE channels x[..., :d] as DeepSeek's runtime stores them: FP8 e4m3 codes
    [..., d] (uint8: indexing and where() take them on every device) and an fp32 scale per
    token and block of 64 channels [..., d / 64] (scale = the block's largest |x| / 448, so a
    token's bits never depend on the other tokens of a batch). A model whose non-RoPE width is
    no multiple of 64 (the test presets) scales its whole width at once."""
    d = x.shape[-1] - rope_dims
    block = _kv_block(d)
    nope = x[..., :d].float().unflatten(-1, (d // block, block))  # [..., blocks, 64]
    scale = (nope.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [..., blocks]
    codes = (nope / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)  # [..., d]
    return codes, scale


def fp8_kv_dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_kv_quant's codes [..., d] and scales [..., d / block] -> the values [..., d] in `dtype`."""
    d = codes.shape[-1]
    q = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (scale.shape[-1], d // scale.shape[-1]))
    return (q * scale[..., None]).flatten(-2).to(dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded values exactly; backward: the gradient as if unrounded."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fp8_kv_fake_quant(x: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """KV-QAT: the non-RoPE channels rounded as DeepSeek's runtime stores them (fp8_kv_quant,
    then fp8_kv_dequant: what an FP8 cache gives back), the RoPE channels as they are.
    Straight-through: the gradient passes as if unrounded."""
    d = x.shape[-1] - rope_dims
    rounded = torch.cat((fp8_kv_dequant(*fp8_kv_quant(x, rope_dims), x.dtype), x[..., d:]), -1)
    return _StraightThrough.apply(x, rounded) if x.requires_grad and torch.is_grad_enabled() else rounded


# --------------------------------------------------------------------------- Hadamard
def _sylvester(n: int) -> torch.Tensor:
    """The unnormalised Sylvester-Hadamard matrix [n, n] of +-1, float64 on the CPU."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


# Both built once per device: a copy per call would make the host wait for the GPU (pageable
# host-to-device copies synchronise) and has no place in a CUDA graph.
@lru_cache(maxsize=16)
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """H / sqrt(n) [n, n] fp32 on `device`."""
    return (_sylvester(n) / math.sqrt(n)).to(device=device, dtype=torch.float32)


@lru_cache(maxsize=16)
def _hadamard_signs(n: int, device: torch.device) -> torch.Tensor:
    """H's +-1 entries [n, n] in bf16 (exact) on `device`: the fused rotation's operand."""
    return _sylvester(n).to(device=device, dtype=torch.bfloat16)


def hadamard(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard rotation of the last dim (a power of two), in fp32, the
    result in x's dtype. fused: bf16 x in one kernel (kernels.indexer.hadamard: the +-1 entries
    exact in a bf16 dot, its sums fp32, then the 1 / sqrt(n)); other dtypes take this path."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    if fused and x.dtype == torch.bfloat16 and 16 <= n <= 128:  # the indexer's 128 (H in registers)
        from .kernels.indexer import hadamard as kernel

        return kernel(x, _hadamard_signs(n, x.device))
    h = _hadamard_matrix(n, x.device)
    return (x.float() @ h).to(x.dtype)


# --------------------------------------------------------------------------- mHC
class _Sinkhorn(torch.autograd.Function):
    """The reference's own backward: each normalisation y = x / (sum(x) + eps) sends back
    dx = (dy - sum(dy * y)) / (sum(x) + eps), and the softmax dl = p * (dm - sum(dm * p)).
    Autograd's generic graph of the same loop is ~3x the operations: at toy widths it was a
    quarter of a CPU training step. Both ways run on [n(row), n(col), N] (the token axis
    innermost): a sum over a matrix axis is then n contiguous vectors added, ~8x faster on
    CPU than reducing [N, n, n]'s size-n inner axes."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        p = torch.softmax(_matrix_major(logits.float()), dim=1)  # [n, n, N]
        m, saved = p + eps, [p]
        for axis in _sinkhorn_axes(iters):
            den = m.sum(axis, keepdim=True) + eps
            m = m / den
            saved += [m, den]
        ctx.save_for_backward(*saved)
        ctx.iters, ctx.dtype, ctx.shape = iters, logits.dtype, logits.shape
        return _token_major(m, logits.shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        p, *saved = ctx.saved_tensors
        g = _matrix_major(g.float())
        for axis, y, den in reversed(list(zip(_sinkhorn_axes(ctx.iters), saved[::2], saved[1::2], strict=True))):
            g = (g - (g * y).sum(axis, keepdim=True)) / den
        return _token_major(p * (g - (g * p).sum(1, keepdim=True)), ctx.shape).to(ctx.dtype), None, None


def _matrix_major(x: torch.Tensor) -> torch.Tensor:
    """[..., n, n] -> [n, n, N] contiguous (N = the leading dims' product)."""
    n = x.shape[-1]
    return x.reshape(-1, n, n).permute(1, 2, 0).contiguous()


def _token_major(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[n, n, N] -> [..., n, n] contiguous."""
    return x.permute(2, 0, 1).reshape(shape).contiguous()


def _sinkhorn_axes(iters: int) -> list[int]:
    """The normalised axis of each step on [n(row), n(col), N]: columns (sum over rows, axis
    0), then (iters - 1) x (rows (axis 1), columns)."""
    return [0] + [1, 0] * (iters - 1)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> doubly stochastic: row softmax + eps, column normalisation, then
    (iters - 1) x (row, column) normalisations, each dividing by sum + eps. fp32."""
    return _Sinkhorn.apply(logits, iters, eps)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float, tf32: bool = False) -> torch.Tensor:
    """x [B, S, n, d] -> mixes [B, S, m] = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + eps), fp32."""
    flat = x.flatten(-2)  # [B, S, n*d]
    if flat.dtype in (torch.bfloat16, torch.float16):  # the squares summed in fp32, no fp32 copy of the streams
        ms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float32).square() / flat.shape[-1]
    else:
        ms = flat.float().pow(2).mean(-1, keepdim=True)
    return fp32_linear(flat, fn, tf32) * torch.rsqrt(ms + norm_eps)


def _hc_pre_kernels(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                    hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, post, comb, x through the node) from the kernels: the mixes' projection and the
    streams' norm from one pass, the gates, the stream sum, one autograd node
    (kernels.mhc.pre_streams). Callers look it up on this module at call time (the A/B swaps it)."""
    from .kernels.mhc import pre_streams

    return pre_streams(x, fn, base, scale, iters, hc_eps, norm_eps)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int, fused: bool = False, tf32: bool = False, gates: bool = False,
           streams: bool = False) -> tuple[torch.Tensor, ...]:
    """mHC before a sublayer. x [B, S, n, d]; fn [n(n+2), n*d]; base [n(n+2)]; scale [3].
    Returns u [B, S, d] (sublayer input, x.dtype), post [B, S, n], comb [B, S, n, n] (fp32).
    fused: the Triton Sinkhorn and stream sum (one launch each way) instead of this file's
    reference; gates (with fused): the mixes, gates and stream sum as kernels, one autograd node.
    streams: also return the streams for hc_post: with gates, x as the node's output, so
    hc_post's gradient of x is added in the node's backward pass (not by autograd in another)."""
    if fused and gates:
        out = _hc_pre_kernels(x, fn, base, scale, norm_eps, hc_eps, iters)
        return out if streams else out[:3]
    if fused:
        from .kernels.mhc import sinkhorn as sinkhorn_fn
        from .kernels.mhc import weighted_sum
    else:
        sinkhorn_fn = sinkhorn
    n = x.shape[-2]
    mix = hc_mixes(x, fn, norm_eps, tf32)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = sinkhorn_fn((mix[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)), iters, hc_eps)
    u = weighted_sum(pre, x) if fused else _stream_sum(pre, x)
    return (u, post, comb, x) if streams else (u, post, comb)


def _stream_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_i w[..., i] X_i: w [B, S, n] fp32, x [B, S, n, d] -> [B, S, d] in x.dtype. Broadcast
    and sum, not einsum: einsum makes it B*S batched [1, n] @ [n, d] products, ~2x slower on CPU."""
    return (w[..., None] * x.float()).sum(-2).to(x.dtype)


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            fused: bool = False) -> torch.Tensor:
    """X'_j = post_j * F(u) + sum_i comb[i, j] * X_i (comb TRANSPOSED onto the streams).
    f [B, S, d]; x [B, S, n, d] -> [B, S, n, d] in x.dtype. fused: the Triton kernel."""
    if fused:
        from .kernels.mhc import hc_post as kernel

        return kernel(f, x, post, comb)
    out = post[..., None] * f.float()[..., None, :] + torch.einsum("bsij,bsid->bsjd", comb, x.float())
    return out.to(x.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, fused: bool = False, tf32: bool = False, gates: bool = False) -> torch.Tensor:
    """Collapse the n streams for the LM head: y = sum_i sigmoid(mix_i * scale + base_i) + eps) X_i.
    fused / gates: as hc_pre's."""
    if fused and gates:
        return _hc_pre_kernels(x, fn, base, scale, norm_eps, hc_eps, 1)[0]
    pre = torch.sigmoid(hc_mixes(x, fn, norm_eps, tf32) * scale.float()[0] + base.float()) + hc_eps
    if fused:
        from .kernels.mhc import weighted_sum

        return weighted_sum(pre, x)
    return _stream_sum(pre, x)


# --------------------------------------------------------------------------- compressor
def compress_pool(c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Gated pooling of one compression window per entry: c, z [B, G, slots, D] (z = gate
    logits incl. the learned position bias; -inf marks an absent slot) -> [B, G, D] fp32,
    out = sum_j softmax_j(z)[j] * c[j] per channel."""
    return (torch.softmax(z.float(), dim=-2) * c.float()).sum(-2)


# --------------------------------------------------------------------------- attention
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                     scale: float, return_probs: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MQA with shared K = V and an attention sink, over an explicit key set.

    q [B, S, H, D]; kv [B, T, D]; mask [B, S, T] (True = query attends key); sink [H] fp32
    in scaled-logit space. o_h = sum_j e^{s_hj} kv_j / (sum_j e^{s_hj} + e^{sink_h}), with
    s = q.kv * scale in fp32. A row with no key gives zeros (the sink absorbs it), never NaN.
    Returns o [B, S, H, D] in q.dtype and, if asked, probs [B, H, S, T] (fp32).
    """
    b, s, h, _ = q.shape
    logits = torch.einsum("bshd,btd->bhst", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink_col = sink.float().view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("bhst,btd->bshd", probs, kv.float()).to(q.dtype)
    return o, (probs if return_probs else None)


INDEXER_CHUNK_ELEMENTS = 1 << 26  # per-head dot products [B, rows, h, G] held at once (256 MiB fp32)


class _IndexerScores(torch.autograd.Function):
    """sum_h w_h relu(q_h . k_g) over chunks of query rows, keeping no [B, S, h, G] tensor:
    the forward saves q, k, w only and the backward recomputes each chunk's dot products
    (at 64k tokens and 16 heads over G = 16k entries that tensor alone would be 64 GiB)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(q, k, w)
        ctx.rows = rows
        kf = k.float()
        out = []
        for i in range(0, q.shape[1], rows):
            dots = torch.einsum("bshd,bgd->bshg", q[:, i:i + rows].float(), kf)  # [B, c, h, G]
            out.append(torch.einsum("bshg,bsh->bsg", F.relu(dots), w[:, i:i + rows].float()))
        return torch.cat(out, 1) if out else q.new_zeros(q.shape[0], 0, k.shape[1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        q, k, w = ctx.saved_tensors
        kf = k.float()
        dq, dk, dw = [], torch.zeros_like(kf), []
        for i in range(0, q.shape[1], ctx.rows):
            qc, wc, gc = q[:, i:i + ctx.rows].float(), w[:, i:i + ctx.rows].float(), g[:, i:i + ctx.rows]
            dots = torch.einsum("bshd,bgd->bshg", qc, kf)  # [B, c, h, G]
            dw.append(torch.einsum("bsg,bshg->bsh", gc, F.relu(dots)))
            dd = torch.where(dots > 0, gc[:, :, None] * wc[..., None], 0.0)  # d score / d dots
            dq.append(torch.einsum("bshg,bgd->bshd", dd, kf))
            dk += torch.einsum("bshg,bshd->bgd", dd, qc)
        cat = (lambda ts, like: torch.cat(ts, 1).to(like.dtype) if ts else torch.zeros_like(like))
        return cat(dq, q), dk.to(k.dtype), cat(dw, w), None


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, hi: torch.Tensor | None = None,
                   chunk_elements: int = INDEXER_CHUNK_ELEMENTS, fused: bool = False) -> torch.Tensor:
    """Lightning-indexer scores in fp32: q [B, S, h, d], k [B, G, d], w [B, S, h] ->
    [B, S, G] = sum_h w[., h] * relu(q[., h] . k[g]), computed over chunks of query rows
    that hold at most `chunk_elements` dot products at a time. Entries g >= hi[b, t] (hi
    [B, S] int, a bound on each query's visible entries: `SequenceLayout.entry_bound`; None:
    all G) score 0 and pass no gradient (the kernels skip them). fused: the Triton kernels
    (no [S, h, G] dots in memory; fp32-accurate tensor-core dots; kernels/indexer.py)."""
    if fused:
        from .kernels.indexer import indexer_scores as kernel
        return kernel(q, k, w, hi)
    b, s, h, _ = q.shape
    rows = max(1, chunk_elements // max(1, b * h * k.shape[1]))
    out = _IndexerScores.apply(q, k, w, rows)
    if hi is None:
        return out
    return torch.where(torch.arange(k.shape[1], device=out.device) < hi[..., None].to(out.device), out, 0.0)


def topk_select(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k visible entries per query as a bool mask [B, S, G]. Ties go to the lower index
    (stable sort), so a full forward and token-by-token decoding select the same set."""
    masked = scores.masked_fill(~visible, float("-inf"))
    kk = min(k, scores.shape[-1])
    if kk == 0:
        return torch.zeros_like(visible)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    picked = torch.zeros_like(visible).scatter(-1, order, True)
    return picked & visible


# --------------------------------------------------------------------------- MoE
def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """Router scores sqrt(softplus(logits)) in fp32. The floor keeps the gradient finite
    where fp32 softplus underflows to 0 (logits below about -104: sqrt'(0) = inf)."""
    return torch.sqrt(F.softplus(logits.float()).clamp_min(1e-30))


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32 (V4 clamps routed AND shared experts)."""
    return F.silu(g.float().clamp(max=limit)) * u.float().clamp(-limit, limit)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None, dtype: torch.dtype,
           fused: bool = False) -> torch.Tensor:
    """An expert's hidden activation: clamped_swiglu(g, u) times the routing weight [M] (fp32,
    None for the shared expert), cast to `dtype` for the down projection. g, u [M, I].
    fused: the Triton kernel (one launch each way)."""
    if fused:
        from .kernels.elementwise import swiglu as kernel

        return kernel(g, u, limit, weight, dtype)
    h = clamped_swiglu(g, u, limit)
    return (h * weight[:, None].float() if weight is not None else h).to(dtype)


GROUP_ALIGN = 16  # rows per expert group are padded to this (grouped GEMM alignment)


def expert_rows(idx: torch.Tensor, first: int, n_local: int, all_local: bool, align: int = GROUP_ALIGN):
    """Lay the (token, slot) pairs routed to this rank's experts out as expert groups.

    idx [N, k] global expert ids; local experts are first..first+n_local-1. Each group's
    rows are padded to a multiple of GROUP_ALIGN (at least one block, so no group is
    empty) and the last group absorbs the spare rows, so the row count M is known without
    a device sync when `all_local`. Returns (pairs [P] flat pair ids (token * k + slot) in
    expert-then-token order, rows [P] their row in the grouped layout, offs [E] int32 group
    ends, counts [E] real rows per group, M = offs[-1] as a host int). `align` overrides GROUP_ALIGN (1:
    no padding, for the reference loop)."""
    flat = idx.flatten() - first  # [N*k]
    key = torch.where((flat >= 0) & (flat < n_local), flat, n_local)
    # stable: each group's pairs in token order; keys <= n_local in the narrowest integer type
    small = sort_key_dtype(n_local + 1)
    ordered, pairs = torch.sort(key.to(small), stable=True)
    # group sizes from the sorted keys (bincount would make the host wait for the GPU)
    counts = torch.searchsorted(ordered, torch.arange(n_local + 2, device=idx.device, dtype=small)).diff()
    n_pairs = pairs.numel() if all_local else int(counts[:n_local].sum())  # EP: one sync
    pairs = pairs[:n_pairs]
    counts = counts[:n_local]
    padded = (counts.clamp_min(1) + align - 1) // align * align
    pad_start = padded.cumsum(0) - padded
    cnt_start = counts.cumsum(0) - counts
    e_of = key[pairs]
    rows = pad_start[e_of] + torch.arange(n_pairs, device=idx.device) - cnt_start[e_of]
    m = n_pairs + align * n_local  # >= the padded total; spare rows stay zero
    offs = padded.cumsum(0)
    offs[-1].fill_(m)  # a fill kernel; item assignment would copy the int from the host and wait
    return pairs, rows, offs.to(torch.int32), counts, m


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm of a [M, K] and w [G, N, K]^T whose weight gradient, where w has a
    `main_grad` (Megatron DDP's buffer: the trainer), is added into it by the GEMM
    (kernels.moe.add_grouped_wgrad) instead of returned for a second pass to add; elsewhere
    the grouped GEMM torch's own backward runs. Any backward through it that needs w's
    gradient adds into main_grad (an autograd.grad call asking for other inputs only, too:
    needs_input_grad is fixed by the forward) and announces w to the trainer's DDP
    (main_grad_written)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, w, offs)
        ctx.weight = w
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, w, offs = ctx.saved_tensors
        da = torch._grouped_mm(dy, w, offs=offs) if ctx.needs_input_grad[0] else None  # [M, N] by [G, N, K] -> [M, K]
        return da, _grouped_wgrad(dy, a, offs, ctx.weight) if ctx.needs_input_grad[1] else None, None


def _grouped_wgrad(dy: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The grouped GEMM's weight gradient [G, N, K] of dy [M, N] and a [M, K]: added into
    w.main_grad where w has one (None returned), else returned."""
    if wgrad_into_main_grad(dy, a, offs, w):
        return None
    return torch._grouped_mm(dy.t(), a, offs=offs)  # [N, M] by [M, K] -> [G, N, K]


class _ExpertsIn(torch.autograd.Function):
    """The routed experts' way in as one node, on the kernels: x [N, d]'s rows in expert groups
    (xg = x[token_of_row] [M, d]), then both up-projections, g = xg w1^T and u = xg w3^T [M, I].
    Its backward sums the two GEMMs' input gradients inside the gather's backward (sum_rows of
    both, fp32 per slot), where as three nodes autograd first added them into a third [M, d]
    tensor (1.6 ms of flash_slice's two micro-batches, eager). Weight gradients as _GroupedMM's."""

    @staticmethod
    def forward(ctx, x, w1, w3, token_of_row, row_of_pair, offs, k: int):
        from .kernels.moe import gather_rows

        xg = gather_rows(x, token_of_row, x.dtype)  # [M, d]
        ctx.save_for_backward(xg, w1, w3, offs, row_of_pair)
        ctx.k, ctx.weights = k, (w1, w3)
        return torch._grouped_mm(xg, w1.transpose(-2, -1), offs=offs), torch._grouped_mm(xg, w3.transpose(-2, -1),
                                                                                          offs=offs)

    @staticmethod
    def backward(ctx, dg: torch.Tensor, du: torch.Tensor):
        from .kernels.moe import sum_rows

        xg, w1, w3, offs, row_of_pair = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:  # [M, I] by [G, I, d] -> [M, d], each token's rows of both summed
            dx = sum_rows(torch._grouped_mm(dg, w1, offs=offs), row_of_pair, ctx.k, xg.dtype,
                          also=torch._grouped_mm(du, w3, offs=offs))
        dw1 = _grouped_wgrad(dg, xg, offs, ctx.weights[0]) if ctx.needs_input_grad[1] else None
        dw3 = _grouped_wgrad(du, xg, offs, ctx.weights[1]) if ctx.needs_input_grad[2] else None
        return dx, dw1, dw3, None, None, None, None


def experts_in(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, token_of_row: torch.Tensor,
               row_of_pair: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor, k: int, fused: bool,
               fused_elementwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d]'s rows in expert groups times w1 and w3 [E, I, d]: (g, u) [M, I]. On the kernels
    (fused GEMMs and row moves) one node (_ExpertsIn); otherwise the gather and two
    grouped_matmul. Callers look it up here at call time (the A/B swaps it)."""
    if fused and fused_elementwise:
        return _ExpertsIn.apply(x, w1, w3, token_of_row, row_of_pair, offs, k)
    return experts_in_nodes(x, w1, w3, token_of_row, row_of_pair, offs, counts, k, fused, fused_elementwise)


def experts_in_nodes(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, token_of_row: torch.Tensor,
                     row_of_pair: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor, k: int, fused: bool,
                     fused_elementwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """experts_in as three autograd nodes: the gather, then two grouped_matmul (autograd adds
    their [M, d] input gradients)."""
    xg = _Dispatch.apply(x, token_of_row, row_of_pair, k, fused_elementwise)  # [M, d]
    return grouped_matmul(xg, w1, offs, counts, fused), grouped_matmul(xg, w3, offs, counts, fused)


def wgrad_into_main_grad(dy: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> bool:
    """Add the grouped GEMM's weight gradient into w.main_grad where w has a contiguous one
    (True), else nothing (False). Callers look it up on this module at call time (the A/B)."""
    main = main_grad_of(w)
    if main is None:
        return False
    from .kernels.moe import add_grouped_wgrad

    add_grouped_wgrad(dy, a, offs, main)
    main_grad_written(w)
    return True


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor,
                   fused: bool) -> torch.Tensor:
    """Rows of group g of a [M, K] times w[g]^T (w [G, N, K], Linear layout) -> [M, N].
    fused: one grouped GEMM (torch._grouped_mm; CUDA, bf16) whose weight gradient goes into
    w.main_grad where w has one; otherwise a loop over the groups' real rows (the reference;
    padding rows give zeros either way)."""
    if fused:
        return _GroupedMM.apply(a, w, offs)
    pieces, start = [], 0
    for g, (end, n) in enumerate(zip(offs.tolist(), counts.tolist(), strict=True)):
        pieces += [F.linear(a[start:start + n], w[g]), a.new_zeros(end - start - n, w.shape[1])]
        start = end
    return torch.cat(pieces)


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, first: int, limit: float, all_local: bool = True,
                   fused: bool = False, fused_elementwise: bool = False) -> torch.Tensor:
    """The routed experts of one MoE layer, all groups at once.

    x [N, d]; idx [N, k] global expert ids; weight [N, k] fp32 routing weights; w1, w3
    [E, I, d] and w2 [E, d, I] the stacked weights of local experts first..first+E-1.
    Returns [N, d] fp32: for each token, the sum over its slots routed here of
    w2 (weight * clamped_swiglu(w1 x, w3 x)) (the weight scales before w2, in fp32).
    fused: the grouped GEMMs; fused_elementwise: the SwiGLU and the row moves as kernels."""
    n, k = idx.shape
    align = GROUP_ALIGN if fused else 1
    one_kernel = fused and fused_elementwise and all_local and not (torch.is_grad_enabled() and weight.requires_grad)
    if one_kernel:  # decoding: the layout and its row maps in one kernel, where its one program holds them
        from .kernels.moe import expert_layout, layout_fits

        one_kernel = layout_fits(n * k, w1.shape[0])
    if one_kernel:
        offs, counts, m, _, token_of_row, row_of_pair, wg = expert_layout(idx, weight, first, w1.shape[0], align)
    else:
        pairs, rows, offs, counts, m = expert_rows(idx, first, w1.shape[0], all_local, align)
        pair_of_row = torch.full((m,), -1, dtype=torch.long, device=idx.device).index_copy_(0, rows, pairs)  # [M]
        row_of_pair = torch.full((n * k,), -1, dtype=torch.long, device=idx.device).index_copy_(0, pairs, rows)
        token_of_row = torch.where(pair_of_row >= 0, pair_of_row // k, -1)  # [M], -1: a padding row
        wg = take_rows(weight.flatten().float(), pair_of_row)  # [M]
    g, u = experts_in(x, w1, w3, token_of_row, row_of_pair, offs, counts, k, fused, fused_elementwise)  # [M, I]
    h = swiglu(g, u, limit, wg, x.dtype, fused_elementwise)  # [M, I]
    y = grouped_matmul(h, w2, offs, counts, fused)  # [M, d]
    return _Combine.apply(y, row_of_pair, token_of_row, k, fused_elementwise)  # [N, d] fp32; n may be 0 (EP)


class _AddCast(torch.autograd.Function):
    """(a + b) in the promoted dtype, stored in `dtype`: one pass where add-then-cast takes two.
    Backward: the gradient cast to each input's dtype (none where it already is one)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype):
        ctx.dtypes = (a.dtype, b.dtype)
        return torch.add(a, b, out=torch.empty(a.shape, dtype=dtype, device=a.device))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.dtypes[0]), g.to(ctx.dtypes[1]), None


def add_cast(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(a + b).to(dtype), bit for bit each way (same shapes: no broadcast's gradient sum),
    in one pass: the MoE's fp32 routed sum plus the shared expert's output, back to the streams'
    dtype. Callers look it up here at call time (the A/B swaps it)."""
    if a.shape != b.shape:
        raise ValueError(f"add_cast: shapes {list(a.shape)} and {list(b.shape)} differ")
    return _AddCast.apply(a, b, dtype)


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, ...] -> x[idx] [M, ...], a zero row where idx is -1."""
    pad = torch.cat((x, x.new_zeros(1, *x.shape[1:])))
    return pad.index_select(0, torch.where(idx >= 0, idx, x.shape[0]))


def _sum_slots(y: torch.Tensor, row_of_pair: torch.Tensor, k: int, dtype: torch.dtype, fused: bool) -> torch.Tensor:
    """[N, d] in dtype: token t's fp32 sum of y's rows of its k slots (row_of_pair [N*k], -1: none)."""
    if fused:
        from .kernels.moe import sum_rows

        return sum_rows(y, row_of_pair, k, dtype)
    n, d = row_of_pair.numel() // k, y.shape[1]
    return take_rows(y, row_of_pair).view(n, k, d).sum(1, dtype=torch.float32).to(dtype)


def _rows_of(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype, fused: bool) -> torch.Tensor:
    """take_rows(x, idx) in dtype."""
    if fused:
        from .kernels.moe import gather_rows

        return gather_rows(x, idx, dtype)
    return take_rows(x, idx).to(dtype)


class _Dispatch(torch.autograd.Function):
    """Tokens -> grouped rows: out[r] = x[token_of_row[r]]. Backward: each token's gradient is
    the fp32 sum of its k rows' (row_of_pair: the row of pair token * k + slot, -1 if none).
    Keeps the two int maps only (an index_copy kept its [P, d] source for the backward).
    fused: kernels.moe, one pass each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_row: torch.Tensor, row_of_pair: torch.Tensor, k: int, fused: bool):
        ctx.save_for_backward(row_of_pair)
        ctx.k, ctx.fused = k, fused
        return _rows_of(x, token_of_row, x.dtype, fused)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (row_of_pair,) = ctx.saved_tensors
        return _sum_slots(g, row_of_pair, ctx.k, g.dtype, ctx.fused), None, None, None, None


class _Combine(torch.autograd.Function):
    """Grouped rows -> tokens: out[t] = sum over its k slots of y[row_of_pair[t * k + slot]]
    (fp32, in slot order). Backward: each row gets its token's gradient (token_of_row).
    fused: kernels.moe, one pass each way."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, row_of_pair: torch.Tensor, token_of_row: torch.Tensor, k: int, fused: bool):
        ctx.save_for_backward(token_of_row)
        ctx.dtype, ctx.fused = y.dtype, fused
        return _sum_slots(y, row_of_pair, k, torch.float32, fused)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (token_of_row,) = ctx.saved_tensors
        return _rows_of(g, token_of_row, ctx.dtype, ctx.fused), None, None, None, None


def grouped_out_proj(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection, first stage. o [B, S, H, D] -> [B, S, G*R]:
    o viewed [B, S, G, H*D/G], group g multiplied by rows g*R..(g+1)*R of wo_a [G*R, H*D/G]."""
    og, w = _grouped(o, wo_a, groups)
    return torch.einsum("bsgk,grk->bsgr", og, w).flatten(-2)


def _grouped(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, S, H, D] as [B, S, G, H*D/G] and wo_a [G*R, H*D/G] as [G, R, H*D/G] in o's dtype."""
    og = o.reshape(*o.shape[:2], groups, -1)
    return og, wo_a.view(groups, -1, og.shape[-1]).to(og.dtype)


def _group_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [T, G, K] @ b [G, K, N] per group -> [T, G, N]: one bmm over the group-major views
    of a and of the output (strided matrices, no permuted copies; einsum copies both: ~2.4 ms
    of the ~1B step on an H100). No autograd (out=): for the custom functions' own passes."""
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[-1])
    torch.bmm(a.transpose(0, 1), b, out=out.transpose(0, 1))
    return out


@contextmanager
def _unroped(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool):
    """o [B, S, H, D] as apply_rope(o, inverse=True) for the block: its RoPE columns rotated in
    place, then put back bit for bit from their copy (a rotation in bf16 is not undone by the
    opposite one): its rd columns (V4: 64 of 512) read once and written twice (rotated, and
    copied out in the same pass), then put back: 5/8 of o's bytes once, where a rotated copy
    read all of o and wrote all of it. Through o.data, whose version counter is its own: the
    attention core keeps o for its backward and finds it as it was. o not contiguous (the
    in-place kernel takes contiguous rows): a rotated copy."""
    if not o.is_contiguous():
        yield apply_rope(o, cos, sin, inverse=True, fused=fused)
        return
    od = o.data
    if fused:  # the copy from the rotation's own pass, put back by a kernel (torch's strided copy of the
        # columns and back took 44 us each at V4's [4096, 64, 64] on an H200)
        from .kernels.elementwise import put_rotated_, rope_kept_

        kept = rope_kept_(od, cos, sin, inverse=True)  # [B, S, H, rd]
        put_back = lambda: put_rotated_(od, kept)  # noqa: E731
    else:
        rot = od[..., od.shape[-1] - 2 * cos.shape[-1]:]  # [B, S, H, rd]
        kept = rot.clone()
        apply_rope_(od, cos, sin, inverse=True)
        put_back = lambda: rot.copy_(kept)  # noqa: E731
    try:
        yield od
    finally:
        put_back()


class _UnropeOutProj(torch.autograd.Function):
    """apply_rope(o, inverse) then grouped_out_proj, keeping o itself for the backward (the
    attention core keeps it anyway) instead of its rotated copy; both passes rotate o's RoPE
    columns in place for their GEMMs and put them back (_unroped)."""

    @staticmethod
    def forward(ctx, o, wo_a, cos, sin, groups: int, fused: bool):
        ctx.save_for_backward(o, wo_a, cos, sin)
        ctx.groups, ctx.fused, ctx.weight = groups, fused, wo_a
        with _unroped(o, cos, sin, fused) as unroped:
            og, w = _grouped(unroped, wo_a, groups)  # [B, S, G, K]
            y = _group_mm(og.flatten(0, 1), w.transpose(1, 2))  # [B*S, G, R]
        return y.reshape(*o.shape[:2], -1)  # a view of the strided bmm's output

    @staticmethod
    @once_differentiable  # the backward's GEMMs take o.data: no graph of their own
    def backward(ctx, dy: torch.Tensor):
        o, wo_a, cos, sin = ctx.saved_tensors
        main = projection_main_grad(ctx.weight)
        with _unroped(o, cos, sin, ctx.fused) as unroped:
            og, w = _grouped(unroped, wo_a, ctx.groups)
            og = og.flatten(0, 1)  # [T, G, K]
            dyg = dy.reshape(og.shape[0], ctx.groups, -1)  # [T, G, R]
            if main is None:
                dw = torch.bmm(dyg.permute(1, 2, 0), og.transpose(0, 1))  # [G, R, T] @ [G, T, K], strided views
                dw = dw.reshape(wo_a.shape).to(wo_a.dtype)
            else:  # each group's [R, K] block of main_grad += dy_g^T og_g, summed in fp32 by its GEMM
                for g, block in enumerate(main.view(ctx.groups, -1, og.shape[-1])):
                    accumulate_wgrad(block, dyg[:, g], og[:, g])
                main_grad_written(ctx.weight)
                dw = None
        do = _group_mm(dyg, w).reshape(o.shape)  # a fresh tensor: rotated in place
        # the inverse rotation's adjoint is the forward rotation
        return apply_rope_(do, cos, sin, fused=ctx.fused), dw, None, None, None, None


def unrope_out_proj(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int,
                    fused: bool = False) -> torch.Tensor:
    """grouped_out_proj(apply_rope(o, cos, sin, inverse=True), wo_a, groups), the attention
    output's way out: o [B, S, H, D] -> [B, S, G*R]. Keeps o, not the rotated copy (one
    [B, S, H, D] tensor less a layer until the backward, for one more rotation in it)."""
    return _UnropeOutProj.apply(o, wo_a, cos, sin, groups, fused)


# --------------------------------------------------------------------------- index-set form
def mask_to_index(mask: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Key mask [..., T] -> the attended key indices [..., K] in ascending order (-1 = empty
    slot). K = k, a bound on every row's set known to the caller (no wait for the GPU), else
    the largest set (read from the GPU). The j-th index is where the mask's running count
    first reaches j + 1: a search over the count, no sort (a decode step ran a radix sort a
    layer for this)."""
    t = mask.shape[-1]
    k = min(t, int(mask.sum(-1).max().item()) if mask.numel() else 0) if k is None else min(k, t)
    count = mask.cumsum(-1)  # [..., T] int64, non-decreasing
    want = torch.arange(1, k + 1, device=mask.device).expand(*mask.shape[:-1], k).contiguous()  # [..., K]
    at = torch.searchsorted(count, want)  # [..., K]: T where the row has fewer than j + 1 keys
    return torch.where(at < t, at, -1)


def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                             scale: float, return_probs: bool = False):
    """Gather reference of the sparse attention core in index-set form (the kernels' oracle).

    q [T, H, D]; kv [N, D] key pool; idx [T, K] int (-1 = empty); sink [H] fp32.
    Returns o [T, H, D] in q.dtype and lse [T, H] fp32 (log of the softmax denominator,
    sink included), and with return_probs the probabilities [T, H, K] fp32. Memory
    O(T*K*D): the model's path off the GPU kernels, and the kernels' oracle.
    """
    valid = idx >= 0
    # index_select, not kv[idx]: its backward is index_add_ (~4x faster on CPU than the
    # accumulating index_put that advanced indexing sends back; on CUDA it is atomic, and
    # deterministic under torch.use_deterministic_algorithms as the job's deterministic mode sets)
    keys = kv.float().index_select(0, idx.clamp_min(0).long().flatten()).view(*idx.shape, kv.shape[-1])  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat((s, sink.float()[None, :, None].expand(s.shape[0], -1, 1)), -1)
    lse = torch.logsumexp(logits, -1)  # [T, H]
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("thk,tkd->thd", p, keys).to(q.dtype)
    return (o, lse, p) if return_probs else (o, lse)
