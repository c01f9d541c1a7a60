"""Where an RL step's time goes, and what one-step-off generation saves: the tiny DAPO job
run synchronously and one-step-off, one after the other, in one run.

    .venv/bin/python benchmarks/rl_cpu.py [--steps 12] [--hf RUN/hf] [--job jobs/dapo_tiny.yaml] [KEY=VALUE ...]

--hf: start weights (the demo's SFT stage, e.g. runs/demo-*/sft/hf), so responses have the
demo's lengths; without it a random model answers at full length and never right, so dynamic
sampling is turned off. Evaluation and checkpoints are off. Per step (medians of the steps
after the first two):
- generation: the rollout's wall time (requests through the router, rewards, dynamic-sampling
  rounds); the loop waits for it only where it did not overlap with training;
- reward: the verifier's share of generation;
- log-probs: the old (and reference) forwards; training: the optimizer steps;
- weight sync: trainer -> engines;
- controller and Ray: the rest of the step (samples, packing, metrics, rollouts.jsonl);
- trainer idle, engines idle: each side's time in the step without work of its own
  (perf/trainer_idle_time, perf/engine_idle_time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from miles.config import load_job
from miles.rl.loop import run_rl

ROOT = Path(__file__).resolve().parents[1]
PARTS = [("generation (wall)", "perf/rollout_time"), ("  of which reward", "perf/reward_time"),
         ("waited for generation", "perf/rollout_wait_time"), ("old log-probs", "perf/logprob_time"),
         ("training", "perf/train_time"), ("weight sync", "perf/update_weights_time")]
IDLE = [("trainer idle", "perf/trainer_idle_time"), ("engines idle", "perf/engine_idle_time")]


def history(job_path: str, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, open("/dev/null", "w") as quiet:
        job = load_job(job_path, [*overrides, f"log.run_dir={tmp}/run"])
        return run_rl(job, stream=quiet).history


def other(s: dict) -> float:
    busy = sum(s[k] for k in ("perf/rollout_wait_time", "perf/logprob_time", "perf/train_time",
                              "perf/update_weights_time"))
    return s["perf/step_time"] - busy


def base_overrides(a: argparse.Namespace) -> list[str]:
    """--steps rollouts, no evaluation, checkpoints or wandb, --hf's weights (without them dynamic
    sampling off: a random model never answers right), then the user's overrides."""
    return [f"train.steps={a.steps}", "data.eval_path=null", "ckpt.save_interval=0", "log.wandb.mode=disabled",
            *([f"ckpt.hf={a.hf}"] if a.hf else ["rollout.dynamic_sampling=false"]), *a.overrides]


def print_table(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """A markdown table of the parts' medians, a column per run; returns the medians."""
    keys = [k for _, k in PARTS + IDLE] + ["perf/step_time"]
    med = {m: {k: statistics.median(s.get(k, float("nan")) for s in steps) for k in keys} for m, steps in runs.items()}
    print("| part | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name, key in PARTS:
        print(f"| {name} | " + " | ".join(f"{med[m][key]:.2f}" for m in runs) + " |")
    print("| controller and Ray | " + " | ".join(f"{statistics.median(map(other, s)):.2f}" for s in runs.values())
          + " |")
    print("| **whole step** | " + " | ".join(f"**{med[m]['perf/step_time']:.2f}**" for m in runs) + " |")
    for name, key in IDLE:
        print(f"| {name} | " + " | ".join(f"{med[m][key]:.2f}" for m in runs) + " |")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "dapo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hf", help="start weights (DeepSeek HF layout), e.g. the demo's SFT output")
    ap.add_argument("overrides", nargs="*", help="job overrides, e.g. rollout.rollout_batch_size=32")
    a = ap.parse_args()
    if a.steps < 4:
        ap.error("--steps must be at least 4 (the first two are warm-up)")
    base = base_overrides(a)
    runs = {mode: history(a.job, [*base, f"rollout.off_policy={mode == 'one-step-off'}"])[2:]
            for mode in ("synchronous", "one-step-off")}
    job = load_job(a.job, base)
    r = job.rollout
    print(f"{job.name}: {r.rollout_batch_size} prompts x {r.n_samples_per_prompt} samples per rollout, "
          f"{job.updates_per_rollout} optimizer steps each, weights {'from ' + a.hf if a.hf else 'random'}; "
          f"medians of steps 3-{a.steps} (seconds)")
    med = print_table(runs)
    s = med["synchronous"]
    sync, off = s["perf/step_time"], med["one-step-off"]["perf/step_time"]
    ideal = sync / max(s["perf/rollout_time"], sync - s["perf/rollout_wait_time"])  # the longer of the two overlaps
    print(f"one-step-off speed-up: {sync / off:.2f}x (staleness 1; {ideal:.2f}x if generation and the rest of "
          "the step overlapped fully)")


if __name__ == "__main__":
    main()
