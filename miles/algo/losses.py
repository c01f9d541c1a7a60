"""The clipped policy-gradient loss with DAPO's options (ALGORITHMS.md), on [B, T] tensors."""

from __future__ import annotations

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
                agg: str = "token_mean", rollout_logp: torch.Tensor | None = None, tis_cap: float | None = None,
                norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token: r = exp(logp - old_logp), loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A);
    with dual_clip c (> 1), tokens with A < 0 are capped at -c A; with tis_cap C, each token is
    weighted by min(exp(old_logp - rollout_logp), C) (truncated importance sampling of the
    rollout/train mismatch). advantages [B, T] or [B] (one per sequence); mask [B, T] (1 =
    a response token). Aggregation over masked tokens:
      token_mean              sum / number of tokens (DAPO);
      seq_mean_token_mean     mean over sequences of each one's token mean (GRPO);
      seq_mean_token_sum_norm mean over sequences of each one's token sum / norm_len (Dr. GRPO;
                              default T).
    Returns the loss and metrics pg_clipfrac, ppo_kl (token means, detached)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; known: {', '.join(AGGREGATIONS)}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    a = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    m = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg3 = -a * dual_clip
        pg = torch.where(a < 0, torch.minimum(pg, pg3), pg)
    if tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap needs rollout_logp")
        pg = pg * torch.exp(old_logp - rollout_logp).clamp(max=tis_cap).detach()
    n = m.sum().clamp_min(1)
    if agg == "token_mean":
        loss = (pg * m).sum() / n
    else:
        per_seq = (pg * m).sum(1)
        tokens = m.sum(1)
        has = tokens > 0
        denom = tokens.clamp_min(1) if agg == "seq_mean_token_mean" else float(norm_len or logp.shape[1])
        loss = (per_seq / denom)[has].sum() / has.sum().clamp_min(1)
    with torch.no_grad():
        metrics = {"pg_clipfrac": (clipped.to(m.dtype) * m).sum() / n, "ppo_kl": (-log_ratio * m).sum() / n}
    return loss, metrics
