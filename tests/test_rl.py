"""`miles rl` end to end on a real local Ray cluster (a Megatron trainer, an embedded engine
behind SGLang's router, the bundled arithmetic prompts): the first rollout is on-policy (the
trainer's log-probs are the engine's), colocated and disaggregated placements compute the
same step, the one-step-off mode runs with staleness 1, a SIGKILLed job resumes without
repeating or skipping a prompt."""

from __future__ import annotations

import json
import re
import shutil
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
         "ckpt.save_interval=0", "algo.overlong_max_len=8", "algo.overlong_cache=2",
         "train.optim.warmup_steps=0", "rollout.num_engines=1", "rollout.cpus_per_engine=1"]


@pytest.fixture(scope="module")
def cluster():
    from miles.cluster.local import local_cluster

    with local_cluster(num_cpus=4, log=lambda _: None) as c:
        yield c


@pytest.fixture
def ray_here():
    """Ray in this process, for a test that makes a TrainGroup here, stopped after it (the
    module's cluster serves the `miles rl` subprocesses; an actor made without an init would
    start a Ray of its own that outlives the test)."""
    import ray

    assert not ray.is_initialized(), "a Ray left running in this process by an earlier test"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def _rl(cluster, run_dir: Path, *extra: str, prefix: list[str] = (), check: bool = True, small: bool = True):
    """`miles rl jobs/dapo_tiny.yaml` on the test cluster: SMALL (or the job as it is, without
    checkpoints and wandb), then `extra`."""
    base = SMALL if small else ["ckpt.save_interval=0", "log.wandb.mode=disabled"]
    args = ["rl", "jobs/dapo_tiny.yaml", *base, f"cluster.address={cluster.gcs}", f"log.run_dir={run_dir}", *extra]
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
    samples the same responses and computes the same losses and gradient norms; it takes its
    weights through the disk (rollout.sync: disk, SGLang's path: files written by the trainer's
    ranks, loaded by the engine, removed at the end), the other by broadcast (the rest of this
    file's runs take the default, the object store); both replay the engine's experts and
    indexer entries. The
    RL loop keeps the job keys the SFT controller serves: ckpt.save_hf writes hf/,
    log.alignment the gradient checksums, the data source's metrics are logged."""
    runs = {p: tmp_path / p for p in ("disaggregated", "colocated")}
    for placement, run in runs.items():
        sync = "disk" if placement == "colocated" else "broadcast"
        _rl(cluster, run, "train.steps=1", f"rollout.placement={placement}", f"rollout.sync={sync}",
            "ckpt.save_hf=true", "log.alignment=true", "algo.indexer_replay=true")
        if sync == "disk":
            assert (run / "weights").is_dir() and not list((run / "weights").iterdir()), "versions left behind"
    dis, col = _metrics(runs["disaggregated"])[0], _metrics(runs["colocated"])[0]
    for run in runs.values():
        assert (run / "hf" / "config.json").is_file() and list((run / "hf").glob("*.safetensors"))
        assert (run / "hf" / "tokenizer.json").is_file()  # the weights serve text on their own
        log = (run / "router.log").read_text()
        assert "\x1b[" not in log and "huggingface" not in log.lower(), log[-2000:]  # plain, and no hub fetch
        (record,) = [json.loads(x) for x in (run / "alignment.jsonl").read_text().splitlines()]
        assert record["step"] == 1
    assert dis["data/skipped_rows"] == 0
    for k, v in dis.items():
        assert v == v, f"{k} is NaN"  # nothing silently NaN
    assert dis["train/first_update/train_rollout_logprob_abs_diff"] <= 1e-5
    assert dis["train/first_update/train_rollout_logprob_abs_diff_max"] <= 1e-4
    assert not [k for k in dis if k.endswith("_gb")], "GPU memory metrics from CPU processes"
    assert abs(dis["train/first_update/ppo_kl"]) <= 1e-6
    # who waited: a synchronous disaggregated step leaves the engines idle while the trainer
    # trains and the trainer idle while they generate; colocated, the same, each side in turn
    for m in (dis, col):
        step, wait, train = m["perf/step_time"], m["perf/rollout_wait_time"], m["perf/train_time"]
        assert wait > 0 and train <= m["perf/engine_idle_time"] <= step - 0.9 * wait, m  # the thread's hand-off
        assert wait <= m["perf/trainer_idle_time"] <= step - train, m
    assert dis["train/updates"] == 2 and dis["rollout/staleness"] == 0
    for k in ("rollout/raw_reward", "rollout/response_len/mean", "rollout/log_probs", "train/loss", "train/pg_loss",
              "train/grad_norm", "train/ppo_kl", "train/entropy"):
        assert col[k] == pytest.approx(dis[k], rel=1e-6, abs=1e-9), k
    texts = [[s["text"] for s in json.loads(x)["samples"]] for x in
             ((r / "rollouts.jsonl").read_text() for r in runs.values())]
    assert texts[0] == texts[1], "the placements sampled different responses"
    from safetensors.torch import load_file

    # RL keeps the router's selection bias (algo.freeze_router_bias): the seeded start's zeros
    biases = {k: v for f in (runs["disaggregated"] / "hf").glob("*.safetensors") for k, v in load_file(f).items()
              if k.endswith(".gate.bias")}
    assert biases and all(not v.any() for v in biases.values()), "the router bias moved in an RL run"
    assert dis["train/router_load_max_over_mean"] >= 1.0
    # algo.routing_replay (on by default here): the engines' experts reach the trainer's forward
    assert dis["train/replayed_tokens"] > 0 and col["train/replayed_tokens"] == dis["train/replayed_tokens"]
    assert 0 <= dis["train/router_replay_disagreement"] < 0.05, "fp32 engine and trainer should route alike"
    assert dis["train/first_update/router_replay_disagreement"] <= 0.01  # the same weights, fp32: near ties only
    # algo.indexer_replay (asked for here): the engines' indexer entries too
    assert 0 <= dis["train/first_update/indexer_replay_disagreement"] <= 0.01


def test_colocated_rl_with_evals_math_rewards_and_a_temperature(cluster, tmp_path):
    """The options combined as a user combines them: colocated placement (trainer asleep while
    the engine generates), a held-out evaluation after every rollout (it died at the first one:
    "sleep() called twice without wake_up()"), math-verify's rewards (they died off the main
    thread: its timeouts are signal.alarm) and sampling at temperature 0.7. Every rollout is
    on-policy, so the trainer's log-probs at the same temperature equal the engine's (1e-5) at
    each one: the weights the engine serves after each sync are the trainer's (a sync that does
    nothing fails from the second rollout on; the engine's own start is not the trainer's
    either; the weights come through rollout.sync: shared, the engine opening the trainer's
    buffers in place); each evaluation measures the weights of its step. A checkpoint after every
    rollout: the trainer saves before it sleeps for the next one (the next generation started
    first, and the save found its storages freed)."""
    run = tmp_path / "run"
    _rl(cluster, run, "train.steps=3", "rollout.placement=colocated", "rollout.eval_interval=1",
        "rollout.eval_samples=1", "data.eval_path=miles/data/bundled/arith/eval.jsonl", "algo.reward=math",
        "rollout.temperature=0.7", "ckpt.save_interval=1", "rollout.sync=shared")
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert all(v == v for v in r.values()), r  # nothing silently NaN
        assert r["eval/arith/weight_version"] == r["step"]
    for r in rows[1:]:
        assert r["train/first_update/train_rollout_logprob_abs_diff"] <= 1e-5, r
        assert abs(r["train/first_update/ppo_kl"]) <= 1e-6
        assert r["rollout/staleness"] == 0 and r["rollout/stale_samples"] == 0 and r["rollout/reward_timeouts"] == 0
        assert r["rollout/aborted"] == 0 and r["rollout/wrong_weights"] == 0
    assert any(r["train/grad_norm"] > 0 for r in rows[1:])


def test_a_multi_turn_generate_function_trains_on_the_policys_tokens_only(cluster, tmp_path):
    """rollout.generate_fn: each response is the policy's turn, a tool's ids, the policy's
    second turn (tests/helpers/tool_env.py). The trainer sees the tool's ids as context only:
    on the tokens it trains on, its log-probs equal the engine's (1e-5) and the first update's
    ppo_kl is 0; training on the tool's ids too (for which the engine has no log-probs) would
    break both. Every sample records its two turns and its trained tokens."""
    from tests.helpers.tool_env import TOOL_IDS

    run = tmp_path / "run"
    _rl(cluster, run, "train.steps=1", "rollout.generate_fn=tests.helpers.tool_env:tool_turn",
        "rollout.max_new_tokens=11")
    m = _metrics(run)[0]
    assert all(v == v for v in m.values()), m  # nothing silently NaN
    assert m["train/first_update/train_rollout_logprob_abs_diff"] <= 1e-5
    assert abs(m["train/first_update/ppo_kl"]) <= 1e-6
    assert m["rollout/turns/mean"] == 2 and 0 < m["rollout/trained_ratio"] < 1
    (rec,) = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rec["samples"] and all(x["turns"] == 2 for x in rec["samples"])
    assert all(x["trained_tokens"] == 2 * ((11 - len(TOOL_IDS)) // 2) for x in rec["samples"]), rec["samples"][:2]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_multi_turn_samples_train_and_weigh_the_policys_tokens_only(agg):
    """to_samples with a tool's ids inside a response: they are context (loss mask 0, weight
    0), the aggregation counts the policy's tokens alone (token_mean: the batch's trained
    tokens' weights sum to 1; seq_mean_token_mean: each response's to 1 / responses), and the
    overlong shaping measures them too."""
    from miles.algo.rewards import Rewards
    from miles.data.prompts import Prompt
    from miles.rl.rollout import Response, reward_groups
    from miles.rl.train import to_samples

    job = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["rollout.n_samples_per_prompt=2", "train.global_batch_size=2",
                                                       "rollout.rollout_batch_size=1", f"algo.agg={agg}",
                                                       "algo.overlong_max_len=4", "algo.overlong_cache=2"])
    prompt = Prompt("p:0", [5, 6, 7], "3", [])
    multi = Response(prompt, [11, 12, 7, 8, 9, 13], [-0.5, -0.6, 0.0, 0.0, 0.0, -0.7], "a", False,
                     mask=[1, 1, 0, 0, 0, 1], turns=2)
    single = Response(prompt, [14, 15], [-0.1, -0.2], "b", False)
    reward_groups(job, [[multi, single]], Rewards.of(job.algo))
    (batch,) = to_samples(job, [[multi, single]])
    m, one = batch
    assert m.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1] and one.loss_mask.tolist() == [0, 0, 0, 1, 1]
    weights = [w for s in batch for w, k in zip(s.values["token_weights"], s.loss_mask, strict=True) if k]
    assert all(w == 0 for s in batch for w, k in zip(s.values["token_weights"], s.loss_mask, strict=True) if not k)
    if agg == "token_mean":
        assert sum(weights) == pytest.approx(1.0) and len(set(weights)) == 1  # 5 trained tokens alike
    else:
        assert sum(m.values["token_weights"]) == pytest.approx(0.5) == sum(one.values["token_weights"])
    assert multi.trained == 3 and multi.turns == 2
    assert multi.reward == multi.raw - 0.5  # 3 tokens of the policy: (2 - 3) / 2; its 6 in all would give -1


def test_the_kl_reference_is_the_converted_checkpoint_the_run_starts_from(cluster, tmp_path):
    """Guards a KL reference taken before the starting weights load: a run from a converted
    (weights-only) checkpoint of a trained-looking model, algo.kl_coef 0.1: at the first update
    the policy is the reference, so its kl_loss is 0 (the seeded initialisation as reference
    gave a large one); the checkpoint it saves records where it started (a resume's reference)."""
    from conftest import randomize

    from miles.ckpt.convert import main as convert
    from plugins.deepseek_v4.model import DeepSeekV4ForCausalLM

    job = load_job("jobs/dapo_tiny.yaml")
    randomize(DeepSeekV4ForCausalLM(job.model.arch, seed=11), 11).save_pretrained(tmp_path / "hf")
    convert(["hf-to-dist", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dist")])
    run = tmp_path / "run"
    _rl(cluster, run, "train.steps=1", "algo.kl_coef=0.1", f"ckpt.load={tmp_path / 'dist'}", "ckpt.save_interval=1")
    first = _metrics(run)[0]
    assert first["train/first_update/kl_loss"] == first["train/first_update/kl_loss"]  # not NaN
    assert abs(first["train/first_update/kl_loss"]) <= 1e-6
    meta = store.read_meta(store.resolve("auto", run / "checkpoints"))
    assert meta["started_from"] == {"dist": str(tmp_path / "dist" / "iter_0000000")}

    # The reference never changes silently. Another model named as the reference: the first
    # update's KL is far from 0 (the named weights are the reference, not the start).
    randomize(DeepSeekV4ForCausalLM(job.model.arch, seed=12), 12).save_pretrained(tmp_path / "other")
    named = tmp_path / "named"
    _rl(cluster, named, "train.steps=1", "algo.kl_coef=0.1", f"ckpt.load={tmp_path / 'dist'}",
        f"algo.kl_reference={tmp_path / 'other'}")
    assert _metrics(named)[0]["train/first_update/kl_loss"] > 1e-3
    # The start is gone: a resume stops with the fix, then runs with the reference named (the
    # same weights, so the policy is one update from it), and then keeps naming it.
    shutil.rmtree(tmp_path / "dist")
    more = ["train.steps=2", "algo.kl_coef=0.1", "ckpt.load=auto"]
    p = _rl(cluster, run, *more, check=False)
    assert p.returncode != 0 and "which is gone" in p.stdout + p.stderr and "algo.kl_reference=" in p.stdout + p.stderr
    assert "which is gone" in (run / "failed.txt").read_text()  # the run directory says why it stopped
    out = _rl(cluster, run, *more, f"algo.kl_reference={tmp_path / 'hf'}", "ckpt.save_interval=1").stdout
    assert "KL reference from here on" in out, out[-2000:]
    assert 0 < _metrics(run)[-1]["train/first_update/kl_loss"] < 1e-2
    p = _rl(cluster, run, "train.steps=3", "algo.kl_coef=0.1", "ckpt.load=auto", check=False)
    assert p.returncode != 0 and f"set algo.kl_reference={tmp_path / 'hf'}" in p.stdout + p.stderr


def test_one_step_off_job_killed_and_resumed_repeats_and_skips_no_prompt(cluster, tmp_path):
    """rollout.off_policy (rollout k+1 generated on the weights before step k while step k
    trains): staleness 0 for the first rollout of a process, 1 after, measured from the
    engines' weight versions; truncated IS on by default. SIGKILL right after the step-2
    checkpoint is committed (rollout 3 is already drawing), then ckpt.load: auto: the run
    finishes its 4 rollouts, and the prompts drawn over both processes are exactly the
    source's stream, in order, none twice. The first rollout of each process is on-policy
    (the trainer's log-probs are the engine's, TIS weights 1); the stale ones differ by one
    update (a weight sync that did nothing would leave the engines on weights that are not
    the trainer's: nats apart), with TIS weights off 1 by as much. The evaluation at step 2
    measures step 2's weights (it measured step 1's: the engines were one behind)."""
    from miles.data.prompts import PromptSource

    run = tmp_path / "run"
    extra = ["train.steps=4", "ckpt.save_interval=2", "ckpt.load=auto", "rollout.off_policy=true",
             "rollout.eval_interval=2", "rollout.eval_samples=1", "data.eval_path=miles/data/bundled/arith/eval.jsonl"]
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
    rows = {r["step"]: r for r in _metrics(run)}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [rows[k]["rollout/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]  # the resume restarts it
    assert [rows[k]["eval/arith/weight_version"] for k in (0, 2, 4)] == [0.0, 2.0, 4.0]
    for k in (1, 3):
        assert rows[k]["train/first_update/train_rollout_logprob_abs_diff"] <= 1e-5, rows[k]
        assert abs(rows[k]["train/first_update/tis_weight"] - 1) <= 1e-5, rows[k]
    for k in (2, 4):
        first = {key.rsplit("/", 1)[1]: v for key, v in rows[k].items() if key.startswith("train/first_update/")}
        diff, tis = first["train_rollout_logprob_abs_diff"], first["tis_weight"]
        assert 1e-5 < diff < first["train_rollout_logprob_abs_diff_max"] < 1, rows[k]  # tokens differ by more or less
        assert 0 < abs(tis - 1) <= 2 * diff, rows[k]
    assert job.algo.policy_options(job.rollout)["tis_cap"] == 2.0


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
    sft_eval = [json.loads(x)["messages"] for x in (d / "sft_eval.jsonl").read_text().splitlines()]
    labels = {json.loads(x)["prompt"]: json.loads(x)["label"] for x in (d / "eval.jsonl").read_text().splitlines()}
    assert {m[0]["content"]: m[1]["content"] for m in sft_eval} == {q: f"Answer: {v}" for q, v in labels.items()}


def test_rl_warmup_counts_optimizer_steps_not_rollouts():
    """train.steps counts rollouts in an RL job and the LR schedule spans its optimizer steps:
    warm-up is checked against rollouts x updates_per_rollout (jobs/dapo_tiny.yaml: 4 updates
    per rollout, 8 warm-up steps), so 3 rollouts keep it, 2 clamp the job file's warm-up to 7
    (a note says so), and a warm-up of 8 given with them is refused, naming both."""
    from miles.config import JobConfigError

    job = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["train.steps=3"])
    assert (job.updates_per_rollout, job.optimizer_steps, job.train.optim.warmup_steps) == (4, 12, 8)
    short = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["train.steps=2"])
    assert short.train.optim.warmup_steps == 7 and "clamped to 7" in short.notes[0]
    with pytest.raises(JobConfigError, match=r"warmup_steps=8 must be below the run's 8 optimizer steps "
                                             r"\(train.steps=2 rollouts x 4 updates\)"):
        load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["train.steps=2", "train.optim.warmup_steps=8"])


def test_the_v4_flash_dapo_job_validates_against_v4_flash(tmp_path):
    """jobs/dapo_dsv4_flash.yaml (documented, not run here) is a valid RL job for V4-Flash's
    config.json: 64 training ranks that divide the model, SGLang engines, the paper's DAPO
    settings (16 optimizer steps per rollout, clip-higher, token-level loss, overlong shaping,
    no KL), AIME-style avg@32 evaluation."""
    from test_config import FLASH, write_config

    write_config(tmp_path / "flash", FLASH)
    arith = ROOT / "miles" / "data" / "bundled" / "arith"
    job = load_job(ROOT / "jobs" / "dapo_dsv4_flash.yaml", [
        f"model.config={tmp_path / 'flash'}", f"ckpt.hf={tmp_path / 'flash'}", f"data.path={arith / 'train.jsonl'}",
        f"data.eval_path={arith / 'eval.jsonl'}"])
    assert job.train.parallel.world == 64 and job.model.arch.num_hidden_layers == 43
    assert job.rollout.engine == "sglang" and job.rollout.num_engines * job.rollout.gpus_per_engine == 64
    assert job.rollout.sync == "disk"
    from miles.rl.engines import sglang_options

    assert sglang_options(job) == {**job.rollout.sglang, "tokenizer-path": str(tmp_path / "flash")}
    assert job.updates_per_rollout == 16 and job.rollout.rollout_batch_size * job.rollout.n_samples_per_prompt == 8192
    a = job.algo
    assert (a.eps_low, a.eps_high, a.agg, a.kl_coef, a.reward) == (0.2, 0.28, "token_mean", 0.0, "dapo")
    assert (a.overlong_max_len, a.overlong_cache) == (20480, 4096) and job.rollout.max_new_tokens == 20480
    assert (job.rollout.eval_samples, job.rollout.eval_top_p) == (32, 0.7) and job.ckpt.load == "auto"


def test_an_rl_job_refuses_the_sft_evaluation_interval():
    """data.eval_interval is the SFT loop's; an RL job evaluates every rollout.eval_interval
    rollouts, and would silently ignore the other: refused, naming both keys."""
    from miles.config import JobConfigError

    with pytest.raises(JobConfigError, match=r"data.eval_interval=5 .* rollout.eval_interval"):
        load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["data.eval_interval=5"])


def test_engine_setups_the_rl_loop_cannot_run_are_refused_before_anything_starts():
    """Each of these failed minutes in (SGLang's engines without the disk sync they need, an
    engine hidden from every GPU, a placement that never comes): now an error naming the key,
    before the trainer starts. The CPU setup and GPU ones that fit pass."""
    from miles.session import JobError

    def job(*extra):
        return load_job(ROOT / "jobs" / "dapo_tiny.yaml", list(extra))

    def check_engines(job, device: str, gpus: float):  # as run_rl calls it: the job's device resolved
        from miles.rl.engines import check_engines
        from miles.session import with_device

        return check_engines(with_device(job, device), gpus)

    check_engines(job(), "cpu", 0)
    check_engines(job("rollout.gpus_per_engine=1", "rollout.num_engines=2"), "gpu", 3)
    # colocated on GPUs: RL on one GPU, the engine taking a share of the trainer's
    check_engines(job("rollout.gpus_per_engine=0.5", "rollout.num_engines=1", "rollout.placement=colocated"), "gpu", 1)
    from miles.config import JobConfigError

    with pytest.raises(JobConfigError, match="rollout.engine: sglang takes the trainer's weights from files: set "
                                             "rollout.sync: disk"):
        job("rollout.engine=sglang")
    sglang = job("rollout.engine=sglang", "rollout.sync=disk", "rollout.gpus_per_engine=8")
    with pytest.raises(JobError, match="rollout.engine: sglang needs its tokenizer's directory: set ckpt.hf"):
        check_engines(sglang, "gpu", 17)  # the weights it loads carry no tokenizer
    with pytest.raises(JobError, match="rollout.engine: sglang runs on GPU clusters"):
        check_engines(sglang, "cpu", 0)
    sglang.rollout.sglang = {"tokenizer-path": "/models/v4"}
    check_engines(sglang, "gpu", 17)
    sglang.rollout.placement = "colocated"
    with pytest.raises(JobError, match="colocated with rollout.engine: sglang is not built"):
        check_engines(sglang, "gpu", 17)
    for extra, device, gpus, match in [
            ([], "gpu", 8, "rollout.gpus_per_engine is 0"),
            (["rollout.gpus_per_engine=0.5", "rollout.placement=colocated"], "gpu", 8,
             "rollout.num_engines=2: colocated, each engine shares one of the trainer's 1 GPU"),
            (["rollout.gpus_per_engine=1", "rollout.placement=colocated", "rollout.num_engines=1"], "gpu", 8,
             "rollout.gpus_per_engine=1: colocated on GPUs an engine shares one trainer GPU"),
            (["rollout.gpus_per_engine=1", "rollout.num_engines=2"], "gpu", 2, "need 3 GPUs; the cluster has 2")]:
        with pytest.raises(JobError, match=match):
            check_engines(job(*extra), device, gpus)


def test_the_weight_sync_backend_comes_from_the_resolved_device():
    """Guards cluster.device: auto reaching the broadcast sync unresolved (the engines took gloo
    and the trainer's GPU ranks nccl: a hang until the group's timeout): run_rl resolves the
    device once (with_device) and sync_backend, which both sides' groups take, reads that; an
    unresolved job is refused, not guessed."""
    from miles.rl.engines import sync_backend
    from miles.session import with_device

    job = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["cluster.device=auto", "rollout.sync=broadcast"])
    with pytest.raises(ValueError, match="cluster.device is 'auto'"):
        sync_backend(job)
    assert sync_backend(with_device(job, "gpu")) == "nccl" and sync_backend(with_device(job, "cpu")) == "gloo"
    assert job.cluster.device == "auto"  # the job as written is left as it was


