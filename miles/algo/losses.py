"""The clipped policy-gradient loss with DAPO's options (docs/algorithms.md).

One formula per token (`token_terms`) and the aggregation as per-token weights
(`response_weights`): the loss is sum_t weight_t * pg_t. The RL loop computes the weights once
per optimizer step's batch (miles.rl.train.to_samples) and the trainer's workers apply token_terms
to their micro-batches (miles.train.losses.policy_loss), so the aggregation does not depend on
how the batch is split.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2,
                eps_high: float = 0.28, dual_clip: float | None = None, rollout_logp: torch.Tensor | None = None,
                tis_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (any shape, advantages broadcast to it): r = exp(logp - old_logp),
    pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with dual_clip c (> 1), tokens with
    A < 0 are capped at -c A; with tis_cap C, pg is weighted by min(exp(old_logp - rollout_logp), C)
    (truncated importance sampling of the rollout/train mismatch). Returns pg (differentiable
    in logp) and where the clip was active."""
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    a = advantages.expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg = torch.where(a < 0, torch.minimum(pg, -a * dual_clip), pg)
    if tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap needs rollout_logp")
        pg = pg * torch.exp(old_logp - rollout_logp).clamp(max=tis_cap).detach()
    return pg, clipped


def response_weights(trained: list[int], agg: str, norm_len: int) -> list[float]:
    """The weight of each token of each response in one optimizer step's batch, from the
    responses' trained-token counts:
      token_mean              1 / the batch's trained tokens   (DAPO: every token counts alike);
      seq_mean_token_mean     1 / (tokens * responses)         (GRPO: every response counts alike);
      seq_mean_token_sum_norm 1 / (norm_len * responses)       (Dr. GRPO: a constant length).
    `responses` counts those with a trained token: one with none (a multi-turn response whose
    turns were all the environment's) has no mean to average, and its weight is 0."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; known: {', '.join(AGGREGATIONS)}")
    total, rows = sum(trained), sum(n > 0 for n in trained)
    if agg == "token_mean":
        return [1.0 / total if n else 0.0 for n in trained]
    return [1.0 / ((n if agg == "seq_mean_token_mean" else norm_len) * rows) if n else 0.0 for n in trained]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(policy || reference) from samples of the policy (Schulman):
    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, where log r = logp - ref_logp."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
