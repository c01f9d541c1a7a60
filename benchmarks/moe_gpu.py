"""The routed experts' grouped GEMMs on one GPU at the ~1B config's shape (4096 tokens, top-4
of 32 experts, d 1536, I 768; rows per expert padded to ops.GROUP_ALIGN), each against the
bf16 tensor-core rate: forward and input gradient (torch._grouped_mm), w1 and w3 as one GEMM
of a [E, 2I, d] stack (what a fused checkpoint layout would buy), and the weight gradient
into the fp32 main_grad: the Triton kernel (`kernels.moe.add_grouped_wgrad`) by pointer tiles
(autotuned) and by TMA descriptors (each tile config forced, with 32-, 64- and 128-row steps, then
autotuned), against torch's grouped GEMM plus an add.
Each weight-gradient row prints its error against float64 (norm of the difference over the norm).

    python3 benchmarks/moe_gpu.py [--tokens 4096] [--experts 32] [--topk 4] [--peak-tflops 989]
    python3 benchmarks/moe_gpu.py --tokens 4096 --experts 8 --topk 6 --hidden 4096 --inter 2048  # flash_slice
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.deepseek_v4 import ops  # noqa: E402
from plugins.deepseek_v4.kernels import moe  # noqa: E402

# TMA tiles forced: (BN, BK, warps, stages) at each row step. Rows of one BM sum in the same
# order; another BM rounds otherwise.
TMA_TILES = [(128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3),
             (128, 64, 4, 4), (256, 128, 8, 4)]
TMA_ROWS = (32, 64, 128)


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def routing(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Offsets [E] (int32, each group's end row) of a random top-k routing, rows padded as the model pads."""
    idx = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk].cuda()
    *_, offs, _, m = ops.expert_rows(idx, 0, experts, True, ops.GROUP_ALIGN)
    return offs, m


def forced(config, dy, a, offs, d) -> None:
    """add_grouped_wgrad by TMA with the autotuner held to one config."""
    kern = moe._grouped_wgrad_tma
    saved = kern.configs, dict(kern.cache)
    kern.configs, kern.cache = [config], {}
    try:
        moe.add_grouped_wgrad(dy, a, offs, d, tma=True)
    finally:
        kern.configs, kern.cache = saved[0], saved[1]


def wgrad_rows(row, name: str, dy: torch.Tensor, src: torch.Tensor, offs: torch.Tensor, base: torch.Tensor,
               flops: float) -> None:
    """One table row per way of adding dy^T src (per group) into the fp32 `base`."""
    import triton

    starts = [0, *offs.tolist()[:-1]]
    ref = torch.stack([dy[s:t].double().T @ src[s:t].double() for s, t in zip(starts, offs.tolist(), strict=True)])

    def torch_add(out: torch.Tensor) -> torch.Tensor:
        return out.add_(torch._grouped_mm(dy.t(), src, offs=offs))

    # Errors from a zero start (the timed calls keep adding into `base`: a difference of it
    # would measure cancellation, not the GEMM).
    row(f"{name}: torch grouped_mm + add", bench(lambda: torch_add(base)), flops,
        rel(torch_add(torch.zeros_like(base)), ref))
    out = torch.zeros_like(base)
    moe.add_grouped_wgrad(dy, src, offs, out, tma=False)
    row(f"{name}: pointer tiles, autotuned", bench(lambda: moe.add_grouped_wgrad(dy, src, offs, base, tma=False)),
        flops, rel(out, ref))
    for bm in TMA_ROWS:
        for bn, bk, w, st in TMA_TILES:
            c = triton.Config({"BN": bn, "BK": bk, "BM": bm}, num_warps=w, num_stages=st)
            label = f"{name}: TMA BN{bn} BK{bk} BM{bm} w{w} s{st}"
            out = torch.zeros_like(base)
            try:
                forced(c, dy, src, offs, out)
            except Exception as exc:  # a tile past shared memory
                print(f"{label}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            row(label, bench(lambda c=c: forced(c, dy, src, offs, base)), flops, rel(out, ref))
    out = torch.zeros_like(base)
    moe.add_grouped_wgrad(dy, src, offs, out, tma=True)
    row(f"{name}: TMA, autotuned (the model's)", bench(lambda: moe.add_grouped_wgrad(dy, src, offs, base, tma=True)),
        flops, rel(out, ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    offs, m = routing(a.tokens, a.experts, a.topk, gen)
    e, d, i = a.experts, a.hidden, a.inter
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, d, generator=gen).to(**bf)
    h = torch.randn(m, i, generator=gen).to(**bf)
    w1 = (torch.randn(e, i, d, generator=gen) * d ** -0.5).to(**bf)
    w13 = (torch.randn(e, 2 * i, d, generator=gen) * d ** -0.5).to(**bf)
    w2 = (torch.randn(e, d, i, generator=gen) * i ** -0.5).to(**bf)
    dy1 = torch.randn(m, i, generator=gen).to(**bf)
    dy2 = torch.randn(m, d, generator=gen).to(**bf)
    rows = a.tokens * a.topk  # real rows; padding rows multiply zeros in the model

    table = []

    def row(name: str, ms: float, flops: float, err: float | None = None) -> None:
        tf = flops / ms / 1e9
        table.append((name, ms, tf, 100 * tf / a.peak_tflops, err))

    gm = torch._grouped_mm
    row("fwd w1 (or w3) [M,d]x[E,d,I]", bench(lambda: gm(x, w1.transpose(-2, -1), offs=offs)), 2 * rows * d * i)
    row("fwd w1+w3 as one [E,2I,d]", bench(lambda: gm(x, w13.transpose(-2, -1), offs=offs)), 4 * rows * d * i)
    row("fwd w2 [M,I]x[E,I,d]", bench(lambda: gm(h, w2.transpose(-2, -1), offs=offs)), 2 * rows * d * i)
    row("dgrad w1 [M,I]x[E,I,d]", bench(lambda: gm(dy1, w1, offs=offs)), 2 * rows * d * i)
    row("dgrad w2 [M,d]x[E,d,I]", bench(lambda: gm(dy2, w2, offs=offs)), 2 * rows * d * i)

    for name, dy, src, shape in (("w1", dy1, x, (e, i, d)), ("w2", dy2, h, (e, d, i))):
        wgrad_rows(row, f"wgrad {name}", dy, src, offs, torch.randn(shape, generator=gen).cuda(), 2 * rows * d * i)

    print(f"\nrows {rows} (+{m - rows} padding) over {e} experts, d {d}, I {i}; "
          f"% of {a.peak_tflops:.0f} TFLOP/s; err: relative to float64")
    print(f"| {'GEMM':<50} | ms | TFLOP/s | % | err |\n|---|---|---|---|---|")
    for name, ms, tf, pct, err in table:
        print(f"| {name:<50} | {ms:.3f} | {tf:.0f} | {pct:.1f} | {'' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()
