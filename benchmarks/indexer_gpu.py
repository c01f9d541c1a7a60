"""The lightning indexer's scores on one GPU: sum_h w relu(q_h . k_g) in fp32 at the ~1B
config's CSA shape (4096 tokens, 16 heads of 128, 1024 compressed entries; V4-Flash's 64 heads
by --heads 64), forward and backward, the PyTorch path (`ops.indexer_scores`: chunked fp32 bmm's,
relu, head sum) against the Triton kernel's tiles and dot precisions
(`kernels.indexer.indexer_scores`: Triton's tf32x3, the operands split by hand, bf16 dots with
the fp32 operand in three pieces, ieee). q is bf16 as the model passes it (--fp32-q: fp32).
Each row checks its results against float64 (largest relative error of the scores and of the
q, k, w gradients). dq and dk of any fp32-accurate dots that are not IEEE fp32 land 1e-5 to
1e-3 from float64's: a dot within rounding of 0 flips its relu gate and adds or drops a whole
term (tests/test_kernels.py checks them through the kernel's own gate). One row bounds the
entries causally (hi = (t + 1) // ratio, as the model passes `SequenceLayout.entry_bound`):
the tiles past the bound skipped.

    python3 benchmarks/indexer_gpu.py [--seq 4096] [--entries 1024] [--heads 16] [--fp32-q] [--quick]
    python3 benchmarks/indexer_gpu.py --mass   # the indexer's target (attention_mass) at V4-Flash's
                                               # attention: 64 heads of 512
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.deepseek_v4 import ops  # noqa: E402
from plugins.deepseek_v4.kernels import indexer  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure(scores, ins, cot, refs) -> tuple[float, float, list[float]]:
    from triton.testing import do_bench

    xs = [t.detach().requires_grad_() for t in ins]
    out = scores(*xs)
    grads = torch.autograd.grad(out, xs, cot, retain_graph=True)
    errs = [rel(t, r) for t, r in zip((out, *grads), refs, strict=True)]
    with torch.no_grad():
        fwd = do_bench(lambda: scores(*ins), return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(out, xs, cot, retain_graph=True), return_mode="median")
    return fwd * 1e3, bwd * 1e3, errs


def mass_table(seq: int, entries: int) -> None:
    """attention_mass at V4-Flash's attention shape (64 heads of 512, bf16 q and entries, the
    core's lse over every entry, ~half the causally visible entries chosen): the kernel's time
    and its relative error against float64."""
    from triton.testing import do_bench

    heads, dim = 64, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, dim, generator=g).bfloat16().cuda()
    e = torch.randn(1, entries, dim, generator=g).bfloat16().cuda()
    scale = dim ** -0.5
    logit = torch.einsum("bshd,bgd->bshg", q.double(), e.double()) * scale  # [1, S, H, G]
    lse = torch.logsumexp(logit, -1).view(seq, heads)  # as the core's: every entry counted
    ratio = max(1, seq // max(1, entries))
    hi = ((torch.arange(seq) + 1) // ratio).clamp(max=entries).cuda()
    chosen = (torch.rand(1, seq, entries, generator=g).cuda() < 0.5) & (torch.arange(entries).cuda() < hi[:, None])
    want = (torch.exp(logit - lse.view(1, seq, heads, 1)).sum(2) * chosen).cpu()
    del logit
    print(f"\n{torch.cuda.get_device_name()}  attention_mass: {seq} tokens, {heads} heads of {dim}, {entries} "
          "entries, bf16; us (median); relative error vs float64")
    lse32 = lse.float()  # the core's dtype
    got = indexer.attention_mass(q, e, lse32, chosen, scale)
    us = do_bench(lambda: indexer.attention_mass(q, e, lse32, chosen, scale), return_mode="median")
    print(f"kernel {us * 1e3:9.1f}   {rel(got.cpu(), want):.1e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--entries", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="the default tiles only (each precision)")
    ap.add_argument("--fp32-q", action="store_true", help="q in fp32 (the model's is bf16)")
    ap.add_argument("--mass", action="store_true", help="attention_mass's kernel instead")
    a = ap.parse_args()
    if a.mass:
        mass_table(a.seq, a.entries)
        return
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.seq, a.heads, a.dim, generator=g)
    q = q if a.fp32_q else q.bfloat16()
    k = torch.randn(1, a.entries, a.dim, generator=g)
    w = torch.randn(1, a.seq, a.heads, generator=g) * a.heads ** -0.5
    cot = torch.randn(1, a.seq, a.entries, generator=g).cuda()
    ratio = max(1, a.seq // max(1, a.entries))
    hi = ((torch.arange(a.seq) + 1) // ratio).clamp(max=a.entries)[None].int().cuda()  # causal bound [1, S]
    seen = torch.arange(a.entries).cuda() < hi[..., None]
    ins64 = [t.double().cuda().requires_grad_() for t in (q, k, w)]
    ref = torch.einsum("bsh,bshg->bsg", ins64[2], torch.relu(torch.einsum("bshd,bgd->bshg", ins64[0], ins64[1])))
    refs = [ref.detach(), *torch.autograd.grad(ref, ins64, cot.double(), retain_graph=True)]
    causal_refs = [ref.detach() * seen, *torch.autograd.grad(ref, ins64, cot.double() * seen)]
    del ref, ins64
    ins = [t.cuda() for t in (q, k, w)]
    print(f"\n{torch.cuda.get_device_name()}  indexer scores: {a.seq} tokens, {a.heads} heads of {a.dim}, "
          f"{a.entries} entries, q {q.dtype}; us (median); relative error vs float64: scores / dq / dk / dw")
    print(f"{'variant':48s} {'fwd':>8s} {'bwd':>8s}   errors")
    fwd0, bwd0, errs = measure(ops.indexer_scores, ins, cot, refs)
    print(f"{'torch: chunked fp32 bmm + relu + head sum':48s} {fwd0:8.1f} {bwd0:8.1f}   "
          + " / ".join(f"{e:.1e}" for e in errs))
    keep = ({k: dict(v) for k, v in indexer.SCORE_TILES.items()}, indexer.SCORE_PREC)
    fwd, bwd, errs = measure(lambda *x: indexer.indexer_scores(*x, hi), ins, cot, causal_refs)
    print(f"{'kernel defaults, causal bound (tiles past it skipped)':48s} {fwd:8.1f} {bwd:8.1f}   "
          + " / ".join(f"{e:.1e}" for e in errs) + f"   {(fwd0 + bwd0) / (fwd + bwd):.2f}x")
    precs = ["split3", "tf32x3"] if a.fp32_q else ["bf16x3", "split3", "tf32x3"]  # bf16x3 is split3 for fp32 q
    rows = [("defaults", prec, keep[0]) for prec in precs]  # (name, precision, tiles): the default tiles first
    if not a.quick:  # every tile for both passes (the forward ignores split), the first two precisions
        rows += [(f"BT {bt} BG {bg} split {sp} warps {wa}", prec,
                  {"fwd": dict(BT=bt, BG=bg, warps=wa), "bwd": dict(BT=bt, BG=bg, SPLIT=sp, warps=wa)})
                 for prec, bt, bg, sp, wa in itertools.product(precs[:2], [32, 64], [32, 64, 128],
                                                               [8, 16], [4, 8])]
        rows.append(("defaults", "ieee", keep[0]))  # for scale
    try:
        for tiles, prec, cfg in rows:
            indexer.SCORE_PREC, indexer.SCORE_TILES = prec, cfg
            try:
                fwd, bwd, errs = measure(indexer.indexer_scores, ins, cot, refs)
            except Exception as e:  # a tile past the shared memory of this GPU
                print(f"kernel {prec} {tiles}: {type(e).__name__}")
                continue
            name = f"kernel {prec:6s} {tiles}"
            print(f"{name:48s} {fwd:8.1f} {bwd:8.1f}   " + " / ".join(f"{e:.1e}" for e in errs)
                  + f"   {(fwd0 + bwd0) / (fwd + bwd):.2f}x")
    finally:
        indexer.SCORE_TILES, indexer.SCORE_PREC = keep


if __name__ == "__main__":
    main()
