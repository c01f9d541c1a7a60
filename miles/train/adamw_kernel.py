"""The Triton kernel of miles.train.adamw (importing it needs triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def adamw_kernel(blocks, hyper, scale_ptr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                 BF16_MOMENTS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """One program: ITERS x BLOCK elements of one tensor, BLOCK at a time. blocks [B, 9] int64,
    a row a program: its tensor's numel, the addresses of the fp32 weight, gradient, exp_avg,
    exp_avg_sq and step count, of the bf16 copy (0: none), the group, and the program's first
    element; hyper [G, 5] float64: lr, weight_decay, beta1, beta2, eps. BF16_MOMENTS: the
    moments are kept in bf16 (widened to fp32 when read, rounded to nearest even when kept)."""
    row = blocks + 9 * tl.program_id(0).to(tl.int64)
    n = tl.load(row)
    w_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    moment = tl.uint16 if BF16_MOMENTS else tl.float32  # bf16 moments by their bits
    m_ptr = tl.load(row + 3).to(tl.pointer_type(moment))
    v_ptr = tl.load(row + 4).to(tl.pointer_type(moment))
    step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32))).to(tl.float64)
    out = tl.load(row + 6)
    h = hyper + 5 * tl.load(row + 7)
    start = tl.load(row + 8)
    lr = tl.load(h)
    lr_wd = lr * tl.load(h + 1)
    beta1 = tl.load(h + 2)
    beta2 = tl.load(h + 3)
    eps = tl.load(h + 4)
    # torch's per-tensor factors: computed in float64 (beta ** step as exp(step log beta), its
    # last bits aside: the fp32 rounding that follows absorbs them), used in fp32
    bias1 = (1.0 - tl.exp(step * tl.log(beta1))).to(tl.float32)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2))).to(tl.float32)  # float64: correctly rounded
    step_size = (lr / bias1.to(tl.float64)).to(tl.float32)
    inv_scale = 1.0 / tl.load(scale_ptr).to(tl.float64) if HAS_SCALE else 1.0  # the clip's factor

    o_ptr = out.to(tl.pointer_type(tl.uint16))  # the bf16 copy's bits (unused where out is 0)
    if ALIGNED:  # every address 16-byte aligned (the host checked): vector loads and stores
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        o_ptr = tl.multiple_of(o_ptr, 16)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        if ALIGNED:
            offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if BF16_MOMENTS:
            m = _bf16_value(tl.load(m_ptr + offs, mask=mask, other=0))
            v = _bf16_value(tl.load(v_ptr + offs, mask=mask, other=0))
        else:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        # the clip, the decay and the moments in float64, rounded to fp32
        if HAS_SCALE:  # the clipped gradient rounded to fp32 (torch's grad_scale stores it so)
            g = (g.to(tl.float64) * inv_scale).to(tl.float32)
        if lr_wd != 0.0:  # decoupled decay
            w = (w.to(tl.float64) - lr_wd * w.to(tl.float64)).to(tl.float32)
        g64 = g.to(tl.float64)
        m = (beta1 * m.to(tl.float64) + (1.0 - beta1) * g64).to(tl.float32)
        v = (beta2 * v.to(tl.float64) + (1.0 - beta2) * g64 * g64).to(tl.float32)
        denom = (tl.div_rn(tl.sqrt_rn(v), bias2_sqrt).to(tl.float64) + eps).to(tl.float32)  # torch adds eps in float64
        w = w - tl.div_rn(step_size * m, denom)
        tl.store(w_ptr + offs, w, mask=mask)
        if BF16_MOMENTS:
            tl.store(m_ptr + offs, _bf16_bits(m), mask=mask)
            tl.store(v_ptr + offs, _bf16_bits(v), mask=mask)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
        if out != 0:  # the bf16 weight, rounded to nearest even as torch's copy_ rounds it
            tl.store(o_ptr + offs, _bf16_bits(w), mask=mask)


@triton.jit
def _bf16_value(bits):
    """bf16 bits (uint16) -> their value in fp32 (exact: the high half of its bits)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits, rounded to nearest even (NaN stays NaN). Written out because
    Triton 3.6's interpreter does not round `.to(tl.bfloat16)` to nearest even (it truncates,
    and its fp_downcast_rounding="rtne" adds the first dropped bit); on the GPU it is the
    cast's own rounding."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
