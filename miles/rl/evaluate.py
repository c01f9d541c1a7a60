"""Held-out accuracy of the engines' weights: when, and avg@k."""

from __future__ import annotations

from miles.algo.rewards import Rewards
from miles.config import JobConfig
from miles.data.prompts import PromptSource
from miles.rl.engines import generation_phase
from miles.rl.rollout import reward_groups, sample_groups


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
