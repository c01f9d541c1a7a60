"""`miles sft` against the trainer alone, on the same rows (issue 53's goal: the job at >= 90%
of the trainer's tokens/s on one GPU).

    python3 benchmarks/sft_gpu.py [--seq 4096] [--batch 2] [--steps 10]
    .venv/bin/python benchmarks/sft_gpu.py --device cpu --preset tiny --seq 256 --steps 4   # the path, on CPU
    python3 benchmarks/sft_gpu.py --profile 8   # also step 8 profiled in each, side by side

Writes a JSONL of long conversations (random words, one conversation a packed row of about
0.9 x --seq tokens), then
1. the trainer alone: one TrainWorker in this process, built as the job builds its workers,
   trains on the very micro-batches the job's data source gives for each step (the same
   SFTSource, seed and packing), timed around train_step;
2. the same inside a Ray actor with the job's worker resources (cluster.cpus_per_worker CPUs,
   one GPU): what the actor's process costs (Ray's OMP_NUM_THREADS, its threads), the job's
   own work apart;
3. `miles sft jobs/sft_gpu.yaml` with that data on a local Ray cluster: tokens / step time
   of each step from its metrics.jsonl (the controller, Ray and batching included).
Medians after --warmup steps; the ratio is the job's share of the trainer's speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.config import load_job  # noqa: E402
from miles.controller import layout_batch  # noqa: E402
from miles.data.chat import tokenize_conversation  # noqa: E402
from miles.data.sft import SFTSource, tokenizer_path  # noqa: E402
from miles.session import worker_setup  # noqa: E402
from miles.train.worker import TrainWorker  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "number", "seven", "river", "stone", "light", "cloud", "apple",
         "green", "table", "window", "answer", "question", "small", "large", "first", "second"]


def write_conversations(path: Path, n: int, seq: int, seed: int) -> float:
    """n conversations of about 0.9 x seq tokens (the tiny tokenizer); returns their mean length."""
    rng = random.Random(seed)

    def conversation(words: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words // 2))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(words - words // 2))}]

    tok = tokenizer_path("tiny")
    per_word = len(tokenize_conversation(conversation(400), tok)[0]) / 400
    words = int(0.9 * seq / per_word)
    rows = [conversation(words) for _ in range(n)]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return statistics.mean(len(tokenize_conversation(m, tok)[0]) for m in rows[:8])


def trainer_alone(job, steps: int, warmup: int, run_dir: Path, profile: int = 0) -> list[tuple[int, float]]:
    """(tokens, seconds of train_step) of each step: one in-process worker on the job's own
    micro-batches; step `profile` (0: none) under the worker's profiler, as the job's
    log.profile runs it (<run_dir>/profile/rank0.json)."""
    if job.cluster.device == "cpu":  # as many threads as Ray gives the job's worker (its CPUs)
        torch.set_num_threads(max(1, int(job.cluster.cpus_per_worker)))
    w = TrainWorker(0, 1)
    w.init_distributed(*w.rendezvous_address())
    for method, args, kwargs in worker_setup(job):  # as the job's workers are set up
        getattr(w, method)(*args, **kwargs)
    data = SFTSource(job.data, job.train.seed, run_dir)
    out = []
    for step in range(1, steps + 1):
        samples = data.batch(step, job.train.global_batch_size)
        mbs = layout_batch(job, samples)[0]
        if step == profile:
            w.start_profile(str(run_dir / "profile"))
        t0 = time.perf_counter()
        w.train_step(mbs)  # returns its metrics as host numbers: the step has finished
        if step == profile:
            w.stop_profile()
        if step > warmup and step != profile:  # the profiled step is not timed with the others
            out.append((sum(len(s.tokens) - 1 for s in samples), time.perf_counter() - t0))
    data.close()
    w.shutdown()
    return out


def trainer_in_actor(job, steps: int, warmup: int, run_dir: Path, profile: int = 0
                     ) -> tuple[list[tuple[int, float]], int]:
    """trainer_alone() inside a Ray actor with the job's worker resources; also the actor's
    torch CPU threads."""
    import ray

    ray.init(num_cpus=max(2, int(job.cluster.cpus_per_worker) + 1), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        @ray.remote(num_cpus=job.cluster.cpus_per_worker, num_gpus=1 if job.cluster.device == "gpu" else 0)
        def run():
            threads = torch.get_num_threads()  # as Ray starts it (trainer_alone sets a CPU job's)
            return trainer_alone(job, steps, warmup, run_dir, profile), threads

        return ray.get(run.remote())
    finally:
        ray.shutdown()


def trace_summary(path: Path) -> dict[str, float]:
    """One profiled step's Chrome trace in a few numbers: the GPU's kernel time and the span
    from its first kernel to its last, the host's launches and the time it spent in CUDA's
    runtime calls, and the host ops that took longest (an op's time includes the ops inside it)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    out = {"kernel ms": sum(e["dur"] for e in kernels) / 1e3,
           "kernel span ms": (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3
           if kernels else 0.0,
           "kernels": float(len(kernels)),
           "launches": float(sum("Launch" in e["name"] for e in runtime)),
           "runtime calls ms": sum(e["dur"] for e in runtime) / 1e3,
           "synchronize ms": sum(e["dur"] for e in runtime if "Synchronize" in e["name"]) / 1e3}
    host = [e for e in events if e.get("cat") == "cpu_op"]
    out["host ops span ms"] = ((max(e["ts"] + e["dur"] for e in host) - min(e["ts"] for e in host)) / 1e3
                               if host else 0.0)
    ops: dict[str, float] = {}
    for e in host:  # nested ops count in their parents too
        ops[e["name"]] = ops.get(e["name"], 0.0) + e["dur"] / 1e3
    out.update({f"  {k[-38:]} ms": v for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:8]})  # names end apart
    return out


