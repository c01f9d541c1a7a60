"""Rollout: generated tokens/s of the embedded engine against recompute-everything generation
of the same model in the same process, the shared prefill of n samples per prompt, and
weight-sync time and GB/s per path.

    .venv/bin/python benchmarks/rollout.py [--configs tiny small_50m] [--gen 32] [--sync]

Per config and batch size B (1, 16, 64): B greedy requests with distinct prompts of --prompt
tokens, --gen new tokens each (EOS ignored), submitted together to the paused engine (continuous
batching, slot cache); the baseline generates the same tokens by running the full forward
over the whole sequence for every new token (no cache). "n=8" sends B/8 prompts 8 times
each (one prefill per prompt) against B distinct prompts. --sync adds the weight sync of
a one-rank TrainGroup to one engine actor, per path (Ray object store, gloo/nccl broadcast,
disk: the HF layout written to a temporary directory and loaded by the engine; shared: the
engine opens the rank's buffers in place, CUDA IPC on a GPU; both on one GPU there).
Medians over --repeats.
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

from benchmarks.train_gpu import CONFIGS  # noqa: E402
from miles.rollout.engine import Engine  # noqa: E402
from miles.rollout.sampling import SamplingParams  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM  # noqa: E402

PRESETS = {"tiny": lambda seq: DeepSeekV4Config.tiny(), **CONFIGS}


def engine_run(engine: Engine, prompts: list[list[int]], gen: int) -> float:
    done, cv = [], threading.Condition()

    def cb(r):
        with cv:
            done.append(r)
            cv.notify_all()

    params = SamplingParams(temperature=0, max_new_tokens=gen, ignore_eos=True)
    t = time.perf_counter()
    engine.pause()  # all of them admitted at once (else the scheduler may start on the first few)
    for p in prompts:
        engine.submit(p, params, cb)
    engine.resume()
    with cv:
        cv.wait_for(lambda: len(done) == len(prompts))
    return time.perf_counter() - t


@torch.no_grad()
def recompute_run(model, prompts: list[list[int]], gen: int) -> float:
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    t = time.perf_counter()
    for _ in range(gen):
        nxt = model(ids).logits[:, -1].argmax(-1)
        ids = torch.cat((ids, nxt[:, None]), 1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def step_parts(engine: Engine, b: int, gen: int, repeats: int) -> tuple[float, float, float, float]:
    """One decode step of b sequences taken apart, in ms (medians): the model's step (replayed
    from its graph where there is one), the sampler with its copy to the host, the engine's
    whole step as the scheduler runs it (its Python included, the prefill spread over `gen`
    steps), and its steady decode step: (time of 2 x gen tokens - time of gen) / gen, the
    prefill taken out. On slots 0..b-1 of the idle engine, which are overwritten and handed
    back empty."""
    from miles.rollout.sampling import sample, uniforms

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    params = [SamplingParams(temperature=0, max_new_tokens=1 << 20, ignore_eos=True)] * b
    ids, slots = [3] * b, list(range(b))

    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            engine.cache.length[slots] = 8
            sync()
            t = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    with engine.step_lock:
        model = timed(lambda: engine.decoder(ids, slots))
        logits, _ = engine.decoder(ids, slots)
        sampler = timed(lambda: sample(logits, params, uniforms([None] * b))[0].cpu())
        engine.cache.length[slots] = 0
    prompts = [[3] * 8 + [i] for i in range(b)]
    t = median_of(lambda: engine_run(engine, prompts, gen), 3)
    t2 = median_of(lambda: engine_run(engine, prompts, 2 * gen), 3)
    return model, sampler, t * 1e3 / gen, (t2 - t) * 1e3 / gen


def median_of(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def generation_rows(name: str, args, dev: torch.device) -> list[tuple]:
    cfg = PRESETS[name](args.prompt + args.gen)
    cfg.kv_quant = args.kv_quant  # "fp8": the FP8 key cache (kv_pool.Fp8KeyPool)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = DeepSeekV4ForCausalLM(cfg, dtype=dt, seed=0).to(dev).eval()
    engine = Engine(model, max_running=64, max_len=args.prompt + args.gen + 1, cuda_graphs=not args.no_graphs)
    cache = sum(t.numel() * t.element_size() for t in engine.cache.tensors())
    print(f"{name}: the engine's cache {cache / 2**20:.1f} MiB ({engine.cache.slots} slots of {engine.cache.max_len})")
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(2, cfg.vocab_size, (n, args.prompt), generator=g).tolist()

    rows = []
    for b in sorted(set(args.batches)):  # warm-up: every bucket's CUDA graph captured before timing
        engine_run(engine, prompts(b), 2)
    for b in args.batches:
        ps = prompts(b)
        t_eng = median_of(lambda ps=ps: engine_run(engine, ps, args.gen), args.repeats)
        t_base = median_of(lambda ps=ps: recompute_run(model, ps, args.gen), args.repeats) if b <= 16 else None
        tok = b * args.gen
        rows.append((name, f"B={b}", tok / t_eng, tok / t_base if t_base else None,
                     t_base / t_eng if t_base else None))
    for b in args.batches if args.overlap_ab else ():  # the same engine reading each step before the next
        ps = prompts(b)
        on = median_of(lambda ps=ps: engine_run(engine, ps, args.gen), args.repeats)
        engine.overlap = False
        off = median_of(lambda ps=ps: engine_run(engine, ps, args.gen), args.repeats)
        engine.overlap = True
        rows.append((name, f"B={b}, overlap on/off", b * args.gen / on, b * args.gen / off, off / on))
    for b in args.batches:
        rows.append((name, f"B={b} step parts", *step_parts(engine, b, args.gen, args.repeats * 10)))
    b = max(8, args.batches[-1] if args.batches[-1] % 8 == 0 else 16)
    distinct = prompts(b)
    shared = [p for p in prompts(b // 8) for _ in range(8)]
    t_d = median_of(lambda: engine_run(engine, distinct, args.gen), args.repeats)
    t_s = median_of(lambda: engine_run(engine, shared, args.gen), args.repeats)
    rows.append((name, f"B={b}, n=8 shared", b * args.gen / t_s, b * args.gen / t_d, t_d / t_s))
    engine.stop()
    return rows


PARTS = {  # the parts each sync path reports, as its info's keys
    "shared": {"share_s": "ranks pack and fingerprint", "stage_s": "engines open, check and stage",
               "swap_s": "swap", "release_s": "ranks release"},
    "broadcast": {"plan_s": "plan", "open_s": "group and begin", "transfer_s": "pack, broadcast, fingerprint "
                  "and stage", "check_s": "compare", "commit_s": "commit"},
}


def sync_rows(name: str, args, gpu: bool) -> list[tuple]:
    """Each path from a one-rank TrainGroup to one engine actor. On GPUs the rank and the engine
    share a GPU (half each), as colocated jobs place them, except for the NCCL broadcast, which
    needs a GPU each (two GPUs; skipped on one)."""
    import shutil
    import tempfile

    import ray

    from miles.cluster.train_group import TrainGroup
    from miles.rollout.manager import RolloutManager
    from miles.rollout.sync import sync_disk, sync_object_store, sync_shared

    cfg = PRESETS[name](args.prompt + args.gen)
    dtype = "bfloat16" if gpu else "float32"
    bucket = args.bucket_mb << 20
    disk = tempfile.mkdtemp(prefix="miles-sync-")  # local disk here; a shared filesystem on clusters
    paths = {"object_store": lambda g, m, v: sync_object_store(g, m, bucket, v),
             # through the manager, as jobs sync: its group is opened once and kept
             "broadcast": lambda g, m, v: m.update_by_broadcast(g, bucket, v, "nccl" if gpu else "gloo"),
             "disk": lambda g, m, v: sync_disk(g, m, disk, cfg, v),
             "shared": lambda g, m, v: sync_shared(g, m, bucket, v)}
    apart = gpu and torch.cuda.device_count() >= 2
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    rows = []
    try:
        for share in (0.5, 1.0) if apart else (0.5,):
            names = ["broadcast"] if gpu and share == 1.0 else [p for p in paths if p != "broadcast" or not gpu]
            names = [p for p in names if p in args.paths]
            if not names:
                continue
            group = TrainGroup(1, resources={"CPU": 1} | ({"GPU": share} if gpu else {}))
            group.call("build_model", cfg.to_dict(), 0, dtype=dtype)
            mgr = RolloutManager({"num_engines": 1, "max_running": 4, "max_len": 64,
                                  "gpus_per_engine": share if gpu else 0.0},
                                 {"config": cfg.to_dict(), "seed": 0, "dtype": dtype})
            for path in names:
                infos = [paths[path](group, mgr, v) for v in range(1, args.repeats + 2)][1:]  # the first warms up
                s = statistics.median(i["seconds"] for i in infos)
                gb = infos[0]["bytes"] / 1e9
                rows.append((name, path if not gpu else f"{path} ({'GPU each' if share == 1 else 'one GPU'})",
                             gb, s, gb / s))
                if path in PARTS:  # where its time goes
                    print(f"  {path}, {name}: " + ", ".join(
                        f"{what} {statistics.median(i[k] for i in infos):.3f} s" for k, what in PARTS[path].items()),
                        flush=True)
            mgr.shutdown()
            group.shutdown()
        if gpu and not apart and "broadcast" in args.paths:
            rows.append((name, "broadcast (needs 2 GPUs)", float("nan"), float("nan"), float("nan")))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        ray.shutdown()
    return rows


def generation_tables(args: argparse.Namespace, dev: torch.device) -> None:
    parts: list[str] = []
    print(f"\n{'config':<10} {'workload':<18} {'engine tok/s':>13} {'baseline tok/s':>15} {'speed-up':>9}")
    for name in args.configs:
        for c, w, e, b, r, *more in generation_rows(name, args, dev):
            steady_ms = more[0] if more else None
            if w.endswith("step parts"):
                steady = int(w.split()[0][2:]) / steady_ms * 1e3 if steady_ms > 0 else float("nan")  # noisy
                parts.append(f"{c:<10} {w[:-11]:<8} {e:>10.2f} {b:>10.2f} {r:>10.2f} {steady_ms:>10.2f} "
                             f"{steady:>12.1f}")
                continue
            base = f"{b:>15.1f}" if b else f"{'-':>15}"
            ratio = f"{r:>8.2f}x" if r else f"{'-':>9}"
            print(f"{c:<10} {w:<18} {e:>13.1f} {base} {ratio}", flush=True)
    print("(n=8 shared: baseline column = the same batch with distinct prompts, speed-up = distinct / shared time; "
          "overlap on/off: baseline column = the engine with overlap off)")
    print(f"\n{'config':<10} {'batch':<8} {'model ms':>10} {'sampler ms':>10} {'step ms':>10} {'steady ms':>10} "
          f"{'decode tok/s':>12}")
    print("\n".join(parts))
    print("(model: the decode step alone; sampler: sampling and the copy to the host; step: the engine's whole "
          "step, --gen tokens of b requests, their prefill included; steady: a step with the prefill taken out, "
          "(time of 2 x gen tokens - time of gen) / gen, and the batch's tokens/s at that step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small_50m"], choices=sorted(PRESETS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="also time weight sync (starts a local Ray cluster)")
    ap.add_argument("--sync-only", action="store_true", help="only the weight sync table")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--paths", nargs="+", default=["object_store", "broadcast", "disk", "shared"],
                    choices=["object_store", "broadcast", "disk", "shared"], help="the sync paths to time")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="also each batch with the engine reading every step before launching the next")
    ap.add_argument("--no-graphs", action="store_true", help="the decode step eager on CUDA too (the A/B)")
    ap.add_argument("--kv-quant", choices=["fp8"], help="KV-QAT: the engine's key cache in FP8 (the A/B)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    graphs = "CUDA graphs" if gpu and not args.no_graphs else "eager"
    print(f"device {dev}; prompt {args.prompt} tokens, {args.gen} generated, median of {args.repeats}; {graphs}"
          + ("; FP8 key cache" if args.kv_quant else ""))
    if not args.sync_only:
        generation_tables(args, dev)
    if args.sync or args.sync_only:
        print(f"\n{'config':<10} {'sync path':<26} {'GB':>8} {'seconds':>9} {'GB/s':>8}")
        for name in args.configs:
            for c, p, gb, s, rate in sync_rows(name, args, gpu):
                print(f"{c:<10} {p:<26} {gb:>8.3f} {s:>9.3f} {rate:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