def test_staleness_is_measured_from_the_engines_versions():
    """Guards staleness assumed from the version the loop asked for: a rollout asked of
    version 3 and trained at step 5 whose engines answered with versions 3, 3 and 2 (a replaced
    engine one behind) is 1.33 stale on average, 2 at most, with one stale sample."""
    from miles.data.prompts import Prompt
    from miles.rl.rollout import Response, Rollout, staleness

    p = Prompt("p:0", [1], "1", [])
    group = [Response(p, [5], [-0.1], "x", False, version=v) for v in (3, 3, 2)]
    got = staleness(Rollout(5, [group], 3, {}, ["p:0"], {}), step=5)
    assert got == {"rollout/staleness": pytest.approx(4 / 3), "rollout/staleness_max": 2.0,
                   "rollout/stale_samples": 1.0}


def test_an_rl_job_trains_mtp_only_when_asked():
    """Guards MTP's cross-entropy added to an RL job by default (0.3: supervised training on
    the policy's own samples, wrong answers too): an RL job that does not set
    algo.mtp_loss_coef trains no MTP term, an SFT job keeps 0.3, a value given is kept; the
    trainer gets what the job resolved. The indexer's KL stays on in RL: it trains the indexer
    alone, on detached inputs, toward the model's own attention (no label involved)."""
    from miles.train.losses import LossCoefs

    rl = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["algo.mtp_loss_coef=null"])
    assert rl.algo.mtp_loss_coef == 0.0 and rl.algo.indexer_loss_coef == LossCoefs.indexer
    assert load_job(ROOT / "jobs" / "sft_tiny.yaml", ["algo.mtp_loss_coef=null"]).algo.mtp_loss_coef == LossCoefs.mtp
    assert load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["algo.mtp_loss_coef=0.2"]).algo.mtp_loss_coef == 0.2