def print_profiles(traces: dict[str, Path]) -> None:
    """The summaries of the same step profiled alone, in an actor and in the job, side by side."""
    sums = {name: trace_summary(p) for name, p in traces.items() if p.exists()}
    missing = [name for name, p in traces.items() if not p.exists()]
    print(f"\none step under the profiler{' (no trace: ' + ', '.join(missing) + ')' if missing else ''}")
    print(f"{'':44}" + "".join(f"{name:>14}" for name in sums))
    for key in dict.fromkeys(k for d in sums.values() for k in d):
        print(f"{key:44}" + "".join(f"{d[key]:14.1f}" if key in d else f"{'-':>14}" for d in sums.values()))


def whole_job(job_file: str, overrides: list[str], run_dir: Path, warmup: int, profile: int = 0) -> list[dict]:
    """Each step's perf/ metrics of `miles sft`: tokens, step_time (data, batching, the Ray call
    and the step), data_time, train_time (the Ray call) and worker_time (the step inside the
    worker)."""
    cmd = [sys.executable, "-m", "miles.cli", "sft", job_file, *overrides, f"log.run_dir={run_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"miles sft failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k[5:]: v for k, v in r.items() if k.startswith("perf/")} for r in rows
            if "perf/step_time" in r and r["step"] > warmup and r["step"] != profile]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="positions per packed row")
    ap.add_argument("--batch", type=int, default=2, help="rows (conversations) per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out (compiles, allocator)")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--preset", choices=["small_50m", "tiny"], default="small_50m")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more job overrides for all three runs (e.g. model.cuda_graphs=true)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEP",
                    help="profile this step alone, in the actor and in the job (the job's log.profile) and compare")
    a = ap.parse_args()
    if not 0 <= a.profile <= a.steps:
        ap.error(f"--profile {a.profile}: give a step in 1..{a.steps} (0: none)")
    tmp = Path(tempfile.mkdtemp(prefix="sft_gpu-"))
    mean_len = write_conversations(tmp / "long.jsonl", 4 * a.batch * a.steps, a.seq, seed=0)
    dtype = "bfloat16" if a.device == "gpu" else "float32"
    overrides = [f"cluster.device={a.device}", f"model.preset={a.preset}", f"model.dtype={dtype}",
                 f"model.overrides.max_position_embeddings={max(a.seq, 4096)}", f"data.path={tmp / 'long.jsonl'}",
                 "data.eval_path=null", "data.eval_size=0", f"data.seq_len={a.seq}",
                 f"train.global_batch_size={a.batch}", "train.micro_batch_size=1", f"train.steps={a.steps}",
                 "ckpt.save_hf=false", "log.wandb.mode=disabled", "log.interval=1", *a.set]
    job_file = str(ROOT / "jobs" / "sft_gpu.yaml")
    job = load_job(job_file, overrides)
    threads = torch.get_num_threads()
    alone = trainer_alone(job, a.steps, a.warmup, tmp / "alone", a.profile)
    actor, actor_threads = trainer_in_actor(job, a.steps, a.warmup, tmp / "actor", a.profile)
    if a.profile:
        overrides += ["log.profile.enabled=true", f"log.profile.start_step={a.profile}", "log.profile.ranks=[0]"]
    steps = whole_job(job_file, overrides, tmp / "job", a.warmup, a.profile)
    med_alone = statistics.median(t / s for t, s in alone)
    med_actor = statistics.median(t / s for t, s in actor)
    med_job = statistics.median(r["tokens"] / r["step_time"] for r in steps)
    print(f"{a.preset} {dtype} on {a.device}: {a.batch} rows of up to {a.seq} positions a step (conversations of "
          f"{mean_len:.0f} tokens), medians of steps {a.warmup + 1}-{a.steps}\n")
    print(f"{'':34}{'tokens/s':>12}")
    print(f"{'trainer alone (one worker here)':34}{med_alone:12,.0f}   torch CPU threads {threads}")
    print(f"{'trainer alone in a Ray actor':34}{med_actor:12,.0f}   torch CPU threads {actor_threads}")
    print(f"{'miles sft (controller, Ray, data)':34}{med_job:12,.0f}")
    print(f"{'miles sft / trainer alone':34}{med_job / med_alone:12.1%}   (goal >= 90%)")
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    print(f"\nwhere a step's time goes, ms: the job's {ms([r['step_time'] for r in steps]):.1f} against the trainer "
          f"alone's {ms([s for _, s in alone]):.1f} (in an actor {ms([s for _, s in actor]):.1f})")
    print(f"  data and batching (driver)      {ms([r['data_time'] for r in steps]):8.1f}")
    print(f"  the Ray call around the step    {ms([r['train_time'] - r['worker_time'] for r in steps]):8.1f}")
    print(f"  the step inside the worker      {ms([r['worker_time'] for r in steps]):8.1f}")
    if a.profile:
        print_profiles({"alone": tmp / "alone" / "profile" / "rank0.json",
                        "in an actor": tmp / "actor" / "profile" / "rank0.json",
                        "the job": tmp / "job" / "profile" / f"steps{a.profile}-{a.profile}" / "rank0.json"})

if __name__ == "__main__":
    main()
