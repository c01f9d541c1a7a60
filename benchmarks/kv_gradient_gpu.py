"""GPU benchmark of the backward's kv gradient alone: the portable key-major Triton kernel (its
autotuned tile) against the H100 Gluon kernel in each tile that fits, on the scratch of one
backward chunk of the `attention_gpu` shapes.

    PYTHONPATH=. python3 benchmarks/kv_gradient_gpu.py

Every variant gets the same P, dS and slot map (from the Gluon dq pass) and is checked against
the portable kernel's dkv (finite, relative difference at fp32 summation-order level); the
deterministic mode is also checked bit-for-bit across two runs. Times are medians of the
kernel alone (with the zeroing of dkv that the fast mode's atomics need, for both).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from attention_gpu import D, bench, make_case  # noqa: E402

from plugins.deepseek_v4.kernels import sparse_attention as sa  # noqa: E402
from plugins.deepseek_v4.kernels import sparse_attention_sm90 as sm  # noqa: E402

# (BN, BD, stages) of the Gluon kernel; what does not fit shared memory is reported and skipped
TILES = [(128, 256, 2), (64, 256, 2), (64, 128, 3), (64, 128, 4), (128, 128, 3)]


def chunk_scratch(q, pool, idx0, sink):
    """The first backward chunk's inputs to the kv gradient, as `sparse_attn_bwd` makes them."""
    idx, cnt = sa.compact(idx0)
    scale = D ** -0.5
    o, lse = sa.sparse_attn_fwd(q, pool, idx, cnt, sink, scale)
    do = torch.randn_like(q)
    t, h, _ = q.shape
    n, k = pool.shape[0], idx.shape[1]
    tc, _ = sa.chunking(q, n, k, deterministic=False)
    pt, dst = (torch.empty(tc, k, h, device="cuda", dtype=q.dtype) for _ in range(2))
    dq, dsink = torch.empty_like(q), torch.empty(t, h, device="cuda")
    sm.bwd_dq_into(q, pool, idx, cnt, sink.float(), scale, o, do, lse, dq, dsink, pt, dst, 0, tc)
    smap, first, last = sa._key_map(idx, 0, tc, n)
    return do, pt, dst, smap, first, last


def sweep(case: str, q, do, pt, dst, smap, first, last, det: bool, rows: list) -> None:
    """The portable kernel, then each Gluon tile, on one chunk's scratch (fast or deterministic)."""
    tc, n = smap.shape
    d = q.shape[2]
    mode = "determ." if det else "fast"
    _, tsplit = sa.chunking(q, n, pt.shape[1], det)
    splits = triton.cdiv(tc, tsplit)
    buf = torch.empty(splits if det else 1, n, d, device="cuda")
    dkv = torch.zeros(n, d, device="cuda")

    def portable():
        dkv.zero_()
        sa.kv_gradient_into(q, do, pt, dst, smap, first, last, dkv, buf, 0, tsplit, det, sm90=False)

    def result():
        torch.cuda.synchronize()
        out = buf[:splits].sum(0) if det else dkv.clone()
        assert torch.isfinite(out).all(), "non-finite kv gradient"
        return out

    portable()
    ref = result()
    base = bench(portable)
    rows.append([case, mode, f"portable {sa._bwd_dkv.best_config}", f"{base:.3f}", "1.00", "-"])
    for bn, bd, ns in TILES:
        def gluon(bn=bn, bd=bd, ns=ns):
            dkv.zero_()
            sm.bwd_dkv_into(q, do, pt, dst, smap, first, last, dkv, buf, 0, tsplit, sa.GROUP, det, bn, bd, ns)

        name = f"gluon {bn}x{bd}, {ns} stages"
        try:
            gluon()
        except triton.runtime.errors.OutOfResources as e:
            rows.append([case, mode, name, "-", "-", str(e)[:48]])
            continue
        got = result()
        if det:
            gluon()
            assert torch.equal(result(), got), f"{name}: deterministic kv gradient not bitwise repeatable"
        diff = ((got - ref).norm() / ref.norm()).item()
        ms = bench(gluon)
        rows.append([case, mode, name, f"{ms:.3f}", f"{ms / base:.2f}", f"{diff:.1e}"])


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[list[str]] = []
    for case, s, ratio, topk in [("CSA S=4096", 4096, 4, 512), ("CSA S=8192", 8192, 4, 512),
                                 ("HCA S=8192", 8192, 128, None)]:
        q, pool, idx0, sink = make_case(s, ratio, topk, g)
        scratch = chunk_scratch(q, pool, idx0, sink)
        for det in (False, True):
            sweep(case, q, *scratch, det, rows)
        print(f"{case}: chunk of {scratch[3].shape[0]} tokens, K {scratch[1].shape[1]}", flush=True)
        del q, pool, idx0, sink, scratch
        torch.cuda.empty_cache()
    head = ["case", "mode", "kernel", "ms", "vs portable", "rel diff"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
