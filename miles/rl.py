"""The RL loop (`miles rl`): DAPO / GRPO on a TrainGroup and rollout engines behind SGLang's router.

    run_rl(job):
        run directory, Ray, prompts (data.source: prompts), trainer (the policy loss)
        start   <- the checkpoint ckpt.load names (weights, optimizer, data position), or 0
        engines <- the trainer's weights (version = the step they come from)
        for step in start+1..steps:
            groups   <- generate n responses per prompt -> reward -> keep groups whose rewards
                        differ (dynamic sampling, up to rollout.max_rounds rounds)
            samples  <- group advantages, per-token weights of each optimizer step's batch
            (one-step-off: rollout step+1 starts generating now, on the current weights)
            train    <- old (and reference) log-probs, then updates_per_rollout optimizer steps
            eval     <- held-out accuracy of this step's weights every rollout.eval_interval steps
                        (engines brought to them first; never beside a rollout's generation)
            engines  <- the new weights (colocated: engines and trainer take turns in memory)
            log, checkpoint

The pieces that decide (advantages, the loss, rewards, filtering, aggregation weights) are
pure functions in miles.algo; this file only moves data between them and the actors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from miles.algo.advantages import group_advantages
from miles.algo.losses import response_weights
from miles.algo.rewards import Rewards, overlong_penalty
from miles.algo.sampling import dynamic_filter
from miles.ckpt.manager import Checkpoints
from miles.config import JobConfig
from miles.controller import (
    RunResult,
    finish,
    prepare_run_dir,
    profiling,
    ray_session,
    resolve_device,
    start_trainer,
    with_device,
)
from miles.data.prompts import Prompt, PromptSource
from miles.data.sample import Sample
from miles.memory import phase_metrics
from miles.observe import alignment, records
from miles.observe.busy import Busy
from miles.observe.metrics import Monitor
from miles.train.batching import MicroBatch, packed_replica_micro_batches


@dataclass
class Response:
    """One sampled response. Per-token data as arrays (int32 ids, float32 log-probs, int8
    mask): a V4-Flash rollout holds tens of millions of tokens in the driver, where Python
    lists cost ~60 bytes a token (benchmarks/driver_memory.py)."""

    prompt: Prompt
    ids: np.ndarray  # [T] generated tokens (the end-of-sentence id included when it stopped there)
    logprobs: np.ndarray  # [T] the engine's log-probs of them
    text: str
    truncated: bool  # stopped by the length limit
    mask: np.ndarray | None = None  # [T] per token: 1 the policy's (trained), 0 environment / tools (multi-turn)
    turns: int = 1
    version: int | None = None  # the weights it was generated with (the engine's weight_version; multi-turn: the
    # oldest of its turns')
    correct: bool = False  # the raw reward was positive
    raw: float = 0.0  # the reward function's value
    reward: float = 0.0  # shaped (overlong penalty added)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.mask is not None:
            self.mask = np.asarray(self.mask, dtype=np.int8)

    @property
    def trained(self) -> int:
        """Tokens the loss sees (the policy's)."""
        return len(self.ids) if self.mask is None else int(self.mask.sum())


@dataclass
class Rollout:
    step: int
    groups: list[list[Response]]  # rollout_batch_size groups of n_samples_per_prompt
    version: int  # the weights it was generated with (a trainer step)
    metrics: dict[str, float]
    drawn: list[str]  # every prompt id drawn for it, kept or not (the data position's record)
    data_state: dict  # the data position right after it (what a checkpoint of its step saves)


@dataclass
class Position:
    """The data position a checkpoint saves: taken when the rollout was drawn, since the next
    one may already be drawing (one-step-off, or generation ahead of the save)."""

    saved: dict

    def state(self) -> dict:
        return self.saved


def run_rl(job: JobConfig, stream: TextIO | None = None) -> RunResult:
    from miles.rollout.sync import remove_older_versions

    out = stream or sys.stdout
    ckpt = Checkpoints(job, report=lambda text: print(text, file=out, flush=True))
    run_dir = prepare_run_dir(job, resume_from=ckpt.iteration if job.ckpt.load else None, stream=out)
    r = job.rollout
    with ray_session(job), contextlib.ExitStack() as stack:
        job = with_device(job, resolve_device(job))  # every path below sees one resolved device
        check_engines(job, ray_resources().get("GPU", 0))
        monitor = Monitor(job.log, run_dir, job.train.steps, job.resolved(), stream)
        stack.push(lambda exc_type, *_: monitor.close(failed=exc_type is not None))
        ckpt.report = monitor.print
        data = PromptSource(job.data, job.train.seed, r.max_len - r.max_new_tokens, run_dir, report=monitor.print)
        stack.callback(data.close)
        rewards = Rewards.of(job.algo)
        stack.callback(rewards.close)
        shared = colocation(job)  # colocated on GPUs: the bundles trainer ranks and engines share
        trainer = start_trainer(job, job.cluster.device, shared)
        stack.callback(trainer.shutdown)
        named = job.algo.kl_reference  # the KL reference: these weights, else the ones the run started from
        ckpt.check_reference(named)
        if job.algo.kl_coef > 0 and ckpt.resumes and named is None:
            ckpt.load_start_weights(trainer)
            trainer.call("keep_reference")
        start = ckpt.restore(trainer, data)
        if job.algo.kl_coef > 0 and (named is not None or not ckpt.resumes):  # named, or the weights just loaded
            trainer.call("keep_reference", None if named is None else str(named))
        if r.sync == "disk":  # the versions written for the engines (the last one too: the run is over)
            stack.callback(remove_older_versions, sync_dir(job), job.train.steps + 1, sync_owner(job))
        engines = start_engines(job, run_dir, trainer, start, shared)
        stack.callback(engines.shutdown)
        update_engines(job, trainer, engines, start)
        monitor.print(f"miles rl: {job.name}: {job.train.steps} rollouts of {r.rollout_batch_size} prompts x "
                      f"{r.n_samples_per_prompt} samples, {job.updates_per_rollout} optimizer step(s) each; "
                      f"{r.placement}{', one-step-off' if r.off_policy else ''}; run directory {run_dir}")
        first = None
        if start == 0 and evaluates(job, data, 0):
            monitor.record(0, first := evaluate(job, trainer, engines, data, rewards, version=0))
        pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        stack.callback(pool.shutdown, wait=False, cancel_futures=True)  # a stopped job does not wait for it
        engines_busy = Busy()  # generation, evaluation and sync: the engines' idle time per step

        def rollout_of(step: int, version: int) -> Future:  # generated in the background
            return submit(pool, job, trainer, engines, data, rewards, step, version, engines_busy)

        def sync(version: int) -> float:  # seconds of weight sync
            with engines_busy.span():
                return update_engines(job, trainer, engines, version).get("seconds", 0.0)

        pending = rollout_of(start + 1, version=start)
        history: list[dict] = []
        for step in range(start + 1, job.train.steps + 1):
            t0 = time.perf_counter()
            rollout = pending.result()
            t_wait = time.perf_counter() - t0
            synced = 0.0  # seconds of weight sync this step
            if r.off_policy and step < job.train.steps:  # generate step+1 while training on this one
                synced += sync(step - 1)
                pending = rollout_of(step + 1, version=step - 1)
            samples = to_samples(job, rollout.groups)
            with profiling(job, trainer, run_dir, step):
                trained, ranks = train(job, trainer, samples, step)
            if job.log.alignment:  # the rollout's first update (each rank's gradient checksums)
                alignment.append(run_dir, alignment.ranks_record(step, ranks[0], ranks[0]["grad_norm"],
                                                                 [x["grad_md5"] for x in ranks]))
            metrics = rollout.metrics | trained | data.metrics() | staleness(rollout, step)
            metrics |= phase_metrics("trainer", trainer.call("memory"))  # GPUs: the training phase's memory
            if evaluates(job, data, step):  # this step's weights, never beside a rollout's generation
                if r.off_policy:
                    pending.result()  # step+1's generation (on the older weights) ends first
                synced += sync(step)
                t1 = time.perf_counter()
                with engines_busy.span():
                    metrics.update(evaluate(job, trainer, engines, data, rewards, version=step))
                metrics["perf/eval_time"] = time.perf_counter() - t1
            on_policy_next = not r.off_policy and step < job.train.steps
            if on_policy_next:
                synced += sync(step)
                if r.placement != "colocated":  # generation overlaps the log and the checkpoint
                    pending = rollout_of(step + 1, version=step)
            metrics.update({"perf/rollout_wait_time": t_wait, "perf/update_weights_time": synced})
            t1 = time.perf_counter()
            metrics.update(idle_times(t1 - t0, metrics, engines_busy.within(t0, t1)))
            write_rollout(run_dir, rollout, job.log.rollouts)
            monitor.log(step, metrics)
            history.append(metrics)
            ckpt.maybe_save(step, trainer, Position(rollout.data_state))
            if on_policy_next and r.placement == "colocated":  # the trainer sleeps while engines generate
                pending = rollout_of(step + 1, version=step)
        ckpt.close(trainer)
        summary = {k: v for k, v in history[-1].items() if k.startswith(("train/", "eval/", "rollout/", "data/"))}
        finish(job, trainer, data, run_dir, monitor)  # ckpt.save_hf
        key = f"eval/{job.data.eval_name}/accuracy"
        if first is not None and key in summary:
            summary[f"{key}_start"] = first[key]
            monitor.print(f"held-out accuracy ({job.data.eval_name}, avg@{r.eval_samples}): {first[key]:.1%} before "
                          f"RL, {summary[key]:.1%} after {job.train.steps} rollouts")
        monitor.summary(summary)
    return RunResult(run_dir, history, summary)


def staleness(rollout: Rollout, step: int) -> dict[str, float]:
    """How old the weights were that generated the rollout trained at `step`, measured from what
    each response's engine reported (the trainer's weights after step s are version s):
    rollout/staleness the mean over responses of step - 1 - version, staleness_max the largest;
    rollout/stale_samples the responses generated with other weights than the loop asked for
    (a replaced engine that could not catch up serves older ones)."""
    versions = [x.version for g in rollout.groups for x in g]
    ages = [step - 1 - v for v in versions]
    return {"rollout/staleness": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages)),
            "rollout/stale_samples": float(sum(v != rollout.version for v in versions))}


