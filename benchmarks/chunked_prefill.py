"""A long prompt arriving at a decoding engine: how long the running requests stall, with the
prompt prefilled whole against in chunks of --chunks tokens an iteration (the engine's
prefill_tokens), and the long prompt's time to its first token.

    python3 benchmarks/chunked_prefill.py [--config 1b] [--running 32] [--long 3584] [--chunks 512 2048]

Per budget, in one process and on one model: --running greedy requests (64-token prompts) decode
until steady, then one request of --long prompt tokens is submitted. Each decode step's start
is timed (the engine's `_decode`, wrapped); the table gives the running batch's median step
gap before the long prompt, its longest gap and the steps it took from the submit until the
long prompt's first token, and that time (TTFT). Medians over --repeats. --profile: one
chunk's forward, `extend` against a `prefill` of as many tokens (synchronised times, kernels
and kernel time, and extend's host time by function).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout import PRESETS  # noqa: E402
from miles.rollout.engine import Engine  # noqa: E402
from miles.rollout.sampling import SamplingParams  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4ForCausalLM  # noqa: E402


def one_run(engine: Engine, running: list[list[int]], long: list[int], gen: int) -> tuple[float, float, int, float]:
    """(median step gap before, longest gap after the submit, steps until the first token, TTFT) in ms."""
    starts: list[float] = []
    decode = engine._decode

    def timed():
        starts.append(time.perf_counter())
        decode()

    engine._decode = timed
    done = threading.Event()
    first = {}

    def on_long(r):
        first["t"] = time.perf_counter()
        done.set()

    try:
        params = SamplingParams(temperature=0, max_new_tokens=gen, ignore_eos=True)
        engine.pause()
        for p in running:
            engine.submit(p, params, lambda r: None)
        engine.resume()
        while len(starts) < 24:  # steady decoding (prefill and the graphs' first replays behind)
            time.sleep(0.001)
        t0 = time.perf_counter()
        engine.submit(long, SamplingParams(temperature=0, max_new_tokens=1), on_long)
        done.wait()
        while starts[-1] < first["t"]:  # the step after the first token closes the last gap
            time.sleep(0.001)
        before = [b - a for a, b in zip(starts[4:], starts[5:], strict=False) if b < t0]
        after = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > t0 and a < first["t"]]
        engine.abort()
        while engine.running or engine.waiting:
            time.sleep(0.01)
    finally:
        engine._decode = decode
    return (statistics.median(before) * 1e3, max(after, default=0) * 1e3, len(after),
            (first["t"] - t0) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--long", type=int, default=3584)
    ap.add_argument("--chunks", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also profile one chunk of the first --chunks size")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    max_len = args.long + 128
    cfg = PRESETS[args.config](max_len)
    model = DeepSeekV4ForCausalLM(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                  seed=0).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    running = torch.randint(2, cfg.vocab_size, (args.running, 64), generator=g).tolist()
    long = torch.randint(2, cfg.vocab_size, (args.long,), generator=g).tolist()
    print(f"device {dev}; {args.config}; {args.running} requests decoding, then a prompt of {args.long} tokens; "
          f"median of {args.repeats}")
    print(f"\n{'prefill per iteration':<22} {'step gap ms':>12} {'longest gap ms':>15} {'steps to TTFT':>14} "
          f"{'TTFT ms':>9}")
    gen = 4096 - 64 if dev.type == "cuda" else 400  # the running requests outlast the long prefill
    for budget in [args.long, *args.chunks]:
        engine = Engine(model, max_running=args.running + 1, max_len=max_len, prefill_tokens=budget)
        try:
            one_run(engine, running, long, min(gen, max_len - 64))  # warm-up: graphs, kernels' autotuning
            runs = [one_run(engine, running, long, min(gen, max_len - 64)) for _ in range(args.repeats)]
        finally:
            engine.stop()
        med = [statistics.median(r[i] for r in runs) for i in range(4)]
        name = "whole" if budget >= args.long else f"{budget} tokens"
        print(f"{name:<22} {med[0]:>12.2f} {med[1]:>15.2f} {med[2]:>14.0f} {med[3]:>9.1f}", flush=True)
    print("(step gap: between the running batch's decode steps before the long prompt; longest gap: the "
          "longest while it was prefilled; steps to TTFT: the batch's steps from its submit to its first token)")
    if args.profile and dev.type == "cuda":
        iteration_parts(model, running, long, args.chunks[0], max_len, min(gen, max_len - 64))
        profile_chunk(model, long, args.chunks[0], max_len)


def iteration_parts(model, running: list[list[int]], long: list[int], budget: int, max_len: int, gen: int) -> None:
    """One run with chunks of `budget`, the engine's parts timed (the device synchronised around
    each): where a chunk iteration's time goes."""
    from benchmarks.decode_profile import timing

    engine = Engine(model, max_running=len(running) + 1, max_len=max_len, prefill_tokens=budget)
    extend = model.extend
    try:
        one_run(engine, running, long, gen)
        spans: list[float] = []

        def timed_extend(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = extend(*a, **k)
            torch.cuda.synchronize()
            spans.append(time.perf_counter() - t)
            return out

        model.extend = timed_extend
        with timing(engine, ("_drain", "_prefill", "_decode"), torch.cuda.synchronize) as times:
            one_run(engine, running, long, gen)
    finally:
        model.extend = extend
        engine.stop()
    print(f"\n== the engine's parts in a run with chunks of {budget} (synchronised): calls, ms each")
    for name, ts in [*times.items(), ("model.extend", spans)]:
        ms = sorted(t * 1e3 for t in ts)
        print(f"{name:<14} {len(ms):>5}  median {statistics.median(ms):8.2f}  max {ms[-1]:8.2f}"
              + (f"  all: {' '.join(f'{t * 1e3:.1f}' for t in ts)}" if len(ms) <= 12 else ""))


def profile_chunk(model: DeepSeekV4ForCausalLM, long: list[int], t: int, max_len: int) -> None:
    from benchmarks.decode_profile import host_table, kernel_table

    cache = model.new_cache(2, max_len, "cuda")
    ids = torch.tensor(long[:2 * t], device="cuda")

    def prefill():
        model.prefill([ids[:t]], cache, [0])

    def extend():
        cache.length[1] = t
        model.extend([ids[t:]], cache, [1])

    model.prefill([ids[:t]], cache, [1])
    for name, fn in (("prefill", prefill), ("extend", extend)):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"\n== {name} of {t} tokens: {statistics.median(times):.2f} ms (median of 5, synchronised)")
        print(kernel_table(fn, 20))
    print("\n== extend's host time by function (cProfile)")
    print(host_table(extend, 30))


if __name__ == "__main__":
    main()
