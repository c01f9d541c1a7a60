"""The RL loop (`miles rl`): DAPO / GRPO on a TrainGroup and rollout engines behind SGLang's router.

    run_rl(job):
        session  <- run directory, Ray, monitor, checkpoints (miles.session, as SFT's)
        start    <- the checkpoint ckpt.load names (weights, optimizer, data position), or 0
        engines  <- the trainer's weights (version = the step they come from)
        for step in start+1..steps:
            rollout  <- n responses per prompt -> rewards -> groups whose rewards differ
                        (dynamic sampling), generated in the background (miles.rl.schedule
                        says when each starts and on which weights)
            samples  <- group advantages, per-token weights of each optimizer step's batch
            train    <- old (and reference) log-probs, then updates_per_rollout optimizer steps
            eval     <- held-out accuracy of this step's weights every rollout.eval_interval steps
            log, checkpoint

The pieces that decide (advantages, the loss, rewards, filtering, aggregation weights) are
pure functions in miles.algo; the rest of miles.rl moves data between them and the actors.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TextIO

import ray

from miles.algo.rewards import Rewards
from miles.config import JobConfig
from miles.data.prompts import PromptSource
from miles.memory import phase_metrics
from miles.observe import alignment
from miles.observe.busy import Busy
from miles.rl.engines import check_engines, colocation, start_engines, sync_dir, sync_owner, update_engines
from miles.rl.evaluate import evaluate, evaluates
from miles.rl.rollout import Rollout, generate_rollout, staleness, write_rollout
from miles.rl.schedule import Generate, Sync, step_plan
from miles.rl.train import to_samples, train
from miles.rollout.sync import remove_older_versions
from miles.rollout.tool_use import tool_schemas
from miles.session import RunResult, profiling, session, start_trainer


def run_rl(job: JobConfig, stream: TextIO | None = None) -> RunResult:
    with session(job, stream) as s:
        job, r, monitor, ckpt = s.job, s.job.rollout, s.monitor, s.ckpt
        check_engines(job, ray.cluster_resources().get("GPU", 0))
        data = s.closing(PromptSource(job.data, job.train.seed, r.max_len - r.max_new_tokens, s.run_dir,
                                      report=monitor.print, tools=tool_schemas(r.tools)))
        rewards = s.closing(Rewards.of(job.algo))
        shared = colocation(job)  # colocated on GPUs: the bundles trainer ranks and engines share
        trainer = s.closing(start_trainer(job, shared), "shutdown")
        start = restore(job, ckpt, trainer, data)
        if r.sync == "disk":  # the versions written for the engines (the last one too: the run is over)
            s.stack.callback(remove_older_versions, sync_dir(job), job.train.steps + 1, sync_owner(job))
        engines = s.closing(start_engines(job, s.run_dir, trainer, start, shared), "shutdown")
        update_engines(job, trainer, engines, start)
        monitor.print(f"miles rl: {job.name}: {job.train.steps} rollouts of {r.rollout_batch_size} prompts x "
                      f"{r.n_samples_per_prompt} samples, {job.updates_per_rollout} optimizer step(s) each; "
                      f"{r.placement}{', one-step-off' if r.off_policy else ''}; run directory {s.run_dir}")
        first = None
        if start == 0 and evaluates(job, data, 0):
            monitor.record(0, first := evaluate(job, trainer, engines, data, rewards, version=0))
        rollouts = s.closing(Rollouts(job, trainer, engines, data, rewards))
        rollouts.carry_out([Generate(start + 1, start)])
        history: list[dict] = []
        for step in range(start + 1, job.train.steps + 1):
            plan = step_plan(step, job.train.steps, r.off_policy, r.placement == "colocated")
            t0 = time.perf_counter()
            rollout = rollouts.next()
            t_wait = time.perf_counter() - t0
            synced = rollouts.carry_out(plan.while_training)
            samples = to_samples(job, rollout.groups)
            with profiling(job, trainer, s.run_dir, step):
                trained, ranks = train(job, trainer, samples, step)
            if job.log.alignment:  # the rollout's first update (each rank's gradient checksums)
                alignment.append(s.run_dir, alignment.ranks_record(step, ranks[0], ranks[0]["grad_norm"],
                                                                   [x["grad_md5"] for x in ranks]))
            metrics = rollout.metrics | trained | data.metrics() | staleness(rollout, step)
            metrics |= phase_metrics("trainer", trainer.call("memory"))  # GPUs: the training phase's memory
            if evaluates(job, data, step):  # this step's weights, never beside a rollout's generation
                rollouts.wait()
                synced += rollouts.carry_out([Sync(step)])
                metrics.update(rollouts.evaluate(step))
            synced += rollouts.carry_out(plan.after_training)
            metrics.update({"perf/rollout_wait_time": t_wait, "perf/update_weights_time": synced})
            metrics.update(rollouts.idle_times(t0, metrics))
            write_rollout(s.run_dir, rollout, job.log.rollouts)
            monitor.log(step, metrics)
            history.append(metrics)
            ckpt.maybe_save(step, trainer, Position(rollout.data_state))
            rollouts.carry_out(plan.after_save)
        summary = s.finish(trainer, data, history, ("train/", "eval/", "rollout/", "data/"))
        key = f"eval/{job.data.eval_name}/accuracy"
        if first is not None and key in summary:
            summary[f"{key}_start"] = first[key]
            monitor.print(f"held-out accuracy ({job.data.eval_name}, avg@{r.eval_samples}): {first[key]:.1%} before "
                          f"RL, {summary[key]:.1%} after {job.train.steps} rollouts")
        monitor.summary(summary)
    return RunResult(s.run_dir, history, summary)


def restore(job: JobConfig, ckpt, trainer, data: PromptSource) -> int:
    """The step to start from (ckpt.load's checkpoint, else 0), with the KL reference kept:
    algo.kl_reference's weights, else those the run started from (on a resume: loaded again
    from where the first run started, before the checkpoint's)."""
    named = job.algo.kl_reference
    ckpt.check_reference(named)
    if job.algo.kl_coef > 0 and ckpt.resumes and named is None:
        ckpt.load_start_weights(trainer)
        trainer.call("keep_reference")
    start = ckpt.restore(trainer, data)
    if job.algo.kl_coef > 0 and (named is not None or not ckpt.resumes):  # named, or the weights just loaded
        trainer.call("keep_reference", None if named is None else str(named))
    return start


class Rollouts:
    """The rollout in flight (one background thread generates, in step order), the engines'
    weight syncs, and how busy the engines were: what the schedule's actions act on."""

    def __init__(self, job: JobConfig, trainer, engines, data: PromptSource, rewards: Rewards):
        self.job, self.trainer, self.engines, self.data, self.rewards = job, trainer, engines, data, rewards
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.pending: Future | None = None
        self.busy = Busy()  # generation, evaluation and sync: the engines' idle time per step

    def carry_out(self, actions) -> float:
        """Run the schedule's actions in order; returns the seconds spent syncing weights."""
        synced = 0.0
        for a in actions:
            if isinstance(a, Sync):
                with self.busy.span():
                    synced += update_engines(self.job, self.trainer, self.engines, a.version).get("seconds", 0.0)
            elif isinstance(a, Generate) and a.step <= self.job.train.steps:
                self.pending = self.pool.submit(self._generate, a.step, a.version)
        return synced

    def _generate(self, step: int, version: int) -> Rollout:
        """Rollout `step` on the engines' weights of `version`; the data position advances in
        step order (one thread)."""
        with self.busy.span():
            return generate_rollout(self.job, self.trainer, self.engines, self.data, self.rewards, step, version)

    def next(self) -> Rollout:
        return self.pending.result()

    def wait(self) -> None:
        """Until the generation in flight (one-step-off: the next rollout's) has ended."""
        if self.pending is not None:
            self.pending.result()

    def evaluate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.busy.span():
            out = evaluate(self.job, self.trainer, self.engines, self.data, self.rewards, version=step)
        return out | {"perf/eval_time": time.perf_counter() - t0}

    def idle_times(self, t0: float, metrics: dict) -> dict[str, float]:
        """The step's time (from t0) and each side's idle share of it: the trainer's is the
        step less its log-prob, training and sync calls (waiting for generation, evaluation,
        the controller); the engines' the step less their generation, evaluation and sync."""
        t1 = time.perf_counter()
        trainer_busy = sum(metrics.get(k, 0.0) for k in ("perf/logprob_time", "perf/train_time",
                                                         "perf/update_weights_time"))
        return {"perf/step_time": t1 - t0, "perf/trainer_idle_time": max(0.0, t1 - t0 - trainer_busy),
                "perf/engine_idle_time": max(0.0, t1 - t0 - self.busy.within(t0, t1))}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)  # a stopped job does not wait for its generation


@dataclass
class Position:
    """The data position a checkpoint saves: taken when the rollout was drawn, since the next
    one may already be drawing (one-step-off, or generation ahead of the save)."""

    saved: dict

    def state(self) -> dict:
        return self.saved