# --------------------------------------------------------------------------- engines
def check_engines(job: JobConfig, cluster_gpus: float) -> None:
    """Refuse, before anything starts, engine setups this RL loop cannot run (each would fail
    minutes later, inside an engine or as a placement that never comes). job.cluster.device is
    the resolved one (cpu or gpu)."""
    from miles.controller import JobError

    r, device = job.rollout, job.cluster.device
    if r.engine == "sglang":
        if device != "gpu":
            raise JobError("rollout.engine: sglang runs on GPU clusters; on CPUs use rollout.engine: embedded")
        sglang_options(job)
    if device != "gpu":
        return
    if r.gpus_per_engine == 0:
        raise JobError("rollout.gpus_per_engine is 0 on a GPU cluster: an engine would see no GPU; give each "
                       "engine its GPUs (e.g. rollout.gpus_per_engine: 1, or colocated: a share such as 0.5)")
    if r.placement == "colocated":
        if r.engine == "sglang":
            raise JobError("rollout.placement: colocated with rollout.engine: sglang is not built (an SGLang server "
                           "spans its own GPUs); use the embedded engine, or rollout.placement: disaggregated")
        try:
            colocation(job)
        except ValueError as e:
            raise JobError(str(e)) from None
        need = job.train.parallel.world  # the engines take shares of the trainer's GPUs
    else:
        need = job.train.parallel.world + r.num_engines * r.gpus_per_engine
    if cluster_gpus < need:
        raise JobError(f"{job.train.parallel.world} trainer GPUs + rollout.num_engines={r.num_engines} x "
                       f"rollout.gpus_per_engine={r.gpus_per_engine:g} need {need:g} GPUs; the cluster has "
                       f"{cluster_gpus:g}")