def test_rollouts_jsonl_keeps_the_texts_log_rollouts_asks_for(tmp_path):
    """log.rollouts: every response's text, N of them (the same N for a step, whatever else
    differs), or none; the prompt ids drawn and kept are always there (the data position's
    record). The default keeps 64 a rollout: full texts of every step ran to hundreds of GB."""
    from types import SimpleNamespace

    from miles.rl.rollout import Rollout, write_rollout

    def rollout(step: int) -> Rollout:
        groups = [[SimpleNamespace(prompt=SimpleNamespace(id=f"p{g}"), reward=float(i), text=f"answer {g}.{i}",
                                   turns=1, trained=3) for i in range(4)] for g in range(5)]
        return Rollout(step, groups, step - 1, {}, [f"p{g}" for g in range(6)], {})

    for texts, run in (("all", "a"), (3, "b"), (3, "c"), ("none", "d")):
        (tmp_path / run).mkdir()
        for step in (1, 2):
            write_rollout(tmp_path / run, rollout(step), texts)
    recs = {run: [json.loads(x) for x in (tmp_path / run / "rollouts.jsonl").read_text().splitlines()]
            for run in "abcd"}
    for run in "abcd":
        assert [r["drawn"] for r in recs[run]] == [[f"p{g}" for g in range(6)]] * 2
        assert [r["kept"] for r in recs[run]] == [[f"p{g}" for g in range(5)]] * 2
    assert [len(r["samples"]) for r in recs["a"]] == [20, 20] and [r["samples"] for r in recs["d"]] == [[], []]
    assert [len(r["samples"]) for r in recs["b"]] == [3, 3] and recs["b"] == recs["c"]
    texts = [{s["text"] for s in r["samples"]} for r in recs["b"]]
    assert texts[0] <= {s["text"] for s in recs["a"][0]["samples"]} and texts[0] != texts[1]
    assert load_job("jobs/dapo_tiny.yaml", ["log.run_dir=x"]).log.rollouts == 64


