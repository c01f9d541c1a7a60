"""One GPU DAPO step taken apart: jobs/dapo_gpu.yaml (trainer and engine colocated on one GPU)
and, where there are two GPUs, jobs/dapo_gpu_2x.yaml (a GPU each, NCCL broadcast,
one-step-off) and, where there are four, jobs/dapo_gpu_4x.yaml (a TP=2 trainer and two
engines), one after the other in one run, small_50m in bf16.

    python3 benchmarks/rl_gpu.py [--steps 8] [--hf RUN/hf] [KEY=VALUE ...]

--hf: start weights (jobs/sft_gpu.yaml's output, e.g. runs/sft_gpu-*/hf), so responses have
the trained lengths; without it a random model answers at full length and never right, so
dynamic sampling is turned off. Evaluation and checkpoints are off. Medians of the steps after
the first two, in seconds: the parts of benchmarks/rl_cpu.py, and each side's idle time in the
step (trainer: the step less its log-prob, training and sync calls; engines: the step less
their generation, evaluation and sync time inside it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rl_cpu import base_overrides, history, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hf", help="start weights (DeepSeek HF layout), e.g. jobs/sft_gpu.yaml's output")
    ap.add_argument("overrides", nargs="*", help="job overrides for both jobs, e.g. rollout.rollout_batch_size=32")
    a = ap.parse_args()
    if a.steps < 4:
        ap.error("--steps must be at least 4 (the first two are warm-up)")
    if not torch.cuda.is_available():
        ap.error("no GPU here: benchmarks/rl_cpu.py times the CPU job")
    base = base_overrides(a)
    jobs = {"colocated, 1 GPU": "dapo_gpu"}
    if torch.cuda.device_count() >= 2:
        jobs["disaggregated, 2 GPUs, one-step-off"] = "dapo_gpu_2x"
    if torch.cuda.device_count() >= 4:
        jobs["TP=2 trainer + 2 engines, 4 GPUs"] = "dapo_gpu_4x"
    runs = {mode: history(str(ROOT / "jobs" / f"{job}.yaml"), base)[2:] for mode, job in jobs.items()}
    print(f"small_50m DAPO on {torch.cuda.get_device_name()}; weights {'from ' + a.hf if a.hf else 'random'}; "
          f"medians of steps 3-{a.steps} (seconds)")
    print_table(runs)


if __name__ == "__main__":
    main()