def colocation(job: JobConfig):
    """Colocated on GPUs: the placement (miles.cluster.placement.Colocation) of the trainer's
    ranks and the engines on the same GPUs; None otherwise (CPUs share a node's cores)."""
    from miles.cluster.placement import colocate_on_gpus

    r = job.rollout
    if r.placement != "colocated" or job.cluster.device != "gpu":
        return None
    return colocate_on_gpus(job.train.parallel.world, r.num_engines, r.gpus_per_engine, job.cluster.cpus_per_worker,
                            r.cpus_per_engine)


def start_engines(job: JobConfig, run_dir: Path, trainer, version: int, shared=None):
    """The rollout manager: rollout.num_engines engines behind SGLang's router, weights to
    come from the trainer (update_engines). Embedded engines start from seeded weights that are
    not the trainer's (another seed, no weight version), so generation before a working weight
    sync cannot pass for the trainer's; SGLang's engines start from the trainer's weights of
    `version` written to disk (their format is then the one every later sync writes). `shared`:
    colocated on GPUs, each engine in its bundle of the trainer's placement group."""
    from miles.rollout.manager import RolloutManager
    from miles.rollout.sync import write_version

    spec = {"config": job.model.arch.to_dict(), "seed": job.train.seed + 1, "weight_version": None,
            "dtype": job.model.dtype, "device": "cuda" if job.cluster.device == "gpu" else "cpu"}
    if job.rollout.engine != "sglang":
        return RolloutManager(job.rollout, spec, log_dir=str(run_dir),
                              colocation=(trainer.pg, shared) if shared is not None else None)
    path, _ = write_version(trainer, sync_dir(job), job.model.arch, version, sync_owner(job))
    rollout = job.rollout.model_copy(update={"sglang": sglang_options(job)})
    return RolloutManager(rollout, spec | {"hf": str(path)}, log_dir=str(run_dir), version=version)


