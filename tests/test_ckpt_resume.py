"""Resume is bitwise, and no crash loses a checkpoint: real jobs (`miles run` processes) on a
real token-auth Ray cluster, killed with SIGKILL, resumed with ckpt.load: auto, compared
with `miles check-alignment` (losses and gradient checksums of every step)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ckpt import store

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
JOB = ["jobs/demo_tiny.yaml", f"train.steps={STEPS}", "train.parallel.dp=2", "train.global_batch_size=8",
       "train.micro_batch_size=2", "train.deterministic=true", "train.optim.warmup_steps=2",
       "data.seq_len=32", "data.eval_size=0", "ckpt.save_hf=false", "log.alignment=true",
       "log.wandb.mode=disabled", "log.interval=1"]


@pytest.fixture(scope="module")
def cluster():
    from miles.cluster.local import local_cluster

    with local_cluster(num_cpus=2, log=lambda _: None) as c:
        yield c


def _args(cluster, run_dir: Path, *extra: str) -> list[str]:
    return ["run", *JOB, f"cluster.address={cluster.gcs}", f"log.run_dir={run_dir}", *extra]


def _miles(cluster, args: list[str], prefix: list[str] = (), check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *prefix] if prefix else [sys.executable, "-m", "miles.cli"]
    p = subprocess.run(cmd + args, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


ALIGNED = (f"main_matches={STEPS}/{STEPS} lm_matches={STEPS}/{STEPS} mtp_matches={STEPS}/{STEPS} "
           f"indexer_matches={STEPS}/{STEPS} first_diff=none")


def _aligned(a: Path, b: Path) -> str:
    p = subprocess.run([sys.executable, "-m", "miles.cli", "check-alignment", str(a), str(b)], cwd=ROOT,
                       capture_output=True, text=True)
    return p.stdout.strip()


@pytest.fixture(scope="module")
def straight(cluster, tmp_path_factory) -> Path:
    """The 12 steps in one go; it also profiles step 3 on both data-parallel ranks."""
    run = tmp_path_factory.mktemp("straight") / "run"
    _miles(cluster, _args(cluster, run, "log.profile.enabled=true", "log.profile.start_step=3",
                          "log.profile.ranks=[0, 1]"))
    return run


def test_a_profile_window_traces_each_rank_it_names(straight):
    """log.profile.ranks: a trace per named rank of a multi-rank job, each holding the step."""
    for rank in (0, 1):
        trace = straight / "profile" / "steps3-3" / f"rank{rank}.json"
        names = {str(e.get("name", "")) for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names), f"rank {rank}: no backward"


def test_kill_9_after_step_5_and_auto_resume_is_bitwise(cluster, straight, tmp_path):
    """12 steps straight vs 5 steps, SIGKILL of the job (mid-step 6 or 7), ckpt.load: auto and
    7 more steps, DP=2 workers: check-alignment 12/12 (loss and gradient bits)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", *_args(cluster, run, "ckpt.save_interval=5")],
                            cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tracker = run / "checkpoints" / store.TRACKER
    deadline = time.time() + 400
    while not (tracker.is_file() and tracker.read_text().strip() == "5"):
        assert proc.poll() is None, f"the job ended before its step-5 save:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, "no step-5 checkpoint in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_before = [json.loads(x)["step"] for x in (run / "alignment.jsonl").read_text().splitlines()]
    assert steps_before[:5] == [1, 2, 3, 4, 5] and max(steps_before) < STEPS
    out = _miles(cluster, _args(cluster, run, "ckpt.save_interval=5", "ckpt.load=auto")).stdout
    assert "resumed from" in out and "iter_0000005" in out and "next step 6" in out, out[-2000:]
    assert _aligned(straight, run) == ALIGNED
    assert store.iterations(run / "checkpoints") == [5, 10, 12]  # the warm-up save reaped


def test_a_crash_at_any_instant_of_a_save_loses_nothing(cluster, straight, tmp_path):
    """save_interval 2; the job is SIGKILLed inside the save of iteration 4 before its rename,
    of 6 after the rename, of 8 before the tracker. Each restart (ckpt.load: auto) removes the
    debris and resumes from the newest complete checkpoint (2, 6, 8); the finished run equals
    the straight one step for step."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for point, it, resumes in (("before_rename", 4, None), ("after_rename", 6, 2), ("before_tracker", 8, 6)):
        p = _miles(cluster, _args(cluster, run, "ckpt.save_interval=2", "ckpt.load=auto"),
                   prefix=["tests/helpers/kill_at.py", point, str(it), "--"], check=False)
        assert p.returncode == -signal.SIGKILL, f"{point}: exited {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
        if resumes is not None:
            assert f"resumed from {ckpts / f'iter_{resumes:07d}'}" in p.stdout, p.stdout[-2000:]
        complete = store.iterations(ckpts)
        if point == "before_rename":
            assert (ckpts / ".tmp-iter_0000004").is_dir() and complete[-1] == 2
        if point == "after_rename":
            assert complete[-1] == 6 and (ckpts / store.TRACKER).read_text().strip() == "4"
        if point == "before_tracker":
            assert complete[-1] == 8 and (ckpts / store.TRACKER).read_text().strip() == "6"
    out = _miles(cluster, _args(cluster, run, "ckpt.save_interval=2", "ckpt.load=auto")).stdout
    assert f"resumed from {ckpts / 'iter_0000008'}" in out and "tracker updated" in out, out[-2000:]
    assert not list(ckpts.glob(".tmp-*"))
    assert _aligned(straight, run) == ALIGNED
