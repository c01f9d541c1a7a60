"""Jobs end to end: job files, `miles run`, the controller, metrics.jsonl, wandb, `miles report`.

The demo job runs as a user runs it: `miles run jobs/demo_tiny.yaml` in a subprocess that
starts its own local Ray cluster (shortened: 40 steps instead of 80).
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles import cli
from miles.config import JobConfigError, load_job, save_resolved

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo_tiny.yaml"
CHAT = ROOT / "miles" / "data" / "bundled" / "chat_tiny" / "eval.jsonl"
SHORT = ["train.steps=40", "train.optim.warmup_steps=4", "train.optim.lr=1.0e-2", "train.optim.min_lr=1.0e-3",
         "log.profile.enabled=true", "log.profile.start_step=2", "log.trace.enabled=true", "log.trace.steps=[3]",
         "log.trace.layers=[1, 2]"]


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a wandb run file (wandb 0.31 ships no Python reader). The file is
    ':W&B' + 3 header bytes, then LevelDB log records (32 KiB blocks; a chunk is crc32c(4),
    length(2), type(1: full, 2: first, 3: middle, 4: last)), each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file}: not a wandb run file"
    block, pos, rows, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("jobs") / "demo"
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "run", str(DEMO), *SHORT, f"log.run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


def test_demo_job_trains_logs_saves_and_generates(demo_run):
    """Guards a broken `make demo` and a silent monitoring path: through `miles run` the LM loss
    falls below 70% of its first value (measured 61%) and every logged value is finite; the
    weights land in DeepSeek's HF layout and, reloaded, continue held-out progressions far
    better than an untrained model (NLL under ln(vocab) - 1; an untrained model scores about
    ln(318) = 5.8 and 0 correct tokens); the resolved config reloads to the same job."""
    run_dir, proc = demo_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        for k, v in r.items():
            assert v is not None and math.isfinite(v), f"step {r['step']}: {k} = {v}"
    first, last = records[0], records[-1]
    assert last["train/lm_loss"] < 0.7 * first["train/lm_loss"], (first["train/lm_loss"], last["train/lm_loss"])
    assert last["train/loss"] < first["train/loss"]
    assert records[0]["train/lr"] < records[3]["train/lr"] == pytest.approx(1e-2), "warm-up to the peak"
    assert last["train/lr"] == pytest.approx(1e-3), "decayed to min_lr at the last step"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/synthetic/nll"] < math.log(318) - 1
    assert summary["eval/synthetic/accuracy"] >= 3 / 96, "a few continued tokens; chance is 1/318"
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / "hf" / "model.safetensors.index.json").is_file()
    assert "step    40/40" in proc.stdout, "one line per log.interval steps when not on a terminal"
    job = load_job(DEMO, [*SHORT, f"log.run_dir={run_dir}"])
    assert load_job(run_dir / "config.yaml") == job


def test_wandb_offline_run_holds_the_same_metrics(demo_run):
    """The wandb run (offline by default) records every step's metrics with the values of
    metrics.jsonl, read back out of the run file itself; config and run name come from the job."""
    run_dir, _ = demo_run
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows = [r for r in wandb_history(files[0]) if "train/loss" in r]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in rows] == [r["step"] for r in records]
    for row, rec in zip(rows, records, strict=True):
        for k, v in rec.items():
            if k != "step":
                assert row[k] == pytest.approx(v, rel=1e-12), f"step {rec['step']} {k}"


def test_report_writes_a_png_per_curve(demo_run, tmp_path):
    """`miles report` plots every logged curve: one PNG per metric plus an overview, each a
    real image (opened, non-blank)."""
    import matplotlib.image

    run_dir, _ = demo_run
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "report", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    keys = {k for line in (run_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)} - {"step"}
    pngs = sorted(out.glob("*.png"))
    assert {p.stem for p in pngs} == {k.replace("/", "_") for k in keys} | {"overview"}
    for p in pngs:
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, p
        assert img[..., :3].std() > 0.01, f"{p} is blank"


def test_profile_window_writes_a_trace(demo_run):
    """log.profile: a Chrome trace of the chosen step from rank 0, holding the step's forward
    ops and its backward."""
    run_dir, _ = demo_run
    trace = run_dir / "profile" / "steps2-2" / "rank0.json"
    names = {str(e.get("name", "")) for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names, "no forward ops in the window"
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names), "no backward in the window"


def test_a_trace_writes_the_chosen_layers_of_the_chosen_step(demo_run):
    """log.trace: step 3's forward through the CSA layer 1 and the HCA layer 2, rank 0, each
    as a safetensors file of the layer's internals, with the layout that replays it (the
    replay itself: tests/test_model.py)."""
    import torch
    from safetensors.torch import load_file

    run_dir, _ = demo_run
    assert sorted(p.name for p in (run_dir / "trace").iterdir()) == ["step3"]
    for layer in (1, 2):
        t = load_file(run_dir / "trace" / "step3" / "rank0" / f"layer{layer}.safetensors")
        assert {k.split(".", 1)[1] for k in t} == {"input", "q", "kv", "entries", "chosen", "lse", "output", "doc",
                                                   "pos", "rows"}
        b, s, d = t["0.input"].shape
        assert t["0.output"].shape == (b, s, d) and t["0.chosen"].dtype == torch.bool
        assert all(torch.isfinite(v).all() for k, v in t.items() if v.is_floating_point())


BAD_JOBS = [
    # (what, job file text, overrides, text the error must contain)
    ("unknown key", "train: {steps: 3, stepz: 4}\n", [], "train.stepz: unknown key"),
    ("a secret", "log: {wandb: {api_key: abc}}\n", [], "secrets never go in a job file: wandb reads WANDB_API_KEY"),
    ("wrong type", "train: {steps: ten}\n", [], "train.steps: Input should be a valid integer (got 'ten')"),
    ("out of range", "train: {optim: {lr: -0.1}}\n", [], "train.optim.lr: Input should be greater than 0 (got -0.1)"),
    ("missing path", "model: {config: /nonexistent/dsv4}\n", [], "model.config: no config.json at /nonexistent/dsv4"),
    ("not a choice", "cluster: {device: tpu}\n", [], "cluster.device: Input should be 'auto', 'cpu' or 'gpu'"),
    ("model field", "model: {preset: tiny, overrides: {hidden_size: 0}}\n", [], "model.overrides.hidden_size"),
    ("batch split", "train: {global_batch_size: 6, parallel: {dp: 4}}\n", [], "train.global_batch_size=6"),
    ("override type", "name: x\n", ["train.deterministic=maybe"],
     "train.deterministic: Input should be a valid boolean"),
    ("override syntax", "name: x\n", ["train.steps"], "expected KEY=VALUE"),
    ("not a mapping", "- 1\n- 2\n", [], "a job file is a mapping of groups"),
    ("warm-up too long", "train: {steps: 5, optim: {warmup_steps: 5}}\n", [],
     "train.optim.warmup_steps=5 must be below the run's 5 optimizer steps (train.steps=5)"),
    ("tp split", "train: {parallel: {tp: 3}}\n", [], "train.parallel.tp=3 must divide the model's"),
    ("ep from tp", "train: {parallel: {tp: 2, ep: 2}}\n", [], "train.parallel.ep=2 must divide dp*cp=1"),
    ("cp pieces", "data: {seq_len: 66}\ntrain: {parallel: {cp: 2, dp: 1}}\n", [],
     "data.seq_len=66 must be a multiple of 4"),
    ("profile rank", "log: {profile: {enabled: true, ranks: [4]}}\n", [], "log.profile.ranks [4] are not ranks"),
    ("trace layer", "log: {trace: {enabled: true, layers: [9]}}\n", [], "log.trace.layers [9] are not layers"),
    ("bad yaml override", "name: x\n", ["train.steps=[1"], "is not valid YAML"),
    ("unknown model field", "model: {overrides: {hidden_sise: 8}}\n", [], "model.overrides.hidden_sise: unknown"),
    ("chat without data", "data: {source: chat}\n", [], "data.path: missing"),
    ("no dataset there", "data: {source: chat, path: /nonexistent/d.jsonl}\n", [],
     "data.path: /nonexistent/d.jsonl: no such file or directory"),
    ("chat key on synthetic", "data: {eval_path: e.jsonl}\n", [], "data.eval_path: only for data.source: chat"),
    ("no tokenizer there", f"data: {{source: chat, path: {CHAT}, tokenizer: /nonexistent/t.json}}\n", [],
     "data.tokenizer: /nonexistent/t.json: no such tokenizer.json"),
    ("tokenizer too big", f"data: {{source: chat, path: {CHAT}}}\n", [],
     "data.tokenizer has 129280 ids but the model's vocab_size is 320"),
    ("bad effort", f"data: {{source: chat, path: {CHAT}, reasoning_effort: medium}}\n", [],
     "data.reasoning_effort: Input should be 'low', 'high', 'xhigh' or 'max'"),
]


@pytest.mark.parametrize("what,text,overrides,expect", BAD_JOBS, ids=[b[0] for b in BAD_JOBS])
def test_bad_job_fails_before_ray_naming_the_field(tmp_path, monkeypatch, capsys, what, text, overrides, expect):
    """Guards a bad job that takes cluster resources before failing, or fails deep inside a
    worker: `miles run` exits 2 with the file and the field in the message, and Ray is never
    started."""
    import ray

    def no_ray(*a, **k):
        raise AssertionError("Ray was started for an invalid job")

    monkeypatch.setattr(ray, "init", no_ray)
    job = tmp_path / "bad.yaml"
    job.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(job), *overrides])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert expect in err, err
    if "override" not in what:
        assert str(job) in err, err


def test_a_cluster_too_small_fails_with_a_clear_error(tmp_path):
    """Guards a job that waits on a placement group forever (or times out with a Ray
    traceback): 4 workers on a 2-CPU local cluster end at once with exit 1 and the count."""
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "run", str(DEMO), "cluster.num_cpus=2",
                           "train.parallel.dp=4", "train.micro_batch_size=2", f"log.run_dir={tmp_path / 'run'}",
                           "log.wandb.mode=disabled"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "4 workers x cluster.cpus_per_worker=1 need 4 CPUs; the cluster has 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_overrides_are_typed_and_the_resolved_job_round_trips(tmp_path):
    """Overrides read as YAML (1e-5 a float, true a bool, lists), create nested keys, and the
    resolved job written to the run directory loads back to an equal job; the default run
    directory is runs/<name>-<time>."""
    job = load_job(DEMO, ["train.optim.lr=1e-5", "train.optim.min_lr=0", "train.deterministic=false",
                          "log.wandb.tags=[a, b]", "model.overrides.num_hidden_layers=4",
                          "model.overrides.compress_ratios=[0, 4, 16, 0, 0]"])
    assert job.train.optim.lr == 1e-5 and job.train.deterministic is False and job.log.wandb.tags == ["a", "b"]
    assert job.model.arch.num_hidden_layers == 4 and job.model.arch.compress_ratios == [0, 4, 16, 0, 0]
    assert job.log.run_dir.parent == Path("runs") and job.log.run_dir.name.startswith("demo_tiny-")
    save_resolved(job, tmp_path / "config.yaml")
    assert load_job(tmp_path / "config.yaml") == job
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["optim"]["lr"] == 1e-5
    with pytest.raises(JobConfigError, match="steps is a value, not a group"):
        load_job(DEMO, ["train.steps.x=1"])


def test_help_reads_well():
    """`miles --help` lists the commands; each command's --help explains its arguments."""
    top = subprocess.run([sys.executable, "-m", "miles.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and all(c in top.stdout for c in ("run", "report", "check-alignment"))
    run = subprocess.run([sys.executable, "-m", "miles.cli", "run", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "KEY=VALUE" in run.stdout and "--address" in run.stdout
    for command in ("sft", "submit"):
        got = subprocess.run([sys.executable, "-m", "miles.cli", command, "--help"], capture_output=True, text=True,
                             timeout=60)
        assert got.returncode == 0 and "KEY=VALUE" in got.stdout
    bad = subprocess.run([sys.executable, "-m", "miles.cli", "frobnicate"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_sft_refuses_a_job_that_is_not_sft(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["sft", str(DEMO)])
    assert e.value.code == 2 and "data.source is synthetic" in capsys.readouterr().err


def test_hf_weights_that_do_not_fit_the_jobs_model_are_refused_at_validation(tmp_path):
    """Guards a job that names ckpt.hf but builds another model (no model.config: the tiny
    preset; or other overrides): refused before anything starts, naming the first differing
    field; the matching model (make demo's DAPO stage: the SFT run's hf/) loads."""
    from miles.config import JobConfigError, load_job
    from plugins.deepseek_v4.model import DeepSeekV4ForCausalLM

    rl = ROOT / "jobs" / "dapo_tiny.yaml"
    DeepSeekV4ForCausalLM(load_job(rl).model.arch, seed=0).save_pretrained(tmp_path / "hf")
    assert load_job(rl, [f"ckpt.hf={tmp_path / 'hf'}"]).ckpt.hf == tmp_path / "hf"
    # an override applies to the HF model too (the job runs those weights with it)
    assert load_job(rl, [f"ckpt.hf={tmp_path / 'hf'}", "model.overrides.swiglu_limit=9.0"]).ckpt.hf
    wide = load_job(rl, ["model.overrides.hidden_size=128"]).model.arch
    DeepSeekV4ForCausalLM(wide, seed=0).save_pretrained(tmp_path / "wide")
    with pytest.raises(JobConfigError, match=r"ckpt.hf: .* has hidden_size 128, the job's model \(model.preset "
                                             r"tiny\) 64: point model.config at"):
        load_job(rl, [f"ckpt.hf={tmp_path / 'wide'}"])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())  # metadata alone differs: loads
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "use_cache": True}))
    assert load_job(rl, [f"ckpt.hf={tmp_path / 'hf'}"]).ckpt.hf


def test_options_go_anywhere_among_overrides_and_run_takes_every_job(capsys):
    """`miles rl JOB --check k=v` (an option between overrides) parses; `miles run` validates
    an RL job too (the general command); `miles rl` refuses a job that is not RL."""
    import yaml

    cli.main(["rl", str(ROOT / "jobs" / "dapo_tiny.yaml"), "--check", "train.steps=3", "log.interval=2"])
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["train"]["steps"] == 3 and job["log"]["interval"] == 2
    cli.main(["run", str(ROOT / "jobs" / "dapo_tiny.yaml"), "train.steps=5", "--check"])
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 5
    with pytest.raises(SystemExit) as e:
        cli.main(["rl", str(DEMO), "--check"])
    assert e.value.code == 2 and "data.source is synthetic" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo_tiny", "sft_tiny", "dapo_tiny_sft", "dapo_tiny"])
def test_bundled_tiny_jobs_validate_and_their_data_exists(name):
    """Every bundled CPU job loads as written (the end-to-end tests run them shortened) and
    names data files that ship with the repository."""
    job = load_job(ROOT / "jobs" / f"{name}.yaml")
    assert job.cluster.device == "cpu"
    for path in (job.data.path, job.data.eval_path):
        if path is not None and job.data.source != "synthetic":
            assert (ROOT / str(path)).is_file(), path


def test_the_job_file_reference_is_what_the_schema_makes():
    """docs/jobs.md is generated from miles/config.py (types, constraints, defaults, the fields'
    comments): a field added or changed without rerunning scripts/make_job_reference.py fails."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_job_reference.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    text = (ROOT / "docs" / "jobs.md").read_text()
    for key in ("`train.optim`", "`rollout`", "`algo`", "`ckpt`", "`log.wandb`", "`eps_high`", "`save_interval`"):
        assert key in text, key


@pytest.mark.parametrize("name, gpus", [("sft_gpu", 1), ("dapo_gpu", 1), ("dapo_gpu_2x", 2), ("dapo_gpu_4x", 4)])
def test_gpu_jobs_validate_and_fit_their_gpus(name, gpus):
    """The GPU jobs (run on GPU machines; here validated) load as written, name shipped data,
    and the RL ones place on the GPUs they say: dapo_gpu's trainer and engine share one GPU
    (colocated), dapo_gpu_2x's take one each, dapo_gpu_4x's trainer two (TP=2) and its engines one each."""
    from miles.rl.engines import check_engines
    from miles.session import with_device

    job = load_job(ROOT / "jobs" / f"{name}.yaml")
    assert job.cluster.device == "gpu" and job.model.dtype == "bfloat16"
    for path in (job.data.path, job.data.eval_path):
        assert (ROOT / str(path)).is_file(), path
    if job.algo.loss == "policy":
        check_engines(with_device(job, "gpu"), gpus)
        with pytest.raises(Exception, match="need|at most"):
            check_engines(with_device(job, "gpu"), gpus - 1 if gpus > 1 else 0)


@pytest.mark.parametrize("command", ["run", "sft", "rl"])
def test_each_commands_help_example_is_a_job_that_command_runs(command, capsys, tmp_path):
    """`miles sft --help` showed `miles sft jobs/demo_tiny.yaml ...`, which miles sft refuses
    (a synthetic-data job): each command's example passes that command's own --check."""
    from miles.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    (line,) = [x.strip() for x in out.splitlines() if x.strip().startswith(f"miles {command} jobs/")]
    args = line.split()[2:]
    main([command, *args, f"log.run_dir={tmp_path / 'run'}", "--check"])  # SystemExit(2) if refused


def test_check_shows_what_the_kind_of_job_reads(capsys, tmp_path):
    """`miles sft --check` printed every RL key (the rollout section, clip ranges, rewards):
    an SFT job's shows none of them; an RL job's shows them; the run's config.yaml keeps all."""
    import yaml

    from miles.cli import main

    main(["sft", "jobs/sft_tiny.yaml", f"log.run_dir={tmp_path / 'a'}", "--check"])
    sft = yaml.safe_load(capsys.readouterr().out)
    assert "rollout" not in sft and "eps_high" not in sft["algo"] and "reward" not in sft["algo"]
    assert sft["algo"]["loss"] == "lm" and sft["train"]["steps"] == 100
    main(["rl", "jobs/dapo_tiny.yaml", f"log.run_dir={tmp_path / 'b'}", "--check"])
    rl = yaml.safe_load(capsys.readouterr().out)
    assert rl["rollout"]["n_samples_per_prompt"] == 8 and rl["algo"]["eps_high"] == 0.28
    assert "rollout" in load_job("jobs/sft_tiny.yaml", [f"log.run_dir={tmp_path / 'a'}"]).resolved()