def sglang_options(job: JobConfig) -> dict:
    """rollout.sglang with the tokenizer's directory: the engines start from the trainer's
    weights, which carry no tokenizer files; it is ckpt.hf's unless tokenizer-path is given."""
    from miles.controller import JobError

    opts = dict(job.rollout.sglang)
    if not any(k.replace("-", "_") == "tokenizer_path" for k in opts):
        if job.ckpt.hf is None:
            raise JobError("rollout.engine: sglang needs its tokenizer's directory: set ckpt.hf (DeepSeek's HF "
                           "checkpoint holds it) or rollout.sglang.tokenizer-path (the engines load the trainer's "
                           "weights, which carry no tokenizer files)")
        opts["tokenizer-path"] = str(Path(job.ckpt.hf).absolute())
    return opts


def sync_dir(job: JobConfig) -> Path:
    """rollout.sync: disk: where the trainer writes each version for the engines."""
    return Path(job.rollout.sync_dir or Path(job.log.run_dir) / "weights").absolute()


def sync_owner(job: JobConfig) -> str:
    """What marks the version directories this run writes (its run directory): the only ones
    it ever removes."""
    return str(Path(job.log.run_dir).absolute())


def update_engines(job: JobConfig, trainer, engines, version: int) -> dict:
    """The trainer's weights into every engine (unless they already serve `version`)."""
    from miles.rollout.sync import sync_disk, sync_object_store, sync_shared

    if engines.version == version:
        return {}
    colocated = job.rollout.placement == "colocated"
    if colocated:
        ray_get_all([e.resume_memory.remote() for e in engines.engine_actors()])
    bucket = job.rollout.bucket_mb << 20
    if job.rollout.sync == "broadcast":
        res = engines.update_by_broadcast(trainer, bucket, version, sync_backend(job))
    elif job.rollout.sync == "disk":
        res = sync_disk(trainer, engines, sync_dir(job), job.model.arch, version, sync_owner(job))
    elif job.rollout.sync == "shared":
        res = sync_shared(trainer, engines, bucket, version)
    else:
        res = sync_object_store(trainer, engines, bucket, version)
    if colocated:
        ray_get_all([e.release_memory.remote() for e in engines.engine_actors()])
    return res


def sync_backend(job: JobConfig) -> str:
    """The broadcast group's backend for trainer ranks and engines alike: nccl on GPUs, gloo on
    CPUs, from the job's resolved device (cluster.device auto must be resolved first: gloo on
    one side and nccl on the other hang until the group's timeout)."""
    device = job.cluster.device
    if device not in ("cpu", "gpu"):
        raise ValueError(f"cluster.device is {device!r}: resolve it (miles.controller.with_device) before a sync")
    return "nccl" if device == "gpu" else "gloo"


def ray_resources() -> dict:
    import ray

    return ray.cluster_resources()


def ray_get_all(refs: list) -> list:
    import ray

    return ray.get(refs)


@contextlib.contextmanager
def generation_phase(job: JobConfig, trainer, engines):
    """Colocated: the trainer's memory out and the engines' in for generation, then back."""
    if job.rollout.placement != "colocated":
        yield
        return
    trainer.call("sleep")
    ray_get_all([e.resume_memory.remote() for e in engines.engine_actors()])
    try:
        yield
    finally:
        ray_get_all([e.release_memory.remote() for e in engines.engine_actors()])
        trainer.call("wake_up")