def test_a_new_user_trains_on_their_own_prompts_and_reward_then_chats_with_the_result(cluster, tmp_path):
    """As a new user works: a prompts file, a reward module and a job file in a folder of their
    own, `miles rl job.yaml` run from that folder (no cluster: a local one on 127.0.0.1), two
    rollouts scored by their function, the weights saved with the tokenizer, then `miles serve`
    on them and a chat answer through /v1/chat/completions; `miles submit` of the same folder
    to a cluster's job server runs it too."""
    import os
    import signal

    import httpx

    from miles.cluster.node import free_port

    user = tmp_path / "user"
    user.mkdir()
    (user / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "label": str(a + b)})
                                                + "\n" for a in range(4) for b in range(4)))
    (user / "my_reward.py").write_text("def add_reward(response, label, prompt):\n"
                                       "    return 1.0 if response.strip().endswith(label) else -1.0\n")
    (user / "job.yaml").write_text(
        "name: my_first_rl\ncluster: {device: cpu, num_cpus: 4}\n"
        "model: {preset: tiny, overrides: {vocab_size: 512}, dtype: float32}\n"
        "data: {source: prompts, path: prompts.jsonl, tokenizer: tiny, seq_len: 256}\n"
        "train: {steps: 2, global_batch_size: 8, micro_batch_size: 2}\n"
        "rollout: {num_engines: 1, rollout_batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 8, max_len: 48,\n"
        "          dynamic_sampling: false, over_sampling: 1.0}\n"
        "algo: {loss: policy, reward: 'my_reward:add_reward'}\n"
        "ckpt: {save_hf: true}\nlog: {run_dir: run, wandb: {mode: disabled}}\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, "-m", "miles.cli", "rl", "job.yaml"], cwd=user, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    rows = _metrics(user / "run")
    assert [r["step"] for r in rows] == [1, 2] and all("rollout/raw_reward" in r for r in rows)
    assert (user / "run" / "hf" / "tokenizer.json").is_file()
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", "run/hf", "--port", str(port),
                              "--max-len", "64"], cwd=user, env={**env, "PYTHONUNBUFFERED": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "float32, tokenizer" in serve.stdout.readline()
        chat = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and isinstance(r.json()["choices"][0]["message"]["content"], str), r.text
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)
    p = subprocess.run([sys.executable, "-m", "miles.cli", "submit", "job.yaml", "--address", cluster.address,
                        f"log.run_dir={tmp_path / 'submitted'}"], cwd=user, env=cluster.env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert [r["step"] for r in _metrics(tmp_path / "submitted")] == [1, 2]
    # The console: the job's lines and miles's, each once, in order; not Ray's set-up lines and
    # its CLI's colored banners (timestamped before the lines they came after)
    console = p.stdout + p.stderr
    assert "\x1b[" not in console and "Running entrypoint" not in console, console[-3000:]
    assert not re.search(r"^\d{4}-\d\d-\d\d [\d:,]+\s+(INFO|SUCC)", console, re.M), console[-3000:]
    assert console.count("\nrun directory: ") == 1 and console.count("plots: ") == 1, console[-3000:]
    assert re.fullmatch(r"miles submit: job \S+ SUCCEEDED", p.stdout.strip().splitlines()[-1]), p.stdout[-500:]


def test_a_rollouts_per_token_data_is_held_as_arrays_and_trains_the_same(seed):
    """A V4-Flash rollout holds tens of millions of tokens in the driver: Responses and their
    samples keep them as int32 / float32 / int8 arrays (benchmarks/driver_memory.py: ~5x less
    than Python lists), and the micro-batches made of them are those of the same data as lists,
    bit for bit."""
    import numpy as np
    import torch

    from miles.data.prompts import Prompt
    from miles.data.sample import Sample
    from miles.rl.rollout import Response, compact_result, response_tokenizer
    from miles.rl.train import to_samples
    from miles.train.batching import to_micro_batch

    g = torch.Generator().manual_seed(seed)
    job = load_job(ROOT / "jobs" / "dapo_tiny.yaml", ["rollout.n_samples_per_prompt=2", "train.global_batch_size=2",
                                                       "rollout.rollout_batch_size=1"])
    prompt = Prompt("p:0", torch.randint(3, 500, (7,), generator=g).tolist(), "3", [])
    tok = response_tokenizer("tiny")
    raw = []
    for n in (5, 9):
        ids = torch.randint(3, 500, (n,), generator=g).tolist()
        lps = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist()
        raw.append({"output_ids": ids, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in
                                                                                zip(lps, ids, strict=True)],
                                                      "finish_reason": {"type": "stop"}, "weight_version": 2}})
    group = [Response(prompt, **compact_result(tok, r)) for r in raw]
    group[0].reward, group[1].reward = 1.0, -1.0
    assert all(x.ids.dtype == np.int32 and x.logprobs.dtype == np.float32 and x.version == 2 for x in group)
    (batch,) = to_samples(job, [group])
    for s in batch:
        assert s.tokens.dtype == np.int32 and s.loss_mask.dtype == np.int8
        assert all(v.dtype == np.float32 for v in s.values.values())
    # the same samples as Python lists, the engine's float64 log-probs as they came (the driver before)
    p = len(prompt.input_ids)
    as_lists = [Sample(prompt.input_ids + r["output_ids"], [0] * p + [1] * len(r["output_ids"]), values={
        "rollout_logprobs": [0.0] * p + [x[0] for x in r["meta_info"]["output_token_logprobs"]],
        **{k: [float(x) for x in s.values[k]] for k in ("advantages", "token_weights")}})
        for r, s in zip(raw, batch, strict=True)]
    a, b = to_micro_batch([batch]), to_micro_batch([as_lists])
    for field in ("input_ids", "labels", "loss_mask", "advantages", "rollout_logprobs", "token_weights"):
        x, y = getattr(a, field), getattr(b, field)
        assert torch.isfinite(x.float()).all() and torch.equal(x, y), field


