"""GPU benchmark of the DeepSeek-V4 sparse attention core (one layer, one sequence).

    PYTHONPATH=. python3 benchmarks/attention_gpu.py [--quick]

Shapes of a V4-Flash layer: H = 64 heads, D = 512, window 128; CSA picks 512 compressed
entries (ratio 4), HCA attends every visible entry (ratio 128). Variants: the Triton
kernels (fast and deterministic backward; on an H100 the forward, the backward's dq pass
and the fast backward's kv gradient are the Gluon kernels, "portable" times the Triton ones
in their place and "portable kv grad" the kv gradient's alone), the PyTorch gather
reference, and dense masked SDPA over [raw keys ; compressed entries] (no sink: a speed
baseline only). The FLOP floor
counts the useful matmuls (forward 2 of Q.K and P.V, backward 5) over the valid keys only,
at the bf16 matmul rate measured in the same run. Peak memory is the extra allocation
over the inputs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from plugins.deepseek_v4 import ops
from plugins.deepseek_v4.kernels import sparse_attention as sa
from plugins.deepseek_v4.kernels.sparse_attention import AttentionOptions, sparse_attention

H, D, WINDOW = 64, 512, 128


AHEAD_CYCLES = 10 ** 7  # ~6 ms of GPU sleep queued before each timed sample


def bench(fn, reps: int = 20, calls: int = 4, ahead: bool = True) -> float:
    """Median milliseconds per call with CUDA events, after warm-up. Each timed sample is
    `calls` back-to-back calls, so the host's launch work overlaps the previous call's GPU
    work, as in a training step (one call per sample would time the host's gaps too). With
    `ahead`, a GPU sleep queued before the start event lets the host queue the first call
    too before the GPU reaches it (in a training step the GPU is busy with the layer before)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead:
            torch.cuda._sleep(AHEAD_CYCLES)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def matmul_tflops() -> float:
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                                  dtype=torch.bfloat16)
    return 2 * n ** 3 / bench(lambda: a @ b) / 1e9