# --------------------------------------------------------------------------- generate -> reward -> filter
def submit(pool: ThreadPoolExecutor, job, trainer, engines, data, rewards, step: int, version: int,
           busy: Busy) -> Future:
    """Rollout `step` (on the engines' weights of `version`), in the background: the data
    position advances now, in step order. Its generation is a span of the engines' `busy`."""
    if step > job.train.steps:
        return pool.submit(lambda: None)

    def generate() -> Rollout:
        with busy.span():
            return generate_rollout(job, trainer, engines, data, rewards, step, version)

    return pool.submit(generate)


def idle_times(step_time: float, metrics: dict, engines_busy: float) -> dict[str, float]:
    """The step's time and each side's idle share of it: the trainer's is the step less its
    log-prob, training and sync calls (waiting for generation, evaluation, the controller);
    the engines' the step less their generation, evaluation and sync time inside it."""
    trainer_busy = sum(metrics.get(k, 0.0) for k in ("perf/logprob_time", "perf/train_time",
                                                     "perf/update_weights_time"))
    return {"perf/step_time": step_time, "perf/trainer_idle_time": max(0.0, step_time - trainer_busy),
            "perf/engine_idle_time": max(0.0, step_time - engines_busy)}


def generate_rollout(job: JobConfig, trainer, engines, data: PromptSource, rewards: Rewards, step: int,
                     version: int) -> Rollout:
    r = job.rollout
    t0 = time.perf_counter()
    drawn: list[str] = []
    position: dict = {}
    stats = {"tokens": 0, "responses": 0, "reward_time": 0.0, "correct": 0, "truncated": 0, "raw": 0.0}
    before = {**engines.stats, "reward_timeouts": rewards.timeouts}

    def round_(rnd: int) -> list[tuple[list[Response], torch.Tensor]]:
        prompts = data.batch(step, math.ceil(r.rollout_batch_size * r.over_sampling))
        drawn.extend(p.id for p in prompts)
        position.update(data.state())
        groups = sample_groups(job, engines, prompts, r.n_samples_per_prompt, r.temperature, r.top_p,
                               seed=(job.train.seed, step, rnd), version=version)
        t1 = time.perf_counter()
        reward_groups(job, groups, rewards)
        stats["reward_time"] += time.perf_counter() - t1
        for g in groups:
            for x in g:
                stats["tokens"] += x.trained  # the policy's (multi-turn: not the tools')
                stats["responses"] += 1
                stats["correct"] += x.correct
                stats["truncated"] += x.truncated
                stats["raw"] += x.raw
        return filter_scores(groups)

    with generation_phase(job, trainer, engines):
        if r.dynamic_sampling:
            kept, drops = dynamic_filter(round_, r.rollout_batch_size, r.max_rounds)
        else:
            kept, drops = [g for g, _ in round_(0)[: r.rollout_batch_size]], {}
        memory = {} if r.engine != "embedded" else phase_metrics(  # GPUs: the generation phase's memory
            "engine", ray_get_all([e.memory.remote() for e in engines.engine_actors()]))
    seconds = time.perf_counter() - t0
    responses = [x for g in kept for x in g]
    n = max(stats["responses"], 1)
    metrics = {"rollout/raw_reward": stats["raw"] / n, "rollout/accuracy": stats["correct"] / n,
               "rollout/response_len/mean": stats["tokens"] / n, "rollout/truncated_ratio": stats["truncated"] / n,
               "rollout/reward": sum(x.reward for x in responses) / len(responses),
               "rollout/log_probs": sum(float(x.logprobs.sum(dtype=np.float64)) for x in responses)
               / max(1, sum(x.trained for x in responses)),
               "rollout/prompts_drawn": float(len(drawn)),
               "perf/rollout_time": seconds, "perf/reward_time": stats["reward_time"],
               "perf/rollout_tok_per_s": stats["tokens"] / seconds}
    metrics.update({f"rollout/dynamic_filter/{k}": float(v) for k, v in drops.items()} | memory)
    # aborted: responses the engines cut short (an abort, a weight swap), generated again;
    # wrong_weights: responses from weights that are no trainer version, generated again
    after = {**engines.stats, "reward_timeouts": rewards.timeouts}
    metrics.update({f"rollout/{k}": float(after[k] - before[k])
                    for k in ("aborted", "wrong_weights", "reward_timeouts")})
    if r.generate_fn is not None:  # multi-turn: turns and the policy's share of the response tokens
        metrics["rollout/turns/mean"] = sum(x.turns for x in responses) / len(responses)
        metrics["rollout/trained_ratio"] = sum(x.trained for x in responses) / max(1, sum(len(x.ids)
                                                                                          for x in responses))
    return Rollout(step, kept, version, metrics, drawn, position)


