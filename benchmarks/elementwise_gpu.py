"""The fused elementwise kernels at the ~1B trainer's shapes, each against the bytes it must
move: GPU microseconds a call (back-to-back calls of the launchers, tables built outside the
timing) and the bandwidth that makes.

    PYTHONPATH=. python3 benchmarks/elementwise_gpu.py [--tokens 4096]

Rows: RoPE of q [t, 16, 512] (the output path's rotation) and at V4-Flash's widths (the
indexer's q [t, 64, 128], the output o [t, 64, 512], into a copy and in place), q's weightless norm with RoPE
forward and backward (`ops.norm_rope`: one kernel each way) against the norm and the rotation
as two kernels each way, and the LM head's log-softmax pieces on a [2048, 32768] fp32 chunk
(`kernels.cross_entropy`) against torch's log_softmax and in-place softmax gradient.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from plugins.deepseek_v4 import ops
from plugins.deepseek_v4.kernels import cross_entropy as ce
from plugins.deepseek_v4.kernels import elementwise as ew


def timed_us(fn, iters: int) -> float:
    """GPU time of one call: `iters` calls back to back between two events, 5 times, the
    median (the calls are launches of kernels longer than their host time)."""
    for _ in range(3):  # autotuning, lazy allocations
        fn()
    ts = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(ts)


def flash_ropes(t: int, cos: torch.Tensor, sin: torch.Tensor, g: torch.Generator) -> list:
    """RoPE at V4-Flash's widths (64 rotated columns): the indexer's q [t, 64, 128] into a copy,
    the attention output o [t, 64, 512] into a copy (its unrope) and in place (its gradient)."""
    rows = []
    for h, d in ((64, 128), (64, 512)):
        x = torch.randn(1, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
        nb = x.numel() * x.element_size()
        cos_t, sin_t, heads = ew.rope_tables(x, cos, sin)
        rows.append((f"RoPE [t, {h}, {d}] into a copy", lambda x=x, c=cos_t, s=sin_t, n=heads:
                     ew._rope_launch(x, c, s, n, 1.0), 2 * nb))
        rows.append((f"RoPE [t, {h}, {d}] in place", lambda x=x, c=cos_t, s=sin_t, n=heads:
                     ew._rope_launch(x, c, s, n, 1.0, out=x), 2 * nb * 64 // d))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dev, t = "cuda", a.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, t, 16, 512, device=dev, generator=g).to(torch.bfloat16)
    dq = torch.randn(1, t, 16, 512, device=dev, generator=g).to(torch.bfloat16)
    ang = torch.rand(1, t, 1, 32, device=dev, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    qb = q.numel() * q.element_size()
    out, rstd, cos_t, sin_t, heads = ew.norm_rope_forward(q, cos, sin, 1e-6)

    def two_kernels_fwd():
        ew._rope_launch(ew.rms_forward(q, None, 1e-6)[0], cos_t, sin_t, heads, 1.0)

    def two_kernels_bwd_setup():
        x = q.detach().requires_grad_()
        y = ew.apply_rope(ew.rms_norm(x, None, 1e-6), cos, sin)
        return lambda: torch.autograd.grad(y, x, dq, retain_graph=True)

    rows = [("RoPE [t, 16, 512]", lambda: ew._rope_launch(q, cos_t, sin_t, heads, 1.0), 2 * qb),
            *flash_ropes(t, cos, sin, g),
            ("norm+RoPE forward, one kernel", lambda: ew.norm_rope_forward(q, cos, sin, 1e-6), 2 * qb),
            ("norm then RoPE forward, two kernels", two_kernels_fwd, 2 * qb),
            ("norm+RoPE backward, one kernel",
             lambda: ew.norm_rope_backward(out, dq, rstd, cos_t, sin_t, heads), 3 * qb),
            ("norm then RoPE backward, two kernels", two_kernels_bwd_setup(), 3 * qb)]
    z = torch.randn(2048, 32768, device=dev, generator=g) * 3
    ids = torch.randint(0, 32768, (2048,), device=dev, generator=g)
    gr = torch.randn(2048, device=dev, generator=g)
    lse = torch.logsumexp(z, -1)
    zb = z.numel() * 4

    def torch_grad():
        w = z.clone()
        w.sub_(w.amax(-1, keepdim=True)).exp_()
        w.mul_(-gr[:, None] / w.sum(-1, keepdim=True))
        w.scatter_add_(-1, ids[:, None], gr[:, None])

    def kernel_grad():
        w = z.clone()
        ce.softmax_grad_(w, lse, ids, gr, gr)

    rows += [("clone of the head chunk (reference)", lambda: z.clone(), 2 * zb),
             ("head chunk log-probs, torch cross-entropy", lambda: F.cross_entropy(z, ids, reduction="none"), zb),
             ("head chunk row stats, kernel", lambda: ce.row_stats(z, ids), zb),
             ("clone + head chunk gradient, torch (4 passes)", torch_grad, 2 * zb),
             ("clone + head chunk gradient, kernel (in place)", kernel_grad, 2 * zb)]
    assert torch.isfinite(ops.norm_rope(q, cos, sin, 1e-6, fused=True).float()).all()
    print(f"{torch.cuda.get_device_name()}  {t} tokens, median of {a.iters}; GB/s from the bytes each must move"
          f" (the clone rows: the clone's own bytes not counted)")
    print(f"{'kernel':50s} {'us':>8s} {'GB/s':>8s}")
    for name, fn, nbytes in rows:
        us = timed_us(fn, a.iters)
        print(f"{name:50s} {us:8.1f} {nbytes / us / 1e3:8.0f}")


if __name__ == "__main__":
    main()
