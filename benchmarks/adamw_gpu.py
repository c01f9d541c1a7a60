"""The AdamW step alone: torch's fused AdamW (the clip's divisor as its grad_scale) plus a copy
of each weight to bf16, as Megatron's DistributedOptimizer runs it, against miles.train.adamw's
one kernel, over tensors shaped like the ~1B config's (a few large, many small). Prints a table
(median ms of 20, the bytes each moves per parameter, GB/s). GPU only.

    python3 benchmarks/adamw_gpu.py [--params 5e8] [--moments bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from miles.train import adamw


def tensors(total: int, g: torch.Generator):
    """Sizes: a quarter in 8 big tensors, the rest in 280 of ~1-12M, plus 40 small ones."""
    sizes = [total // 32] * 8 + [int(x) for x in torch.randint(1_000_000, 12_000_000, (280,), generator=g)]
    sizes += [int(x) for x in torch.randint(1, 5000, (40,), generator=g)]
    scale = total / sum(sizes)
    return [max(1, int(n * scale)) for n in sizes]


def build(sizes, g):
    params = [torch.nn.Parameter(torch.randn(n, generator=g).cuda()) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel(), generator=g).cuda()
    opt = torch.optim.AdamW([{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2]}],
                            lr=1e-4, fused=True)
    outs = {id(p): torch.empty(p.numel(), dtype=torch.bfloat16, device="cuda") for p in params}
    return opt, params, outs


def timed(fn, n: int = 20) -> float:
    fn()
    fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=5e8)
    ap.add_argument("--moments", default="float32", choices=["float32", "bfloat16"],
                    help="the kernel's moments (train.optim.moments); torch's row keeps fp32 ones")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    sizes = tensors(int(a.params), g)
    n = sum(sizes)
    opt, params, outs = build(sizes, g)
    scale = torch.tensor(1.5, device="cuda")

    def torch_step():
        opt.grad_scale = scale
        opt.step()
        for p in params:
            outs[id(p)].copy_(p)

    rows = [("torch fused AdamW (grad_scale) + copies", torch_step, 38)]
    real_table = adamw._table

    defaults = adamw.BLOCK, adamw.ITERS, adamw.WARPS
    nbytes = 30 if a.moments == "float32" else 22  # fp32 w r/w, g, 2 moments r/w, the bf16 copy
    if a.moments != "float32":
        torch_step()  # the moments exist, then narrowed
        adamw.set_moments(opt, a.moments)

    def kernel(block: int, iters: int, warps: int, hints: bool) -> None:
        adamw.BLOCK, adamw.ITERS, adamw.WARPS = block, iters, warps
        adamw._table = real_table if hints else lambda *args: (real_table(*args)[0], False)
        try:
            adamw.update(opt, outs, scale, impl="triton")
        finally:
            adamw._table = real_table
            adamw.BLOCK, adamw.ITERS, adamw.WARPS = defaults

    for block, iters, warps, hints in ((512, 4, 4, True), (512, 1, 4, True), (512, 2, 4, True), (512, 8, 4, True),
                                       (256, 4, 4, True), (1024, 2, 4, True), (1024, 4, 4, True), (1024, 2, 8, True),
                                       (2048, 1, 8, True), (2048, 2, 8, True), (2048, 1, 4, True), (4096, 1, 8, True),
                                       (4096, 1, 16, True), (512, 4, 4, False)):
        rows.append((f"one kernel, BLOCK {block} x {iters}, {warps} warps{'' if hints else ', no alignment hints'}",
                     functools.partial(kernel, block, iters, warps, hints), nbytes))

    print(f"\n{torch.cuda.get_device_name()}  AdamW step over {n / 1e6:,.0f}M fp32 parameters in {len(sizes)} tensors")
    print(f"{'variant':44s} {'ms':>8s} {'B/param':>8s} {'GB/s':>8s}")
    for name, fn, nbytes in rows:
        ms = timed(fn)
        print(f"{name:44s} {ms:8.2f} {nbytes:8d} {nbytes * n / ms / 1e6:8,.0f}")


if __name__ == "__main__":
    main()