def test_a_prompt_drawn_twice_in_one_round_gets_new_samples_not_a_clash(tmp_path):
    """A round that crosses into the next epoch (or a prompts file smaller than a round) draws
    a prompt again: its requests need ids of their own (the manager refuses a repeated id) and
    seeds of their own (else its samples repeat the first draw's); the first draw's ids and
    seeds are what they always were (resumed runs draw the same samples)."""
    import zlib

    from miles.config import DataConfig
    from miles.data.prompts import PromptSource
    from miles.rl.rollout import requests

    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Which is larger: {i} or {i + 7}?", "label": str(i + 7)}) + "\n"
                            for i in range(10)))
    source = PromptSource(DataConfig(source="prompts", path=str(rows), tokenizer="tiny", eval_size=0), 1234, 64,
                          tmp_path)
    drawn = [source.batch(step, 4) for step in range(1, 6)]
    source.close()
    twice = next((b for b in drawn if len({p.id for p in b}) < len(b)), None)
    assert twice is not None, "no round drew a prompt twice: the data no longer exercises the case"
    reqs = requests(twice, 3, {"temperature": 1.0}, seed=(1234, 3, 0))
    ids = [r["id"] for r in reqs]
    assert len(set(ids)) == len(ids), "a prompt drawn twice repeats its request ids"
    first = {}
    for p, r in zip([p for p in twice for _ in range(3)], reqs, strict=True):
        first.setdefault(p.id, []).append(r)
    for pid, rs in first.items():
        head = rs[:3]  # the first draw: the ids and seeds of a round without repeats
        assert [r["id"] for r in head] == [f"1234/3/0/{pid}/{i}" for i in range(3)]
        assert [r["sampling_params"]["seed"] for r in head] == [
            zlib.crc32(f"{(1234, 3, 0)}/{pid}/{i}".encode()) & 0x7FFFFFFF for i in range(3)]
        if len(rs) > 3:
            assert {r["sampling_params"]["seed"] for r in rs[3:]}.isdisjoint(r["sampling_params"]["seed"] for r in head)


