"""Where the embedded engine's time goes at one batch size: its iterations taken apart
(prefill, the decode step, sampling and the host's bookkeeping), then the kernels of one
packed prefill and of one eager decode step (counts and CUDA time, torch.profiler).

    python3 benchmarks/decode_profile.py [--config 1b] [--batch 64] [--kv-quant fp8]

The parts are timed with the device synchronised around each (so they add up to the wall
time of a request batch, and a part's host time and device time are not told apart there;
the kernel tables tell them apart).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout import PRESETS, engine_run  # noqa: E402
from miles.rollout.engine import Engine  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4ForCausalLM  # noqa: E402


@contextlib.contextmanager
def timing(engine: Engine, names: tuple[str, ...], sync=lambda: None):
    """The engine's methods `names` timed while inside: {name: [seconds of each call]}, `sync`
    called around each call."""
    times: dict[str, list[float]] = defaultdict(list)
    originals = {name: getattr(engine, name) for name in names}

    def wrap(name, fn):
        def call(*a, **k):
            sync()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                times[name].append(time.perf_counter() - t)
        return call

    for name, fn in originals.items():
        setattr(engine, name, wrap(name, fn))
    try:
        yield times
    finally:
        for name, fn in originals.items():
            setattr(engine, name, fn)


def timed_parts(engine: Engine, prompts: list[list[int]], gen: int) -> dict[str, float]:
    """engine_run with the engine's _prefill, decoder, _sample and _read timed (ms, device
    synced: the overlap of a step's reading with the next step is gone here)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    parts: dict[str, float] = defaultdict(float)
    with timing(engine, ("_prefill", "decoder", "_sample", "_read"), sync) as times:
        parts["wall"] = engine_run(engine, prompts, gen) * 1e3
    for name, ts in times.items():
        parts[name], parts[name + " calls"] = sum(ts) * 1e3, len(ts)
    return parts


def kernel_table(fn, rows: int) -> str:
    """fn() profiled once (after one unprofiled call): kernel launches, CUDA time and the
    ops with the most self CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    head = f"wall {wall:.2f} ms, {len(kernels)} kernels, {busy:.2f} ms of kernel time"
    return head + "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)


def host_table(fn, rows: int) -> str:
    """fn() under cProfile (after one unprofiled call), the device synchronised at its end:
    the functions with the most own time, and the most time in all."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip() and "Ordered by" not in line)


