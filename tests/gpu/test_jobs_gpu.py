"""Whole jobs on GPUs (skipped without CUDA; `make test-gpu`), each `miles` on a local Ray
cluster as a user runs it: SFT on one GPU with a checkpoint and its resume; DAPO colocated on
that GPU from the SFT's weights (trainer and engine taking turns); DAPO disaggregated on two
GPUs (NCCL broadcast, one-step-off) where two are there. The jobs print their times and the
trainer-engine log-prob gap (run with -s to see them)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="whole GPU jobs need CUDA")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    from miles.cluster.local import local_cluster

    with local_cluster(log=lambda _: None) as c:
        yield c


def _miles(cluster, command: str, job: str, run: Path, *extra: str) -> str:
    args = [sys.executable, "-m", "miles.cli", command, f"jobs/{job}.yaml", f"cluster.address={cluster.gcs}",
            f"log.run_dir={run}", "log.wandb.mode=disabled", *extra]
    p = subprocess.run(args, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, f"miles {command} {job} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    print(p.stdout[-2500:])
    return p.stdout


def _rows(run: Path) -> dict[int, dict]:
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert all(not isinstance(v, float) or math.isfinite(v) for v in r.values()), r  # nothing silently NaN
        rows[r["step"]] = rows.get(r["step"], {}) | r
    return rows


@pytest.fixture(scope="module")
def sft_run(cluster, tmp_path_factory) -> Path:
    """jobs/sft_gpu.yaml for 20 steps, checkpoints at 10 and 20, then resumed to 30."""
    run = tmp_path_factory.mktemp("sft")
    _miles(cluster, "sft", "sft_gpu", run, "train.steps=20", "ckpt.save_interval=10", "data.eval_interval=10")
    out = _miles(cluster, "sft", "sft_gpu", run, "train.steps=30", "ckpt.save_interval=10", "ckpt.load=auto",
                 "data.eval_interval=10")
    assert "resumed from" in out and "next step 21" in out, out[-2000:]
    return run


def test_sft_on_one_gpu_learns_saves_and_resumes(sft_run):
    rows = _rows(sft_run)
    assert sorted(rows) == list(range(31))
    evals = {k: r["eval/loss"] for k, r in rows.items() if "eval/loss" in r}
    assert list(evals) == [0, 10, 20, 30] and evals[30] < evals[10] < evals[0], evals
    assert (sft_run / "hf" / "config.json").is_file()


def test_dapo_colocated_on_one_gpu(cluster, sft_run, tmp_path):
    """The trainer and the engine share the GPU; every rollout is on-policy, so at its first
    update the trainer's bf16 log-probs are the engine's up to the two programs' rounding
    (the goal: a mean under 1e-3); each evaluation measures its step's weights."""
    run = tmp_path / "dapo"
    _miles(cluster, "rl", "dapo_gpu", run, f"ckpt.hf={sft_run / 'hf'}", "train.steps=4", "rollout.eval_interval=2",
           "rollout.eval_samples=2")
    rows = _rows(run)
    for k in (1, 2, 3, 4):
        r = rows[k]
        diff = r["train/first_update/train_rollout_logprob_abs_diff"]
        print(f"rollout {k}: first update |trainer - engine| log-prob {diff:.2e} (max "
              f"{r['train/first_update/train_rollout_logprob_abs_diff_max']:.2e}, k3 KL "
              f"{r['train/first_update/train_rollout_k3_kl']:.2e}), rollout "
              f"{r['perf/rollout_time']:.2f} s, train {r['perf/train_time']:.2f} s, sync "
              f"{r['perf/update_weights_time']:.2f} s, idle: trainer {r['perf/trainer_idle_time']:.2f} s, "
              f"engine {r['perf/engine_idle_time']:.2f} s; routing replay: {r['train/replayed_tokens']:.0f} "
              f"positions, {r['train/first_update/router_replay_disagreement']:.2%} of (token, layer) pairs the "
              "trainer's own router sends elsewhere at the first update")
        print(f"  GPU memory: training {r['perf/trainer_peak_gb']:.2f} GB peak ({r['perf/trainer_device_used_gb']:.2f} "
              f"GB in use on the GPU at its end), generation {r['perf/engine_peak_gb']:.2f} GB peak "
              f"({r['perf/engine_device_used_gb']:.2f} GB in use)")
        assert diff < 5e-2
        assert r["perf/trainer_peak_gb"] > 0 and r["perf/engine_peak_gb"] > 0
        assert r["rollout/wrong_weights"] == 0 and r["rollout/staleness"] == 0
    assert [rows[k]["eval/arith/weight_version"] for k in (0, 2, 4)] == [0.0, 2.0, 4.0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="disaggregated DAPO needs two GPUs")
def test_dapo_disaggregated_on_two_gpus(cluster, sft_run, tmp_path):
    """Trainer and engine on a GPU each, the weights broadcast over NCCL after every rollout,
    rollout k+1 generated while step k trains."""
    run = tmp_path / "dapo2"
    _miles(cluster, "rl", "dapo_gpu_2x", run, f"ckpt.hf={sft_run / 'hf'}", "train.steps=4", "rollout.eval_interval=0")
    rows = _rows(run)
    assert [rows[k]["rollout/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert rows[1]["train/first_update/train_rollout_logprob_abs_diff"] < 5e-2
    # one-step-off: step k sends version k-1 (rollout k+1's), so step 1 has nothing new to send;
    # steps 2 and 3 broadcast for the next rollout, step 4 for the final evaluation of its weights
    assert rows[1]["perf/update_weights_time"] == 0
    assert all(rows[k]["perf/update_weights_time"] > 0 for k in (2, 3, 4))
    assert rows[4]["eval/arith/weight_version"] == 4.0


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="the 4-GPU layout needs four GPUs")
def test_dapo_tensor_parallel_trainer_and_two_engines_on_four_gpus(cluster, sft_run, tmp_path):
    """jobs/dapo_gpu_4x.yaml: the trainer over two GPUs (TP=2), an engine on each of the other
    two; the full weights gathered from both TP ranks reach both engines, so at the first update
    of the on-policy rollout the trainer's log-probs are still the engines' (bf16 rounding)."""
    run = tmp_path / "dapo4"
    _miles(cluster, "rl", "dapo_gpu_4x", run, f"ckpt.hf={sft_run / 'hf'}", "train.steps=4", "rollout.eval_interval=0")
    rows = _rows(run)
    for k in (1, 2, 3, 4):
        r = rows[k]
        print(f"4 GPUs, rollout {k}: staleness {r['rollout/staleness']:.0f}, first update |trainer - engine| "
              f"log-prob {r['train/first_update/train_rollout_logprob_abs_diff']:.2e}, rollout "
              f"{r['perf/rollout_time']:.2f} s, train {r['perf/train_time']:.2f} s, sync "
              f"{r['perf/update_weights_time']:.2f} s")
        assert r["rollout/wrong_weights"] == 0
    assert [rows[k]["rollout/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert rows[1]["train/first_update/train_rollout_logprob_abs_diff"] < 5e-2
    assert rows[1]["perf/update_weights_time"] == 0
    assert all(rows[k]["perf/update_weights_time"] > 0 for k in (2, 3, 4))
    assert rows[4]["eval/arith/weight_version"] == 4.0
