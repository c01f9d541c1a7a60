"""Monitoring pieces on their own: the metrics log, the terminal display, wandb's mode, report errors."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from miles.config import LogConfig
from miles.observe import metrics, report


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_off_a_terminal_and_a_bar_on_one(tmp_path):
    """Guards a log that floods a file or a bar written into a log: off a terminal one line per
    `interval` steps (and the first and last); on a terminal a progress bar; metrics.jsonl
    gets every step either way, NaN kept as null and reported."""
    cfg = LogConfig(interval=3, wandb={"mode": "disabled"})
    out = io.StringIO()
    (tmp_path / "a").mkdir()
    m = metrics.Monitor(cfg, tmp_path / "a", 7, {}, out)
    for step in range(1, 8):
        m.log(step, {"train/loss": 1.0 / step, "train/grad_norm": math.nan if step == 5 else 1.0})
    m.close()
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("step")]
    assert [ln.split()[1] for ln in lines] == ["1/7", "3/7", "5:", "6/7", "7/7"], out.getvalue()
    assert "non-finite train/grad_norm" in out.getvalue()
    recs = metrics.read(tmp_path / "a")
    assert [r["step"] for r in recs] == list(range(1, 8)) and recs[4]["train/grad_norm"] is None

    term = Terminal()
    (tmp_path / "b").mkdir()
    m = metrics.Monitor(LogConfig(wandb={"mode": "disabled"}), tmp_path / "b", 4, {}, term)
    for step in range(1, 5):
        m.log(step, {"train/loss": 2.0})
    m.close()
    assert "4/4" in term.getvalue() and "|" in term.getvalue() and "step     1" not in term.getvalue()


def test_an_rl_step_line_shows_reward_and_accuracy():
    """An RL run's terminal line shows what it is trained for: the rollout's raw reward and
    accuracy and each held-out accuracy (eval/<name>/accuracy), beside the loss."""
    text = metrics.line({"train/loss": 0.25, "rollout/raw_reward": -0.5, "rollout/accuracy": 0.25,
                         "eval/aime/accuracy": 0.125, "eval/aime/response_len": 40.0, "perf/train_tok_per_s": 900.0})
    assert text == "loss 0.2500  reward -0.500  acc 25.0%  900 tok/s  aime acc 12.5%", text


def test_online_without_a_key_logs_offline(tmp_path, monkeypatch):
    """wandb online needs WANDB_API_KEY: without it the run is logged offline (nothing lost)
    and the terminal says how to upload it later."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = io.StringIO()
    m = metrics.Monitor(LogConfig(wandb={"mode": "online", "project": "p"}), tmp_path, 1, {"a": 1}, out)
    m.log(1, {"train/loss": 1.0})
    m.close()
    assert "WANDB_API_KEY is not set; logging offline" in out.getvalue()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """Guards a resume opening a new wandb run each time: the run directory keeps its wandb run
    id, and a second monitor on it (a resume) logs into the same run id; another run
    directory gets another id."""
    runs = []
    for run_dir in (tmp_path / "a", tmp_path / "a", tmp_path / "b"):
        m = metrics.Monitor(LogConfig(wandb={"mode": "offline", "project": "p"}), run_dir, 2, {}, io.StringIO())
        runs.append(m.wandb.id)
        m.log(len(runs), {"train/loss": 1.0})
        m.close()
    assert runs[0] == runs[1] != runs[2]
    assert (tmp_path / "a" / metrics.WANDB_ID).read_text().strip() == runs[0]
    assert {p.name.rsplit("-", 1)[-1] for p in (tmp_path / "a" / "wandb").glob("offline-run-*")} >= {runs[0]}