def sample_groups(job: JobConfig, engines, prompts: list[Prompt], n: int, temperature: float, top_p: float,
                  seed: tuple, version: int) -> list[list[Response]]:
    """n responses per prompt through the router, from the trainer's weights of `version` (the
    manager generates again what the engines abort or answer from other weights than a trainer
    version); each request seeded by (seed, prompt, i), so a resumed run draws the same samples."""
    r = job.rollout
    params = {"temperature": temperature, "top_p": top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}
    reqs = [{"id": f"{'/'.join(map(str, seed))}/{p.id}/{i}", "input_ids": p.input_ids, "return_logprob": True,
             "sampling_params": params | {"seed": _seed(seed, p.id, i)}}
            for p in prompts for i in range(n)]
    tok = response_tokenizer(job.data.tokenizer, job.data.template)
    owners = [p for p in prompts for _ in range(n)]
    if r.generate_fn is None:  # each result made compact as it arrives (its JSON lists dropped)
        results = engines.generate(reqs, version=version, each=functools.partial(compact_result, tok))
        flat = [Response(p, **res) for p, res in zip(owners, results, strict=True)]
    else:  # the user's function drives each conversation through the router
        samples = [q | {"label": p.label, "messages": p.messages} for q, p in zip(reqs, owners, strict=True)]
        transcripts = engines.generate_transcripts(samples, r.generate_fn, version=version)
        flat = [transcript_response(p, t, r.max_len, tok, q["id"])
                for p, t, q in zip(owners, transcripts, samples, strict=True)]
    return [flat[k * n:(k + 1) * n] for k in range(len(prompts))]


def compact_result(tok, res: dict) -> dict:
    """An engine's /generate result as Response's fields (all but the prompt), arrays instead
    of its JSON lists."""
    meta = res["meta_info"]
    return {"ids": np.asarray(res["output_ids"], dtype=np.int32),
            "logprobs": np.fromiter((x[0] for x in meta["output_token_logprobs"]), np.float32, len(res["output_ids"])),
            "text": response_text(tok, res["output_ids"]), "truncated": meta["finish_reason"]["type"] == "length",
            "version": int(meta["weight_version"])}


def transcript_response(prompt: Prompt, t, max_len: int, tok, sample_id: str) -> Response:
    """A generate function's Transcript as a Response: what follows the prompt, the policy's
    tokens trained and the environment's not."""
    from miles.rollout.manager import RolloutError

    if t.ids[:len(prompt.input_ids)] != prompt.input_ids or t.prompt_len != len(prompt.input_ids):
        raise RolloutError(f"sample {sample_id}: the generate function's transcript does not start with the prompt")
    if len(t.ids) > max_len:
        raise RolloutError(f"sample {sample_id}: the generate function's transcript has {len(t.ids)} tokens, over "
                           f"rollout.max_len={max_len} (what one training row holds): end the conversation sooner")
    if not len(t.ids) == len(t.loss_mask) == len(t.logprobs):
        raise RolloutError(f"sample {sample_id}: the transcript's ids, loss_mask and logprobs differ in length")
    if not t.weight_versions or None in t.weight_versions:
        raise RolloutError(f"sample {sample_id}: the generate function's transcript has no generated turn with a "
                           "weight version (add turns with Transcript.add_generated)")
    k = t.prompt_len
    ids = t.ids[k:]
    return Response(prompt, ids, t.logprobs[k:], response_text(tok, ids),
                    (t.finish_reason or {}).get("type") == "length", mask=t.loss_mask[k:], turns=t.turns,
                    version=min(int(v) for v in t.weight_versions))


def _seed(seed: tuple, prompt_id: str, i: int) -> int:
    import zlib

    return zlib.crc32(f"{seed}/{prompt_id}/{i}".encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=4)
