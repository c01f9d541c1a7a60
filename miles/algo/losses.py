"""The clipped policy-gradient loss with DAPO's options (ALGORITHMS.md).

One formula per token (`token_terms`) and the aggregation as per-token weights
(`sequence_weight`): the loss is sum_t weight_t * pg_t. The trainer's workers use the same two
pieces on micro-batches, with the weights computed once over the whole global batch, so the
aggregation does not depend on how the batch is split.
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


def sequence_weight(tokens: int, total_tokens: int, sequences: int, agg: str, norm_len: int) -> float:
    """The weight of each token of a response of `tokens` tokens in a batch of `sequences`
    responses and `total_tokens` tokens:
      token_mean              1 / total_tokens             (DAPO: every token counts alike);
      seq_mean_token_mean     1 / (tokens * sequences)     (GRPO: every response counts alike);
      seq_mean_token_sum_norm 1 / (norm_len * sequences)   (Dr. GRPO: a constant length)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; known: {', '.join(AGGREGATIONS)}")
    if tokens == 0:
        return 0.0
    if agg == "token_mean":
        return 1.0 / total_tokens
    return 1.0 / ((tokens if agg == "seq_mean_token_mean" else norm_len) * sequences)


def aggregation_weights(mask: torch.Tensor, agg: str, norm_len: int | None = None) -> torch.Tensor:
    """mask [B, T] (1 = a response token, one response per row) -> per-token weights [B, T]."""
    m = mask.to(torch.float64)
    tokens, rows = m.sum(1), int((m.sum(1) > 0).sum())
    w = [sequence_weight(int(n), int(tokens.sum()), rows, agg, norm_len or mask.shape[1]) for n in tokens.tolist()]
    return m * torch.tensor(w, dtype=torch.float64)[:, None]


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


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
                agg: str = "token_mean", rollout_logp: torch.Tensor | None = None, tis_cap: float | None = None,
                norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss over a batch of [B, T] tensors (one response per row; advantages [B, T] or [B]),
    mask [B, T] (1 = a response token), aggregated as `agg` (see sequence_weight; Dr. GRPO's
    norm_len defaults to T). Returns the loss and the token means pg_clipfrac and ppo_kl
    (detached)."""
    a = advantages[:, None] if advantages.dim() == 1 else advantages
    pg, clipped = token_terms(logp, old_logp, a, eps_low, eps_high, dual_clip, rollout_logp, tis_cap)
    w = aggregation_weights(mask, agg, norm_len).to(pg.dtype)
    loss = (pg * w).sum()
    with torch.no_grad():
        m = mask.to(logp.dtype)
        n = m.sum().clamp_min(1)
        metrics = {"pg_clipfrac": (clipped.to(m.dtype) * m).sum() / n, "ppo_kl": ((old_logp - logp) * m).sum() / n}
    return loss, metrics