def by_source(fn, rows: int) -> str:
    """fn() profiled with Python stacks: its kernels and their CUDA time by the line of the
    model's code that launched them (the innermost frame in model.py, else in the repository)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # the Python frames recorded
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=verbose) as prof:
        fn()
        torch.cuda.synchronize()

    def stack(e) -> list[str]:  # innermost first; a Triton launch's op has only its parents' frames
        if e.stack:
            return list(e.stack)
        out = []
        while e is not None:
            out.append(e.name)
            e = e.cpu_parent
        return out

    lines: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        frames = [f for f in stack(e) if "plugins/" in f or "miles/" in f]
        where = next((f for f in frames if "model.py" in f), frames[0] if frames else "(no frame: " + e.name + ")")
        lines[where.split("/")[-1]][0] += len(e.kernels)
        lines[where.split("/")[-1]][1] += sum(k.duration for k in e.kernels)
    top = sorted(lines.items(), key=lambda kv: -kv[1][1])[:rows]
    out = [f"{'kernels':>8} {'us':>9}  where (the innermost frame in model.py)"]
    out += [f"{n:>8.0f} {us:>9.1f}  {where}" for where, (n, us) in top]
    return "\n".join(out)


def overlapped(engine: Engine, prompts: list[list[int]], gen: int) -> str:
    """engine_run as it runs (steps overlapped, nothing synchronised): the host's time a call
    in each of the engine's parts (their ranges nest: _decode holds decoder, _sample and _read),
    and from torch.profiler's kernels, how much of the run the GPU was busy and its idle gaps
    (the profiler sees the scheduler thread's kernels, not its ops)."""
    from torch.profiler import ProfilerActivity, profile

    names = ("_prefill", "_decode", "decoder", "_sample", "_read")
    cuda = engine.device.type == "cuda"
    with timing(engine, names) as host, \
            profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        wall = engine_run(engine, prompts, gen) * 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    lines = [f"{'host part':12s} {'calls':>6s} {'ms/call':>9s}"]
    for name in names:
        lines.append(f"{name:12s} {len(host[name]):6d} {statistics.mean(host[name] or [0]) * 1e3:9.3f}")
    if not spans:
        return "\n".join(lines + ["no device kernels were recorded"])
    busy, gaps, cur = 0.0, [], list(spans[0])
    for a, b in spans[1:]:
        if a > cur[1]:
            busy += cur[1] - cur[0]
            gaps.append(a - cur[1])
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    busy += cur[1] - cur[0]
    window = cur[1] - spans[0][0]
    big = sorted((g for g in gaps if g > 20), reverse=True)
    return "\n".join([f"wall {wall:.1f} ms; first to last kernel {window / 1e3:.2f} ms, the GPU busy {busy / 1e3:.2f} "
                      f"ms ({busy / window:.0%}); {len(big)} idle gaps over 20 us, {sum(big) / 1e3:.2f} ms in all, "
                      "the largest " + ", ".join(f"{g:.0f}" for g in big[:8]) + " us"] + lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kv-quant", choices=["fp8"])
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[args.config](args.prompt + args.gen)
    cfg.kv_quant = args.kv_quant
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = DeepSeekV4ForCausalLM(cfg, dtype=dt, seed=0).to(dev).eval()
    engine = Engine(model, max_running=64, max_len=args.prompt + args.gen + 1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, cfg.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    engine_run(engine, prompts, 2)  # the bucket's graph captured, Triton compiled
    engine_run(engine, prompts, args.gen)
    p = timed_parts(engine, prompts, args.gen)
    tok = args.batch * args.gen
    print(f"{args.config}, B={args.batch}, prompt {args.prompt}, {args.gen} generated"
          + (", FP8 key cache" if args.kv_quant else "") + f": {tok / p['wall'] * 1e3:,.1f} tok/s (parts synced)")
    print(f"{'part':<12} {'calls':>6} {'ms':>9} {'ms/call':>9}")
    for name in ("_prefill", "decoder", "_sample", "_read"):
        n = p[name + " calls"]
        print(f"{name:<12} {n:>6.0f} {p[name]:>9.2f} {p[name] / max(n, 1):>9.3f}")
    rest = p["wall"] - p["_prefill"] - p["decoder"] - p["_sample"] - p["_read"]
    print(f"{'rest':<12} {'':>6} {rest:>9.2f}   (scheduler, threads, callbacks)")
    print(f"{'wall':<12} {'':>6} {p['wall']:>9.2f}")
    if dev.type != "cuda":
        return
    print(f"\n== {args.batch} requests as the engine runs them (steps overlapped), profiled")
    print(overlapped(engine, prompts, args.gen))
    with engine.step_lock:
        ids = [torch.tensor(q, device=dev) for q in prompts]
        slots = list(range(args.batch))
        print(f"\n== one packed prefill of {args.batch} prompts")
        print(kernel_table(lambda: model.prefill(ids, engine.cache, slots), args.rows))
        print("\n== its host time by function (cProfile; a wait for the device shows in the call that waits)")
        print(host_table(lambda: model.prefill(ids, engine.cache, slots), args.rows))
        ids_t = torch.full((args.batch,), 3, device=dev)
        slots_t = torch.arange(args.batch, device=dev)

        def step():
            engine.cache.length[slots_t] = args.prompt
            model.decode(ids_t, engine.cache, slots_t)

        print(f"\n== one eager decode step of {args.batch}")
        print(kernel_table(step, args.rows))
        print("\n== the same step's kernels by the model code that launched them")
        print(by_source(step, args.rows))
        engine.cache.length[slots_t] = 0
    engine.stop()


if __name__ == "__main__":
    main()