def response_tokenizer(name: str | None, template: str = "deepseek_v4"):
    """What decodes responses for the reward: data.tokenizer as the prompts were rendered with
    it (template hf: the transformers tokenizer of that directory). Loaded once a run."""
    if template == "hf":
        from miles.data.chat import load_hf_tokenizer

        return load_hf_tokenizer(name)
    from tokenizers import Tokenizer

    from miles.data.chat import v4_tokenizer_file
    from miles.data.sft import tokenizer_path

    return Tokenizer.from_file(str(tokenizer_path(name) or v4_tokenizer_file()))


def response_text(tok, ids: list[int]) -> str:
    """A response's text for the reward and the user's code. One cut at max_new_tokens can end
    inside a character (its last tokens hold the first bytes of a multi-byte UTF-8 sequence,
    which decode to one U+FFFD): that fragment is left out. Invalid bytes inside stay U+FFFD."""
    text = tok.decode(ids, skip_special_tokens=True)
    if text.endswith("\ufffd"):
        for k in range(1, min(3, len(ids)) + 1):  # a character is at most 4 bytes: 3 of them cut off
            shorter = tok.decode(ids[:-k], skip_special_tokens=True)
            if text == shorter + "\ufffd":
                return shorter
    return text


def reward_groups(job: JobConfig, groups: list[list[Response]], rewards: Rewards) -> None:
    """Raw rewards (algo.reward or algo.reward_url), then DAPO's overlong shaping."""
    a = job.algo
    flat = [x for g in groups for x in g]
    raw = rewards([{"response": x.text, "label": x.prompt.label, "prompt": x.prompt.messages} for x in flat])
    for x, v in zip(flat, raw, strict=True):
        x.correct, x.raw, x.reward = v > 0, v, v
        if a.overlong_max_len is not None:
            x.reward += float(overlong_penalty(x.trained, a.overlong_max_len, a.overlong_cache))  # the policy's


def filter_scores(groups: list[list[Response]]) -> list[tuple[list[Response], torch.Tensor]]:
    """What dynamic sampling compares within a group: the raw rewards. DAPO keeps a group
    whose accuracy is strictly between 0 and 1; the overlong shaping would make an all-correct
    group's rewards differ by their lengths alone and keep it."""
    return [(g, torch.tensor([x.raw for x in g])) for g in groups]


# --------------------------------------------------------------------------- samples -> train
def to_samples(job: JobConfig, groups: list[list[Response]]) -> list[list[Sample]]:
    """Training samples (prompt + response, trained on the response), grouped into the
    optimizer steps' batches; each token carries its advantage, the engine's log-prob and
    the aggregation weight of its batch (miles.algo.losses.response_weights)."""
    n = job.rollout.n_samples_per_prompt
    rewards = torch.tensor([x.reward for g in groups for x in g], dtype=torch.float64)
    adv = group_advantages(rewards, n, job.algo.advantage).tolist()
    flat = [x for g in groups for x in g]
    size, norm_len = job.train.global_batch_size, job.algo.norm_len or job.rollout.max_new_tokens
    batches = []
    for b in range(0, len(flat), size):
        part = list(zip(flat[b:b + size], adv[b:b + size], strict=True))
        weights = response_weights([x.trained for x, _ in part], job.algo.agg, norm_len)
        batch = []
        for (x, a), w in zip(part, weights, strict=True):
            p = len(x.prompt.input_ids)
            mask = np.ones(len(x.ids), np.int8) if x.mask is None else x.mask  # [T]
            zeros = np.zeros(p, np.float32)  # the prompt's positions  [P]
            batch.append(Sample(np.concatenate((np.asarray(x.prompt.input_ids, np.int32), x.ids)),
                                np.concatenate((np.zeros(p, np.int8), mask)), origin=x.prompt.id, values={
                "advantages": np.concatenate((zeros, (a * mask).astype(np.float32))),
                "rollout_logprobs": np.concatenate((zeros, x.logprobs)),
                "token_weights": np.concatenate((zeros, (w * mask).astype(np.float32)))}))
        batches.append(batch)
    return batches


def layout(job: JobConfig, samples: list[Sample]) -> list[list[MicroBatch]]:
    p = job.train.parallel
    return packed_replica_micro_batches(samples, p.dp, job.train.micro_batch_size, job.data.seq_len,
                                        pad_to_multiple=p.seq_multiple, same_count=p.ep > 1)


def with_logprobs(replicas: list[list[MicroBatch]], logprobs: list[list[torch.Tensor]], field: str):
    return [[replace(mb, **{field: lp}) for mb, lp in zip(mbs, lps, strict=True)]
            for mbs, lps in zip(replicas, logprobs, strict=True)]


