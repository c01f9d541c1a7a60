"""mHC's gate inputs on one GPU: mm = flat(X) @ fn^T and nrm = |flat(X)| of the flat streams
[R, n d] (train_gpu's ~1B shape: R = 4096, n d = 6144, bf16; m = 24 for hc_pre, 4 for
hc_head), forward and backward, torch's path (a TF32 projection of an fp32 copy and
torch's norm, as the model ran before `mhc.stream_mixes`) against the kernel's tiles and dot
precisions. Each row also checks its results against float64 (largest relative error of mm,
nrm, the streams' gradient and fn's).

    python3 benchmarks/mixes_gpu.py [--rows 4096] [--width 6144] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.deepseek_v4 import ops  # noqa: E402
from plugins.deepseek_v4.kernels import mhc  # noqa: E402


def torch_mixes(x: torch.Tensor, fn: torch.Tensor):
    return ops.fp32_linear(x, fn, True), torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure(fn_mixes, x, fn, cots, refs) -> tuple[float, float, list[float]]:
    from triton.testing import do_bench

    xs, fns = x.detach().requires_grad_(), fn.detach().requires_grad_()
    out = fn_mixes(xs, fns)
    grads = torch.autograd.grad(out, (xs, fns), cots, retain_graph=True)
    errs = [rel(t, r) for t, r in zip((*out, *grads), refs, strict=True)]
    with torch.no_grad():
        fwd = do_bench(lambda: fn_mixes(x, fn), return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(out, (xs, fns), cots, retain_graph=True), return_mode="median")
    return fwd * 1e3, bwd * 1e3, errs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=6144)
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for m in (24, 4):
        x = torch.randn(a.rows, a.width, generator=g).bfloat16()
        fn = torch.randn(m, a.width, generator=g) * a.width ** -0.5
        cots = (torch.randn(a.rows, m, generator=g), torch.randn(a.rows, generator=g))
        x64, fn64 = x.double().requires_grad_(), fn.double().requires_grad_()
        out64 = (x64 @ fn64.T, x64.norm(dim=-1))
        grads64 = torch.autograd.grad(out64, (x64, fn64), [c.double() for c in cots])
        refs = [t.detach().cuda() for t in (*out64, *grads64)]
        x, fn, cots = x.cuda(), fn.cuda(), tuple(c.cuda() for c in cots)
        print(f"\n{torch.cuda.get_device_name()}  streams [{a.rows}, {a.width}] bf16, m = {m}; us (median); "
              f"relative error vs float64: mm / nrm / dx / dfn")
        print(f"{'variant':58s} {'fwd':>7s} {'bwd':>7s}   errors")
        fwd0, bwd0, errs = measure(torch_mixes, x, fn, cots, refs)
        print(f"{'torch: TF32 projection + vector_norm':58s} {fwd0:7.1f} {bwd0:7.1f}   "
              + " / ".join(f"{e:.1e}" for e in errs))
        keep = (dict(mhc.MIX_FWD), dict(mhc.MIX_BWD), mhc.MIX_PREC)
        grid = (itertools.product(["ieee", "tf32x3"], [16, 64], [64, 128], [1, 4], [16, 32], [64, 128], [8, 32])
                if not a.quick else [("ieee", 16, 64, 1, 16, 64, 8), ("tf32x3", 64, 128, 4, 32, 128, 32)])
        best = None
        try:
            for prec, fbs, fbk, split, bbs, bbk, groups in grid:
                if not a.quick and (fbs, fbk, split) != (16, 64, 1) and (bbs, bbk, groups) != (16, 64, 8):
                    continue  # vary the forward's tile or the backward's, not both at once
                mhc.MIX_PREC = prec
                mhc.MIX_FWD = dict(BS=fbs, BK=fbk, SPLIT=split, warps=4)
                mhc.MIX_BWD = dict(BS=bbs, BK=bbk, GROUPS=groups, warps=4)
                fwd, bwd, errs = measure(mhc.stream_mixes, x, fn, cots, refs)
                name = f"kernel {prec:6s} fwd BS {fbs} BK {fbk} split {split}; bwd BS {bbs} BK {bbk} groups {groups}"
                print(f"{name:58s} {fwd:7.1f} {bwd:7.1f}   " + " / ".join(f"{e:.1e}" for e in errs)
                      + f"   {(fwd0 + bwd0) / (fwd + bwd):.2f}x")
                if max(errs) < 1e-2 and (best is None or fwd + bwd < best[0]):
                    best = (fwd + bwd, name)
        finally:
            mhc.MIX_FWD, mhc.MIX_BWD, mhc.MIX_PREC = keep
        if best:
            print(f"fastest: {best[1]} ({best[0]:.1f} us fwd + bwd, torch {fwd0 + bwd0:.1f})")


if __name__ == "__main__":
    main()
