"""A rollout's responses as training samples (advantages, the engine's log-probs, each
optimizer step's aggregation weights) and the trainer's updates on them."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from miles.algo.advantages import group_advantages
from miles.algo.losses import response_weights
from miles.config import JobConfig
from miles.data.sample import Sample
from miles.rl.rollout import Response
from miles.train.batching import MicroBatch, packed_replica_micro_batches


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
            # the last token was never read by the engine: -1, it routes and picks as the trainer does
            routes, picks = (None if a is None else np.concatenate((a, np.full((1, *a.shape[1:]), -1, a.dtype)))
                             for a in (x.routes, x.picks))  # [P + T, L, k], [P + T, C, K]
            batch.append(Sample(np.concatenate((np.asarray(x.prompt.input_ids, np.int32), x.ids)),
                                np.concatenate((np.zeros(p, np.int8), mask)), origin=x.prompt.id, routes=routes,
                                picks=picks,
                                values={
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
                          "train_rollout_k3_kl", "tis_weight", "kl_loss", "router_replay_disagreement",
                          "indexer_replay_disagreement") if k in logs[0]})
    tokens = sum(len(s.tokens) - 1 for b in batches for s in b)
    if job.algo.routing_replay:  # positions whose experts came from the engine (the rest: padding, last tokens)
        out["train/replayed_tokens"] = float(sum(int((mb.routed_experts[..., :1, :1] >= 0).sum()) for s in steps
                                                 for mbs in s for mb in mbs if mb.routed_experts is not None))
    out.update({"perf/logprob_time": t1 - t0, "perf/train_time": t2 - t1, "perf/train_tok_per_s": tokens / (t2 - t1),
                "train/updates": float(len(logs))})
    return out, results[0]