def test_the_router_in_training_frozen_bias_frozen_gates_and_its_load_metric(ray_here, seed):
    """algo.freeze_router_bias (RL's default): the aux-loss-free bias stays bit for bit while
    the rest trains, and the loads are still reported; unfrozen (lm jobs) it moves.
    algo.freeze_router: every gate's weights stay bit for bit, the experts still train."""
    import torch

    from miles.cluster.train_group import TrainGroup
    from miles.config import AlgoConfig
    from miles.data.synthetic import SyntheticSource
    from miles.train.batching import replica_micro_batches
    from plugins.deepseek_v4 import DeepSeekV4Config

    assert AlgoConfig(loss="policy").freeze_router_bias and not AlgoConfig(loss="lm").freeze_router_bias
    cfg = DeepSeekV4Config.tiny()

    def train(freeze_bias: bool, freeze_weights: bool):
        group = TrainGroup(1, resources={"CPU": 1})
        try:
            group.call("build_model", cfg.to_dict(), seed)
            group.call("set_router", freeze_bias=freeze_bias, freeze_weights=freeze_weights)
            group.call("setup_training", lr=1e-2, total_steps=10)
            weights = lambda: {k: v for b in group.export_weights() for k, v in b.items()}  # noqa: E731
            before = weights()
            src = SyntheticSource(32, cfg.vocab_size, seed)
            logs = [group.train_step(replica_micro_batches(src.batch(s, 4), 1, 1))[0] for s in (1, 2)]
            return before, weights(), logs
        finally:
            group.shutdown()

    def same(a, b, part: str) -> bool:
        names = [k for k in a if part in k]
        assert names, part
        assert all(torch.isfinite(b[k]).all() for k in names)
        return all(torch.equal(a[k], b[k]) for k in names)

    before, after, logs = train(freeze_bias=True, freeze_weights=False)
    assert same(before, after, ".gate.bias"), "a frozen router bias moved"
    assert not same(before, after, ".gate.weight") and not same(before, after, ".ffn.experts.")
    assert all(x["router_load_max_over_mean"] >= 1.0 for x in logs), logs
    before, after, _ = train(freeze_bias=False, freeze_weights=True)
    assert not same(before, after, ".gate.bias"), "the bias is not updated where it should be"
    assert same(before, after, ".gate.weight"), "frozen gate weights moved"
    assert not same(before, after, ".ffn.experts.")