def make_case(s: int, ratio: int, topk: int | None, g: torch.Generator):
    """q [S, H, D]; pool = [S raw kv ; S/ratio compressed]; idx [S, WINDOW + picks]."""
    n_c = s // ratio
    q = torch.randn(s, H, D, device="cuda", generator=g).bfloat16()
    pool = torch.randn(s + n_c, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    p = torch.arange(s, device="cuda")
    win = p[:, None] - torch.arange(WINDOW, device="cuda")[None, :]
    win = torch.where(win >= 0, win, -1)
    visible = torch.arange(n_c, device="cuda")[None, :] < ((p + 1) // ratio)[:, None]  # [S, G]
    if topk is None:  # HCA: every visible entry
        comp = torch.where(visible, torch.arange(n_c, device="cuda")[None, :] + s, -1)
    else:  # CSA: a random top-k of the visible entries stands in for the indexer's choice
        score = torch.rand(s, n_c, device="cuda", generator=g).masked_fill(~visible, -1.0)
        top = score.topk(min(topk, n_c), dim=-1)
        comp = torch.where(top.values >= 0, top.indices + s, -1)
    idx = torch.cat((win, comp), 1).int().contiguous()
    return q, pool, idx, sink


def dense_mask(idx: torch.Tensor, n: int) -> torch.Tensor:
    m = torch.zeros(idx.shape[0], n + 1, dtype=torch.bool, device=idx.device)
    m.scatter_(1, torch.where(idx >= 0, idx.long(), n), True)
    return m[:, :n]


def train_step(fwd, inputs, cotangent: dict | None) -> None:
    """fwd(), and with a cotangent dict its backward: gradients cleared first (no accumulation
    kernel) and dO made once and kept in the dict (a [S, H, D] fill is not attention work)."""
    for x in inputs:
        x.grad = None
    out = fwd()
    if cotangent is not None:
        if "do" not in cotangent:
            cotangent["do"] = torch.ones_like(out)
        out.backward(cotangent["do"])


def run_variant(name, fwd, inputs, flops_f, flops_fb, rows, case):
    for x in inputs:
        x.grad = None  # the variant before left its gradients: freed in our first step, they would offset the peak
    base = torch.cuda.memory_allocated()
    row = [case, name]
    cotangent = {}  # made once: filling a [S, H, D] dO per step is not attention work (0.13 ms at S = 4096)
    for flops, with_bwd in ((flops_f, False), (flops_fb, True)):
        try:
            def step(with_bwd=with_bwd):
                train_step(fwd, inputs, cotangent if with_bwd else None)
            step()  # first call: autotuning, whose trial runs would count in the peak below
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = bench(step, reps=10 if "dense" in name or "gather" in name else 20)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            row += [f"{ms:.2f}", f"{flops / ms / 1e9:.0f}", f"{peak:.2f}"]
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            row += ["OOM", "-", "-"]
    rows.append(row)


# A/B variants: the portable Triton kernels in place of the H100 Gluon ones, and the portable
# kv gradient in place of the Gluon one (the fast backward's default)
PORTABLE, PORTABLE_KV = AttentionOptions(sm90=False), AttentionOptions(sm90_kv_gradient=False)


def check(q, pool, idx, sink) -> dict:
    """Relative errors of the kernel vs the fp32 gather reference (o, dq, dkv, dsink)."""
    scale = D ** -0.5
    t = slice(0, 512)  # a prefix of queries keeps the fp32 reference small
    qs, ids = q[t].float().requires_grad_(), idx[t]
    pf, sf = pool.float().requires_grad_(), sink.clone().requires_grad_()
    o_ref, _ = ops.sparse_attention_indexed(qs, pf, ids, sf, scale)
    do = torch.randn_like(o_ref)
    (o_ref * do).sum().backward()
    qk, pk, sk = q[t].clone().requires_grad_(), pool.clone().requires_grad_(), sink.clone().requires_grad_()
    o, _ = sparse_attention(qk, pk, ids, sk, scale)
    (o.float() * do).sum().backward()

    def rel(a, b):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        return ((a.float() - b).norm() / b.norm()).item()

    return {"o": rel(o, o_ref), "dq": rel(qk.grad, qs.grad), "dkv": rel(pk.grad, pf.grad),
            "dsink": rel(sk.grad, sf.grad)}


def kernel_times(q, pool, idx, sink, deterministic: bool) -> str:
    """CUDA time per kernel of one forward+backward (torch profiler), largest first."""
    qg, pg, sg = q.clone().requires_grad_(), pool.clone().requires_grad_(), sink.clone().requires_grad_()
    cotangent = {}  # as in `run_variant`, so the profile lists the attention's own kernels only

    def step():
        train_step(lambda: sparse_attention(qg, pg, idx, sg, D ** -0.5, deterministic=deterministic)[0],
                   [qg, pg, sg], cotangent)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])[:6]
    return ", ".join(f"{name[:24]} {ms:.2f} ms ({n}x)" for name, ms, n in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape, no dense baseline")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rate = matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}, bf16 matmul {rate:.0f} TFLOP/s (8192^3, median)")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [("CSA S=4096", 4096, 4, 512), ("CSA S=8192", 8192, 4, 512), ("HCA S=8192", 8192, 128, None)]
    if args.quick:
        cases = cases[:1]
    rows, floors = [], []
    scale = D ** -0.5
    for case, s, ratio, topk in cases:
        q, pool, idx, sink = make_case(s, ratio, topk, g)
        n_valid = int((idx >= 0).sum())
        flops_f = 4 * n_valid * H * D
        flops_fb = flops_f * 7 / 2  # forward 2 matmuls + backward 5
        floors.append((case, flops_f / rate / 1e9, flops_fb / rate / 1e9, idx.shape[1], n_valid / s))
        qg, pg, sg = q.clone().requires_grad_(), pool.clone().requires_grad_(), sink.clone().requires_grad_()
        inputs = [qg, pg, sg]
        run_variant("triton", lambda qg=qg, pg=pg, idx=idx, sg=sg: sparse_attention(qg, pg, idx, sg, scale)[0],
                    inputs, flops_f, flops_fb, rows, case)
        run_variant("triton, portable", lambda qg=qg, pg=pg, idx=idx, sg=sg: sparse_attention(
            qg, pg, idx, sg, scale, options=PORTABLE)[0], inputs, flops_f, flops_fb, rows, case)
        run_variant("triton, portable kv grad", lambda qg=qg, pg=pg, idx=idx, sg=sg: sparse_attention(
            qg, pg, idx, sg, scale, options=PORTABLE_KV)[0], inputs, flops_f, flops_fb, rows, case)
        run_variant("triton determ.", lambda qg=qg, pg=pg, idx=idx, sg=sg: sparse_attention(
            qg, pg, idx, sg, scale, deterministic=True)[0], inputs, flops_f, flops_fb, rows, case)
        run_variant("gather ref", lambda qg=qg, pg=pg, idx=idx, sg=sg: ops.sparse_attention_indexed(
            qg, pg, idx, sg, scale)[0], inputs, flops_f, flops_fb, rows, case)
        if not args.quick:
            mask = dense_mask(idx, pool.shape[0])
            run_variant("dense SDPA", lambda qg=qg, pg=pg, mask=mask: F.scaled_dot_product_attention(
                qg.transpose(0, 1)[None], pg[None, None].expand(1, H, -1, -1), pg[None, None].expand(1, H, -1, -1),
                attn_mask=mask[None, None]), inputs, flops_f, flops_fb, rows, case)
        errs = check(q, pool, idx, sink)  # after timing: the kernels were autotuned at full size
        for det in (False, True):
            print(f"{case}: {'deterministic' if det else 'fast'} backward, per kernel: "
                  + kernel_times(q, pool, idx, sink, det))
        print(f"{case}: kernel vs fp32 reference, relative errors "
              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        del q, pool, idx, sink, qg, pg, sg, inputs
        torch.cuda.empty_cache()
    print("autotuned:", {n: str(getattr(getattr(sa, n), "best_config", "-")) for n in ("_fwd", "_bwd_dq")})
    print("kv gradient, per (H, D, slot class, deterministic):",
          {k[:4]: str(c) for k, c in sa._bwd_dkv.cache.items()})
    print("\nFLOP floor at the measured matmul rate (valid keys only):")
    for case, ff, ffb, k, kv in floors:
        print(f"  {case}: K slots {k}, valid keys/query {kv:.0f}: fwd {ff:.3f} ms, fwd+bwd {ffb:.3f} ms")
    head = ["case", "variant", "fwd ms", "fwd TF/s", "fwd GiB", "f+b ms", "f+b TF/s", "f+b GiB"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
