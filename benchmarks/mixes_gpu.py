"""mHC's gate inputs on one GPU: mm = flat(X) @ fn^T and nrm = |flat(X)| of the flat streams
[R, n d] (train_gpu's ~1B shape: R = 4096, n d = 6144, bf16; m = 24 for hc_pre, 4 for
hc_head), forward and backward, torch's path (a TF32 projection of an fp32 copy and torch's
norm, as the model ran before `mhc.stream_mixes`) against the kernel's dot precisions and
tiles (and the stream-sum gradient's loads gathered per element, as before `_in_stream`). The
kernels are timed alone, replayed in a CUDA graph (no host time), the backward as
`pre_streams` runs it (it also adds the stream sum's and hc_post's gradients of the streams);
torch's row includes its autograd call's host time. Each row also checks its results against
float64 (largest relative error of mm, nrm, the streams' gradient and fn's).

    python3 benchmarks/mixes_gpu.py [--rows 4096] [--width 6144] [--quick | --prefetch | --dx]
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

N_STREAMS = 4


def torch_mixes(x: torch.Tensor, fn: torch.Tensor):
    return ops.fp32_linear(x, fn, True), torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(fn_mixes, x, fn, cots, refs) -> list[float]:
    xs, fns = x.detach().requires_grad_(), fn.detach().requires_grad_()
    out = fn_mixes(xs, fns)
    grads = torch.autograd.grad(out, (xs, fns), cots)
    return [rel(t, r) for t, r in zip((*out, *grads), refs, strict=True)]


def torch_times(x, fn, cots) -> tuple[float, float]:
    from triton.testing import do_bench

    xs, fns = x.detach().requires_grad_(), fn.detach().requires_grad_()
    out = torch_mixes(xs, fns)
    with torch.no_grad():
        fwd = do_bench(lambda: torch_mixes(x, fn), return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(out, (xs, fns), cots, retain_graph=True), return_mode="median")
    return fwd * 1e3, bwd * 1e3


def kernel_times(x, fn, cots, extra) -> tuple[float, float]:
    """The forward and the backward (with pre_streams' extra inputs) alone, in CUDA graphs."""
    from triton.testing import do_bench_cudagraph

    _, _, kept = mhc._mixes_forward(x, fn)
    fwd = do_bench_cudagraph(lambda: mhc._mixes_forward(x, fn), return_mode="median")
    bwd = do_bench_cudagraph(lambda: mhc._mixes_backward(kept, *cots, fn.dtype, **extra), return_mode="median")
    return fwd * 1e3, bwd * 1e3


def backward_rows(rows, x, fn, cots, refs, extra, keep) -> None:
    """Each (name, MIX_BWD tile) of `rows`: the backward's time alone and its errors; the
    default tile marked."""
    try:
        for name, tile in rows:
            mhc.MIX_BWD = tile
            errs = errors(mhc.stream_mixes, x, fn, cots, refs)
            _, bwd = kernel_times(x, fn, cots, extra)
            print(f"{name:80s} {'':7s} {bwd:7.1f}   " + " / ".join(f"{e:.1e}" for e in errs)
                  + ("   (default)" if tile == keep[2] else ""))
    finally:
        mhc.MIX_BWD = keep[2]


def prefetch_rows(x, fn, cots, refs, extra, keep) -> None:
    """The backward with and without the next row step's loads issued before its work."""
    rows = [(f"bwd BS {bs} BK {bk} groups {gr} w{wp} s{st}" + (" prefetch" if pf else ""),
             dict(BS=bs, BK=bk, GROUPS=gr, warps=wp, stages=st, prefetch=pf, dx_pieces=True))
            for bs, bk, gr, wp, st in [(64, 64, 8, 4, 2), (64, 64, 8, 4, 1), (32, 64, 8, 4, 1), (32, 64, 8, 4, 2),
                                       (32, 64, 16, 4, 1), (32, 64, 4, 4, 1), (32, 128, 8, 4, 1), (32, 64, 8, 2, 1),
                                       (16, 64, 8, 4, 1), (64, 64, 16, 4, 1)]
            for pf in (False, True)]
    backward_rows(rows, x, fn, cots, refs, extra, keep)


def dx_rows(x, fn, cots, refs, extra, keep) -> None:
    """The backward's dx dot as tf32x3 on the tile before (32-row steps, 64 columns) against
    the bf16 pieces of dmm and fn (`dx_pieces`) over tiles."""
    rows = [("dx tf32x3, BS 32 BK 64 groups 8 w4 prefetch (before)",
             dict(BS=32, BK=64, GROUPS=8, warps=4, stages=1, prefetch=True, dx_pieces=False))]
    rows += [(f"dx pieces, BS {bs} BK {bk} groups {gr} w{wp} prefetch",
              dict(BS=bs, BK=bk, GROUPS=gr, warps=wp, stages=1, prefetch=True, dx_pieces=True))
             for bs, bk, gr, wp in [(32, 64, 8, 4), (16, 128, 8, 4), (16, 128, 4, 4), (16, 128, 16, 4),
                                    (16, 256, 8, 4), (16, 128, 8, 2), (32, 128, 8, 4), (64, 64, 8, 4), (16, 64, 8, 2)]]
    backward_rows(rows, x, fn, cots, refs, extra, keep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=6144)
    ap.add_argument("--quick", action="store_true", help="the defaults and the old tf32x3 tiles only")
    ap.add_argument("--prefetch", action="store_true",
                    help="only the backward's tiles with the next row step's loads issued early and not")
    ap.add_argument("--dx", action="store_true",
                    help="only the backward's dx dot: tf32x3 on the tile before vs bf16 pieces over tiles")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    old = ("tf32x3", dict(BS=16, BK=64, SPLIT=1, warps=4), dict(BS=16, BK=64, GROUPS=8, warps=4))
    keep = (mhc.MIX_PREC, dict(mhc.MIX_FWD), dict(mhc.MIX_BWD))
    for m in (24, 4):
        x = torch.randn(a.rows, a.width, generator=g).bfloat16()
        fn = torch.randn(m, a.width, generator=g) * a.width ** -0.5
        cots = (torch.randn(a.rows, m, generator=g), torch.randn(a.rows, generator=g))
        x64, fn64 = x.double().requires_grad_(), fn.double().requires_grad_()
        out64 = (x64 @ fn64.T, x64.norm(dim=-1))
        grads64 = torch.autograd.grad(out64, (x64, fn64), [c.double() for c in cots])
        refs = [t.detach().cuda() for t in (*out64, *grads64)]
        x, fn, cots = x.cuda(), fn.cuda(), tuple(c.cuda() for c in cots)
        d = a.width // N_STREAMS
        extra = dict(w=torch.rand(a.rows, N_STREAMS, device="cuda"),
                     du=torch.randn(a.rows, d, device="cuda").bfloat16(),
                     dxp=torch.randn(a.rows, a.width, device="cuda").bfloat16())
        print(f"\n{torch.cuda.get_device_name()}  streams [{a.rows}, {a.width}] bf16, m = {m}; us (median); "
              f"relative error vs float64: mm / nrm / dx / dfn")
        print(f"{'variant':80s} {'fwd':>7s} {'bwd':>7s}   errors")
        if a.prefetch:
            prefetch_rows(x, fn, cots, refs, extra, keep)
            continue
        if a.dx:
            dx_rows(x, fn, cots, refs, extra, keep)
            continue
        fwd0, bwd0 = torch_times(x, fn, cots)
        errs = errors(torch_mixes, x, fn, cots, refs)
        print(f"{'torch: TF32 projection + vector_norm (with host time)':80s} {fwd0:7.1f} {bwd0:7.1f}   "
              + " / ".join(f"{e:.1e}" for e in errs))
        rows = [(*old, True), (*keep, True), (*keep, False)]  # last: gathered stream-sum loads or not
        if not a.quick and m == 24:  # the sweep at hc_pre's width; hc_head's m = 4 on the defaults
            fwds = [dict(BS=bs, BK=bk, SPLIT=sp, warps=wp) for bs, bk, sp, wp in
                    itertools.product([64, 128], [64, 128], [4, 8], [4, 8])]
            bwds = [dict(BS=bs, BK=bk, GROUPS=gr, warps=wp, stages=st, dx_pieces=True) for bs, bk, gr, wp, st in
                    itertools.product([32, 64, 128], [64, 128], [8, 16], [4, 8], [1, 2, 3])]
            rows += [("bf16x3", f, keep[2], False) for f in fwds] + [("bf16x3", keep[1], b, False) for b in bwds]
        base, best_f, best_b, in_stream = None, None, None, mhc._in_stream
        try:
            for prec, ft, bt, gather in rows:
                mhc.MIX_PREC, mhc.MIX_FWD, mhc.MIX_BWD = prec, ft, bt
                mhc._in_stream = (lambda d, bk: False) if gather else in_stream
                errs = errors(mhc.stream_mixes, x, fn, cots, refs)
                fwd, bwd = kernel_times(x, fn, cots, extra)
                base = base or (fwd, bwd)
                name = (f"{prec} fwd BS {ft['BS']} BK {ft['BK']} split {ft['SPLIT']} w{ft['warps']}; "
                        f"bwd BS {bt['BS']} BK {bt['BK']} groups {bt['GROUPS']} w{bt['warps']} "
                        f"s{bt.get('stages', 3)}" + (" gathered" if gather else ""))
                print(f"{name:80s} {fwd:7.1f} {bwd:7.1f}   " + " / ".join(f"{e:.1e}" for e in errs)
                      + f"   {(base[0] + base[1]) / (fwd + bwd):.2f}x")
                if max(errs[0], errs[1], errs[3]) < 1e-5 and errs[2] < 2.0 ** -8:  # dx is bf16
                    best_f = min(best_f or (fwd, name), (fwd, name))
                    best_b = min(best_b or (bwd, name), (bwd, name))
        finally:
            mhc.MIX_PREC, mhc.MIX_FWD, mhc.MIX_BWD = keep
            mhc._in_stream = in_stream
        print(f"fastest forward: {best_f[1]} ({best_f[0]:.1f} us); backward: {best_b[1]} ({best_b[0]:.1f} us); "
              f"the old tf32x3 tiles {base[0]:.1f} / {base[1]:.1f}")


if __name__ == "__main__":
    main()
