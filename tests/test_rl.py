"""`miles rl` end to end on a real local Ray cluster (a Megatron trainer, an embedded engine
behind SGLang's router, the bundled arithmetic prompts): the first rollout is on-policy (the
trainer's log-probs are the engine's), colocated and disaggregated placements compute the
same step, the one-step-off mode runs with staleness 1, a SIGKILLed job resumes without
repeating or skipping a prompt."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from miles.ckpt import store  # noqa: E402
from miles.config import load_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Small and fast: 4 prompts x 4 samples, 2 optimizer steps per rollout (so the first one is
# checked against explicit old log-probs), no dynamic sampling (a random model is always wrong).
SMALL = ["train.global_batch_size=8", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_new_tokens=8", "rollout.max_len=48", "rollout.max_running=32", "rollout.dynamic_sampling=false",
         "rollout.over_sampling=1.0", "data.seq_len=256", "data.eval_path=null", "log.wandb.mode=disabled",
         "ckpt.save_interval=0", "algo.overlong_max_len=8", "algo.overlong_cache=2"]


@pytest.fixture(scope="module")
def cluster():
    from miles.cluster.local import local_cluster

    with local_cluster(num_cpus=4, log=lambda _: None) as c:
        yield c


def _rl(cluster, run_dir: Path, *extra: str, prefix: list[str] = (), check: bool = True):
    args = ["rl", "jobs/dapo_tiny.yaml", *SMALL, f"cluster.address={cluster.gcs}", f"log.run_dir={run_dir}", *extra]
    cmd = [sys.executable, *prefix] if prefix else [sys.executable, "-m", "miles.cli"]
    p = subprocess.run(cmd + args, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"miles rl exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_first_rollout_is_on_policy_and_placements_agree(cluster, tmp_path):
    """Step 1, fp32: the trainer's log-probs of the sampled tokens equal the engine's and the
    first update's ppo_kl is 0 (old log-probs from a separate forward); the colocated run
    (trainer asleep while the engine generates, engine memory released while it trains)
    samples the same responses and computes the same losses and gradient norms."""
    runs = {p: tmp_path / p for p in ("disaggregated", "colocated")}
    for placement, run in runs.items():
        _rl(cluster, run, "train.steps=1", f"rollout.placement={placement}")
    dis, col = _metrics(runs["disaggregated"])[0], _metrics(runs["colocated"])[0]
    for k, v in dis.items():
        assert v == v, f"{k} is NaN"  # nothing silently NaN
    assert dis["train/first_update/train_rollout_logprob_abs_diff"] <= 1e-5
    assert abs(dis["train/first_update/ppo_kl"]) <= 1e-6
    assert dis["train/updates"] == 2 and dis["rollout/staleness"] == 0
    for k in ("rollout/raw_reward", "rollout/response_len/mean", "rollout/log_probs", "train/loss", "train/pg_loss",
              "train/grad_norm", "train/ppo_kl", "train/entropy"):
        assert col[k] == pytest.approx(dis[k], rel=1e-6, abs=1e-9), k
    texts = [[s["text"] for s in json.loads(x)["samples"]] for x in
             ((r / "rollouts.jsonl").read_text() for r in runs.values())]
    assert texts[0] == texts[1], "the placements sampled different responses"


def test_one_step_off_job_killed_and_resumed_repeats_and_skips_no_prompt(cluster, tmp_path):
    """rollout.off_policy (rollout k+1 generated on the weights before step k while step k
    trains): staleness 0 for the first rollout of a process, 1 after; truncated IS on by
    default. SIGKILL right after the step-2 checkpoint is committed (rollout 3 is already
    drawing), then ckpt.load: auto: the run finishes its 4 rollouts, and the prompts drawn
    over both processes are exactly the source's stream, in order, none twice."""
    from miles.data.prompts import PromptSource

    run = tmp_path / "run"
    extra = ["train.steps=4", "ckpt.save_interval=2", "ckpt.load=auto", "rollout.off_policy=true"]
    p = _rl(cluster, run, *extra, prefix=["tests/helpers/kill_at.py", "after_rename", "2", "--"], check=False)
    assert p.returncode == -signal.SIGKILL, f"exited {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    assert store.iterations(run / "checkpoints")[-1] == 2
    out = _rl(cluster, run, *extra).stdout
    assert "resumed from" in out and "next step 3" in out, out[-2000:]
    recs = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    drawn = [i for r in recs for i in r["drawn"]]
    job = load_job(run / "config.yaml")
    src = PromptSource(job.data, job.train.seed, job.rollout.max_len - job.rollout.max_new_tokens, report=lambda _: 0)
    assert drawn == [p.id for p in src.batch(1, len(drawn))], "a prompt was repeated or skipped across the resume"
    assert [x["rollout/staleness"] for x in _metrics(run)] == [0.0, 1.0, 0.0, 1.0]  # the resume restarts the pipe
    assert job.algo.policy_options(job.rollout.off_policy)["tis_cap"] == 2.0


def test_bundled_rl_task_is_what_the_script_makes():
    """miles/data/bundled/arith/ is reproducible (scripts/make_arith.py --check), and the
    held-out prompts appear in neither the SFT nor the RL file."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_arith.py"), "--check"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    d = ROOT / "miles" / "data" / "bundled" / "arith"
    held = {json.loads(x)["prompt"] for x in (d / "eval.jsonl").read_text().splitlines()}
    rl = {json.loads(x)["prompt"] for x in (d / "train.jsonl").read_text().splitlines()}
    sft = {json.loads(x)["messages"][0]["content"] for x in (d / "sft.jsonl").read_text().splitlines()}
    assert len(held) == 64 and not held & rl and not held & sft