def test_bad_metrics_file_names_file_and_line(tmp_path):
    (tmp_path / metrics.FILE).write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        report.render(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics log"):
        report.render(tmp_path / "nothing")


def test_curves_skip_missing_and_non_finite_points():
    recs = [{"step": 1, "a": 1.0}, {"step": 2, "a": None, "b": 3}, {"step": 3, "a": 2.0, "b": float("nan")}]
    assert report.curves(recs) == {"a": ([1, 3], [1.0, 2.0]), "b": ([2], [3.0])}


def test_busy_time_in_a_window_is_the_union_of_the_spans_inside_it():
    """Engine work overlaps (a generation and a sync), crosses the window's edges, or is still
    running (end None): counted once, clipped to the window, open spans to its end."""
    import time

    from miles.observe.busy import Busy, busy_within

    assert busy_within([], 0.0, 10.0) == 0.0
    assert busy_within([(2.0, 5.0), (4.0, 6.0)], 0.0, 10.0) == 4.0  # overlapping: 2..6
    assert busy_within([(-3.0, 1.5), (9.0, None)], 0.0, 10.0) == 2.5  # clipped at both ends, open to b
    assert busy_within([(1.0, 2.0), (1.2, 1.8), (3.0, 3.5)], 0.0, 10.0) == 1.5  # nested
    assert busy_within([(11.0, 12.0), (-2.0, -1.0)], 0.0, 10.0) == 0.0  # outside
    busy = Busy()
    with busy.span():
        time.sleep(0.01)
    t0 = time.perf_counter()
    with busy.span():
        time.sleep(0.02)
        t1 = time.perf_counter()
        assert 0.015 < busy.within(t0, t1) <= t1 - t0  # the open span, to the window's end; not the first
    t2 = time.perf_counter()
    assert busy.within(t2, t2 + 1) == 0 and not busy._spans  # ended spans are dropped as windows move on


def test_phase_memory_is_the_largest_of_a_sides_processes_and_absent_on_cpus():
    """perf/<side>_peak_gb and _device_used_gb: the largest over trainer ranks (or engines);
    processes on CPUs report nothing and the metrics are left out, not logged as 0."""
    from miles.memory import device_memory, phase_metrics

    assert device_memory(None) == {} and device_memory("cpu") == {}
    assert phase_metrics("trainer", [{}, {}]) == {}
    reports = [{"peak_gb": 3.5, "device_used_gb": 9.0}, {"peak_gb": 4.25, "device_used_gb": 8.0}]
    assert phase_metrics("engine", reports) == {"perf/engine_peak_gb": 4.25, "perf/engine_device_used_gb": 9.0}


def test_a_job_starting_its_own_ray_prints_none_of_rays_start_up_lines(tmp_path):
    """A job without a cluster starts a local Ray: its start-up lines ("Token authentication
    is enabled ... Set RAY_AUTH_MODE=disabled to opt out", "Started a local Ray instance") are
    not the user's business, and the first advises turning the guard off. (In a process of
    its own: this one may have joined Ray already.)"""
    import subprocess
    import sys

    code = ("import sys, ray\n"
            "from miles.config import load_job\n"
            "from miles.session import ray_session\n"
            "job = load_job('jobs/demo_tiny.yaml', [f'log.run_dir={sys.argv[1]}', 'cluster.num_cpus=1'])\n"
            "with ray_session(job):\n"
            "    assert ray.is_initialized()\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert p.returncode == 0, p.stderr
    assert "RAY_AUTH_MODE" not in p.stderr and "Started a local Ray" not in p.stderr, p.stderr


def test_a_failed_run_says_why_in_its_directory(tmp_path):
    """failed.txt holds why the run stopped (a run directory with a config and an empty
    metrics.jsonl said nothing); nothing is written where the run never made its directory."""
    from miles.observe.records import FAILED, record_failure

    assert record_failure(tmp_path / "never-made", "x") is None and not (tmp_path / "never-made").exists()
    path = record_failure(tmp_path, "miles rl: algo.reward 'r:f' failed on the response 'a' (label '1')\n\n")
    assert path == tmp_path / FAILED and path.read_text() == "miles rl: algo.reward 'r:f' failed on the " \
                                                              "response 'a' (label '1')\n"


def test_the_end_of_an_offline_run_says_how_to_see_and_upload_it(monkeypatch, tmp_path):
    """The README promises a note on how to `wandb sync` an offline run later: the run's last
    lines say where it is, how to view it and how to upload it (also when online was asked
    for without a key, which logs offline)."""
    from miles.cli import wandb_note
    from miles.config import load_job

    job = load_job("jobs/demo_tiny.yaml", [f"log.run_dir={tmp_path}"])
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    note = wandb_note(job, tmp_path)
    assert f"wandb sync {tmp_path}/wandb/offline-run-*" in note and f"wandb leet {tmp_path}/wandb" in note
    job.log.wandb.mode = "online"
    assert "wandb sync" in wandb_note(job, tmp_path)  # no key: it logged offline
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_note(job, tmp_path) == f"wandb run: {tmp_path}/wandb (online)"


def test_the_overview_leads_with_reward_accuracy_and_loss():
    """37 panels alphabetically put data/epoch and perf/* before the reward: the curves a run
    is judged by come first, then each group alphabetically."""
    from miles.observe.report import panel_order

    names = ["perf/step_time", "data/epoch", "train/lr", "train/loss", "eval/arith/accuracy", "rollout/accuracy",
             "rollout/raw_reward", "train/entropy", "rollout/log_probs", "eval/arith/weight_version", "zzz"]
    assert panel_order(names) == ["rollout/raw_reward", "rollout/accuracy", "eval/arith/accuracy", "train/loss",
                                  "train/lr", "rollout/log_probs", "eval/arith/weight_version", "train/entropy",
                                  "data/epoch", "perf/step_time", "zzz"]


def test_the_default_profiled_ranks_are_the_pipelines_head_middle_and_tail():
    """log.profile.ranks unset: the first rank (TP, CP, DP rank 0) of the first, middle and last
    pipeline stage, in whatever order the layout numbers ranks."""
    from miles.observe.profiler import default_ranks

    def layout(pp: int, tp: int, dp: int) -> list[dict]:  # Megatron's order: tp fastest, then dp, pp slowest
        return [{"pp": pp, "pp_rank": r // (tp * dp), "dp_rank": r // tp % dp, "tp_rank": r % tp, "cp_rank": 0}
                for r in range(pp * tp * dp)]

    assert default_ranks(layout(1, 1, 1)) == [0]
    assert default_ranks(layout(1, 2, 2)) == [0]  # one stage: its first rank
    assert default_ranks(layout(2, 2, 1)) == [0, 2]
    assert default_ranks(layout(4, 2, 2)) == [0, 8, 12]
    assert default_ranks(layout(5, 1, 1)) == [0, 2, 4]
    swapped = list(reversed(layout(2, 1, 2)))  # ranks numbered otherwise: still each stage's (tp, cp, dp) = 0
    assert [swapped[r]["pp_rank"] for r in default_ranks(swapped)] == [0, 1]
    assert all(swapped[r]["dp_rank"] == 0 for r in default_ranks(swapped))