def train(job: JobConfig, trainer, batches: list[list[Sample]], step: int) -> tuple[dict[str, float], list[dict]]:
    """The old log-probs (before any update; with one update per rollout the policy's own,
    detached, in the loss) and reference log-probs, then one optimizer step per batch.
    Returns the metrics (the batches' mean) and every rank's result of the first update
    (gradient checksums with log.alignment)."""
    t0 = time.perf_counter()
    steps = [layout(job, b) for b in batches]
    if len(steps) > 1:
        steps = [with_logprobs(s, trainer.forward_logprobs(s), "old_logprobs") for s in steps]
    if job.algo.kl_coef > 0:
        steps = [with_logprobs(s, trainer.forward_logprobs(s, reference=True), "ref_logprobs") for s in steps]
    t1 = time.perf_counter()
    results = [trainer.train_step(s, checksums=job.log.alignment) for s in steps]
    logs = [r[0] for r in results]
    t2 = time.perf_counter()
    keys = [k for k in logs[0] if k not in ("grad_md5", "step_time")]
    out = {f"train/{k}": max(float(x[k]) for x in logs) if k.endswith("_max") else
           sum(float(x[k]) for x in logs) / len(logs) for k in keys}
    # The first update runs on the policy that generated (on-policy modes): its ratio to the
    # old log-probs is 1 and its log-probs are the engine's, up to numerics.
    # With a KL term its kl_loss is 0 on a fresh start (the reference is the starting policy).
    out.update({f"train/first_update/{k}": float(logs[0][k])
                for k in ("ppo_kl", "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max",
                          "tis_weight", "kl_loss") if k in logs[0]})
    tokens = sum(len(s.tokens) - 1 for b in batches for s in b)
    out.update({"perf/logprob_time": t1 - t0, "perf/train_time": t2 - t1, "perf/train_tok_per_s": tokens / (t2 - t1),
                "train/updates": float(len(logs))})
    return out, results[0]


# --------------------------------------------------------------------------- evaluation, records
def evaluates(job: JobConfig, data: PromptSource, step: int) -> bool:
    if not data.eval_samples():
        return False
    every = job.rollout.eval_interval
    return step in (0, job.train.steps) or (every > 0 and step % every == 0)


def evaluate(job: JobConfig, trainer, engines, data: PromptSource, rewards: Rewards, version: int
             ) -> dict[str, float]:
    """avg@k on the held-out prompts with the trainer's weights of `version` (what the engines
    serve now): k = rollout.eval_samples responses each at rollout.eval_temperature / eval_top_p;
    accuracy = the share whose reward is positive. eval/<name>/weight_version: the oldest
    weights that answered (a replaced engine may lag)."""
    r = job.rollout
    with generation_phase(job, trainer, engines):
        groups = sample_groups(job, engines, data.eval_samples(), r.eval_samples, r.eval_temperature,
                               r.eval_top_p, seed=(job.train.seed, "eval"), version=version)
    reward_groups(job, groups, rewards)
    flat = [x for g in groups for x in g]
    name = job.data.eval_name
    return {f"eval/{name}/accuracy": sum(x.correct for x in flat) / len(flat),
            f"eval/{name}/response_len": sum(len(x.ids) for x in flat) / len(flat),
            f"eval/{name}/weight_version": float(min(x.version for x in flat))}


def write_rollout(run_dir: Path, rollout: Rollout, texts: str | int = "all") -> None:
    """rollouts.jsonl: per step the prompt ids drawn and kept, and the reward and text of the
    responses `texts` asks for (log.rollouts: all, none, or N of them, the same N for a step
    whatever the placement)."""
    responses = [x for g in rollout.groups for x in g]
    if texts == "none":
        responses = []
    elif texts != "all" and len(responses) > texts:
        import random

        pick = sorted(random.Random(rollout.step).sample(range(len(responses)), texts))
        responses = [responses[i] for i in pick]
    rec = {"step": rollout.step, "version": rollout.version, "drawn": rollout.drawn,
           "kept": [g[0].prompt.id for g in rollout.groups],
           "samples": [{"prompt": x.prompt.id, "reward": x.reward, "text": x.text, "turns": x.turns,
                        "trained_tokens": x.trained} for x in responses]}
    with open(run_dir / records.ROLLOUTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