def test_the_trainer_replays_the_experts_and_entries_its_samples_carry(ray_here, seed):
    """Routing and indexer replay through the trainer: samples carrying an engine's experts and
    indexer entries per token (Sample.routes, Sample.picks) become micro-batches that put each
    token's where it is read (routed_experts, indexer_picks; -1 on padding); the trainer's
    forward takes them (its log-probs are the replayed forward's of the same weights, and differ
    from its own choices'), and train/router_replay_disagreement and
    train/indexer_replay_disagreement measure how often its own router and indexers chose
    otherwise."""
    import numpy as np
    import torch
    from conftest import without_near_ties

    from miles.cluster.train_group import TrainGroup
    from miles.data.sample import Sample
    from miles.train.batching import replica_micro_batches
    from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

    cfg = DeepSeekV4Config.tiny()
    local, engine = (DeepSeekV4ForCausalLM(cfg, seed=seed).eval() for _ in range(2))
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if name.endswith(".ffn.gate.weight"):  # the engine routes some tokens elsewhere
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())
            elif ".indexer." in name:  # and its indexers pick some other entries
                p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(0.05))
    lens = [70, 53]
    # ids without a near tie for the trainer's own choices: its padded batch rounds otherwise
    ids = without_near_ties(local, lambda: torch.randint(2, cfg.vocab_size, (2, 70), generator=g))

    def samples(model) -> list[Sample]:
        with torch.no_grad():
            outs = [model(ids[i:i + 1, :n], record_routes=True, record_picks=True) for i, n in enumerate(lens)]
        return [Sample(ids[i, :n].tolist(), [0] * 5 + [1] * (n - 5), routes=o.routes[0].numpy().astype(np.int16),
                       picks=o.picks[0].numpy().astype(np.int16))
                for i, (n, o) in enumerate(zip(lens, outs, strict=True))]

    theirs, own = samples(engine), samples(local)
    (mb,) = replica_micro_batches(theirs, 1, 2)[0]
    (own_mb,) = replica_micro_batches(own, 1, 2)[0]
    for field, key in (("routed_experts", "routes"), ("indexer_picks", "picks")):
        t = getattr(mb, field)
        assert t.shape == (2, 69, *getattr(theirs[0], key).shape[1:]) and t.dtype == torch.int16
        assert torch.equal(t[1, :52], torch.as_tensor(getattr(theirs[1], key)[:-1]))
        assert (t[1, 52:] == -1).all(), f"{field}: padding must route and attend as the trainer does"
    with pytest.raises(ValueError, match="replay routes"):
        replica_micro_batches([theirs[0], Sample(theirs[1].tokens, theirs[1].loss_mask)], 1, 2)
    group = TrainGroup(1, resources={"CPU": 1})
    try:
        group.call("build_model", cfg.to_dict(), seed)
        got = group.forward_logprobs([[mb]])[0][0][0, :68]
        group.call("setup_training", lr=1e-6, total_steps=10)
        same = group.train_step([[own_mb]])[0]
        differed = group.train_step([[mb]])[0]
    finally:
        group.shutdown()
    # the share of replayed (token, layer) pairs, and of replayed entries, the trainer's own
    # router and indexers would have chosen otherwise
    for k in ("router_replay_disagreement", "indexer_replay_disagreement"):
        assert 0.02 < differed[k] < 1 and same[k] < 1e-6, (k, differed[k], same[k])

    def logprobs(**kw) -> torch.Tensor:
        with torch.no_grad():
            logits = local(ids[:1, :69], **kw).head.logits().double()
        return torch.log_softmax(logits, -1)[0, :68].gather(-1, ids[0, 1:69, None])[..., 0]

    replayed = logprobs(routed_experts=torch.as_tensor(theirs[0].routes[None, :-1]),
                        indexer_picks=torch.as_tensor(theirs[0].picks[None, :-1]))
    experts_only = logprobs(routed_experts=torch.as_tensor(theirs[0].routes[None, :-1]))
    assert torch.isfinite(got).all() and torch.isfinite(replayed).all()
    assert (got.double() - replayed).abs().max() <= 1e-5, "the trainer did not take the samples' choices"
    assert (got.double() - experts_only).abs().max() > 1e-4, "the entries changed nothing: the test cannot see them"
    assert (got.double() - logprobs()).abs().max() > 1e-4, "replay changed nothing: the test cannot see it"
