"""What the job system costs: the tiny job through the controller against the bare worker
step on the same batches, in one run.

    .venv/bin/python benchmarks/controller_cpu.py [--steps 30] [--job jobs/demo_tiny.yaml] [KEY=VALUE ...]

Per step of the job (the controller, a local Ray cluster, wandb as the job file says):
- the bare worker step: train_step timed inside the worker (perf/worker_time), on the
  micro-batches this step's data gave;
- the Ray call around it (perf/train_time: object store, actor call, result);
- the whole step: the time between consecutive metric records, so it adds the data source,
  micro-batching, metrics.jsonl, wandb and the terminal.
Each step is compared with its own bare time (machine noise hits both alike); medians over
the steps after the first two (warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from miles.config import load_job
from miles.controller import run
from miles.observe.metrics import Monitor

ROOT = Path(__file__).resolve().parents[1]


def timed_run(job) -> list[dict]:
    """The job's history, each step with the seconds since the previous metric record."""
    stamps = []
    log = Monitor.log

    def timed_log(self, step, metrics):
        log(self, step, metrics)
        stamps.append(time.perf_counter())

    Monitor.log = timed_log
    try:
        with open("/dev/null", "w") as quiet:
            history = run(job, stream=quiet).history
    finally:
        Monitor.log = log
    return [dict(h, whole=b - a) for a, b, h in zip(stamps, stamps[1:], history[1:], strict=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "demo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("overrides", nargs="*", help="job overrides, e.g. cluster.cpus_per_worker=2")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = load_job(a.job, [f"train.steps={a.steps}", f"log.run_dir={tmp}/run", "data.eval_size=0",
                               "ckpt.save_hf=false", *a.overrides])
        steps = timed_run(job)[1:]  # steps 3..N
    tokens = steps[0]["perf/tokens"]
    rows = [("bare worker train_step (inside the worker)", "perf/worker_time"),
            ("train_step through Ray (object store, actor call)", "perf/train_time"),
            ("whole step through the controller", "whole")]
    print(f"tiny job ({job.model.preset}), {job.train.global_batch_size} x {job.data.seq_len} tokens per step, "
          f"{a.steps} steps, {job.cluster.cpus_per_worker:g} CPU(s) per worker, wandb {job.log.wandb.mode}; "
          f"medians of steps 3-{a.steps}")
    print("| path | step ms | tokens/s | vs bare (per step) |")
    print("|---|---|---|---|")
    for name, key in rows:
        t = statistics.median(s[key] for s in steps)
        ratio = statistics.median(s[key] / s["perf/worker_time"] for s in steps)
        print(f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {ratio:.3f} |")
    share = statistics.median((s["whole"] - s["perf/worker_time"]) / s["whole"] for s in steps)
    ray_share = statistics.median((s["perf/train_time"] - s["perf/worker_time"]) / s["whole"] for s in steps)
    print(f"overhead of the controller, data and Ray: {share:.1%} of the step (the Ray call {ray_share:.1%}; "
          f"goal < 5%)")


if __name__ == "__main__":
    main()
