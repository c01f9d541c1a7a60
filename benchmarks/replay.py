"""Replay's effect on the engine-trainer gap (issue 56): one RL job run three times from the
same weights and seeds (so rollout 1 samples the same responses in each): no replay, the
engines' experts replayed (`algo.routing_replay`), and the experts and the indexer's entries
(`algo.indexer_replay` too); one table of each rollout's first update.

    python3 benchmarks/replay.py --job jobs/dapo_gpu.yaml --hf <the SFT job's run>/hf [--steps 4]
    .venv/bin/python benchmarks/replay.py [--steps 3]      # the tiny CPU job (fp32: gaps ~1e-7)

Per rollout, at its first update (the policy that generated, on-policy modes): the mean and
largest |trainer - engine| log-prob per trained token, KL(engine || trainer) by k3, and where
replayed the share of (token, MoE layer) pairs whose experts, and of compressed entries that,
the trainer's own router and indexer would have chosen otherwise (what replay removes).
Evaluation and checkpoints are off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rl_cpu import base_overrides, history  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GAP = [("mean |diff|", "train_rollout_logprob_abs_diff"), ("max |diff|", "train_rollout_logprob_abs_diff_max"),
       ("k3 KL", "train_rollout_k3_kl")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "dapo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hf", help="start weights (DeepSeek HF layout), e.g. the SFT job's output")
    ap.add_argument("overrides", nargs="*", help="job overrides for both runs")
    a = ap.parse_args()
    base = base_overrides(a)
    modes = {"none": ["algo.routing_replay=false"], "experts": ["algo.routing_replay=true"],
             "experts + indexer": ["algo.routing_replay=true", "algo.indexer_replay=true"]}
    runs = {mode: history(a.job, [*base, *extra]) for mode, extra in modes.items()}
    print(f"{Path(a.job).name}, first update of each rollout; weights {'from ' + a.hf if a.hf else 'random'}\n")
    print("| replay | rollout | " + " | ".join(name for name, _ in GAP) + " | experts differ | entries differ |")
    print("|---|---|" + "---|" * (len(GAP) + 2))
    for mode, rows in runs.items():
        for k, r in enumerate(rows[:a.steps]):
            first = {key: r.get(f"train/first_update/{key}", float("nan")) for key in
                     [key for _, key in GAP] + ["router_replay_disagreement", "indexer_replay_disagreement"]}
            shares = [first["router_replay_disagreement"], first["indexer_replay_disagreement"]]
            print(f"| {mode} | {k + 1} | " + " | ".join(f"{first[key]:.2e}" for _, key in GAP) + " | "
                  + " | ".join("-" if x != x else f"{x:.2%}" for x in shares) + " |")

if __name__ == "__main__":
    main()
