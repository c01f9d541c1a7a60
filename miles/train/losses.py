"""The trainer's loss functions, chosen by name (`algo.loss` in a job file).

A loss function runs in the TrainWorker on the last pipeline stage, once per micro-batch,
inside Megatron's schedules:

    fn(out: CausalLMOutput, mb: MicroBatch, norm: dict[str, Tensor], coef: LossCoefs, ctx) -> LossResult

`out` covers this rank's chunk of the tokens (context parallel) and its shard of the
vocabulary (tensor parallel: log-probabilities come from `ctx.token_logprobs`, which never
gathers the vocabulary). Every term is a sum over its positions divided by `norm[term]`,
the global batch's count of those positions (`counts`), so micro-batching and data or
context parallelism leave every gradient unchanged, and each term keeps its own weight
whatever share of a batch is prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from miles.algo.losses import kl_estimate, token_terms
from miles.train.batching import MicroBatch
from plugins.deepseek_v4.layout import SequenceLayout
from plugins.deepseek_v4.model import IGNORE_INDEX, CausalLMOutput, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.parallel import ParallelContext, VocabHead


@dataclass(frozen=True)
class LossCoefs:
    """Weights of the terms beside the main loss (DeepSeek-V3's MTP weight 0.3; the indexer
    KL's is ours; the sequence balance loss is off as in V4's aux-loss-free balancing)."""

    mtp: float = 0.3
    indexer: float = 0.01
    balance: float = 0.0

    @property
    def aux_terms(self) -> tuple[str, ...]:
        """The auxiliary sums the model must compute for these weights."""
        return tuple(k for k in ("indexer", "balance") if getattr(self, k) > 0)


@dataclass(frozen=True)
class PolicyOptions:
    """The policy loss's settings (a job's `algo` section; docs/algorithms.md)."""

    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher
    dual_clip: float | None = None  # cap of -A * ratio for negative advantages (> 1)
    tis_cap: float | None = None  # truncated importance sampling of the rollout/train mismatch
    kl_coef: float = 0.0  # weight of the KL to the reference policy (needs ref_logprobs)
    kl_estimator: str = "k3"
    temperature: float = 1.0  # the rollouts' sampling temperature: log-probs of logits / temperature

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy rollouts: 1), got {self.temperature}")


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar, differentiable: this micro-batch's share of the global loss
    metrics: dict[str, torch.Tensor]  # detached shares of the global means (sum over micro-batches and ranks)
    logprobs: torch.Tensor  # [B, s] log p(label), 0 where there is no label (detached)


def counts(model: DeepSeekV4ForCausalLM, mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Positions each term covers in this micro-batch (whole sequences): "lm" the loss
    weight, "mtp" the weight where an MTP prediction exists, "indexer" the query rows that see a
    compressed entry (all of them, prompt included: the indexer learns attention everywhere),
    "balance" the rows with tokens."""
    b, s = mb.shape
    rows = model.loss_rows(SequenceLayout.build(b, s, mb.input_ids.device, None, mb.doc_ids))
    w = mb.loss_mask.float()
    return {"lm": w.sum(), "mtp": (w * rows["mtp"]).sum(), "indexer": rows["indexer"].sum().float(),
            "balance": rows["tokens"].any(1).sum().float()}


def aux_loss(aux: dict[str, torch.Tensor], norm: dict[str, torch.Tensor], coef: LossCoefs
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted auxiliary terms of one stage (any pipeline stage holds some)."""
    total = torch.zeros((), device=norm["lm"].device)
    metrics = {}
    for k, v in aux.items():
        term = v / norm[k]
        total = total + getattr(coef, k) * term
        metrics[f"{k}_loss"] = term.detach()
    return total, metrics


def label_logprobs(ctx: ParallelContext, logits: torch.Tensor | VocabHead, mb: MicroBatch,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(label) [B, s] under softmax(logits / temperature) for this rank's chunk of `mb`
    (context parallel), 0 where there is no label; differentiable. From a head (the trainer's
    path: chunked, no [B, s, V] logits kept) or from logits."""
    labels = mb.labels[:, ctx.seq_chunk(mb.shape[1])]
    if isinstance(logits, VocabHead):
        lp = ctx.head_logprobs(logits, labels, temperature)
    else:
        lp = ctx.token_logprobs(logits if temperature == 1.0 else logits / temperature, labels)
    return torch.where(labels != IGNORE_INDEX, lp, 0.0)


def lm_loss(out: CausalLMOutput, mb: MicroBatch, norm: dict[str, torch.Tensor], coef: LossCoefs,
            ctx: ParallelContext) -> LossResult:
    """Cross-entropy of the labels (SFT, pre-training), plus MTP's on the same labels where it
    has a prediction, plus the auxiliary terms."""
    w = mb.loss_mask[:, ctx.seq_chunk(mb.shape[1])].float()  # 0 wherever the label is IGNORE_INDEX
    lp = label_logprobs(ctx, out.head, mb)  # [B, s]
    lm = -(lp * w).sum() / norm["lm"]
    return _with_side_terms(lm, {"lm_loss": lm.detach()}, out, mb, norm, coef, ctx, w, lp)


def _with_side_terms(loss: torch.Tensor, metrics: dict, out: CausalLMOutput, mb: MicroBatch, norm: dict,
                     coef: LossCoefs, ctx: ParallelContext, w: torch.Tensor, lp: torch.Tensor) -> LossResult:
    """The main loss plus MTP's cross-entropy on the labels weighted `w` (where MTP has a
    prediction) and the auxiliary terms."""
    if out.mtp_head is not None and coef.mtp > 0:
        mtp = -(label_logprobs(ctx, out.mtp_head, mb) * w * out.mtp_rows).sum() / norm["mtp"]
        loss = loss + coef.mtp * mtp
        metrics["mtp_loss"] = mtp.detach()
    aux, aux_metrics = aux_loss(out.aux, norm, coef)
    loss = loss + aux
    metrics.update(aux_metrics, loss=loss.detach())
    return LossResult(loss, metrics, lp.detach())


def policy_loss(out: CausalLMOutput, mb: MicroBatch, norm: dict[str, torch.Tensor], coef: LossCoefs,
                ctx: ParallelContext, opts: PolicyOptions = PolicyOptions()) -> LossResult:
    """The clipped policy-gradient loss (miles.algo.losses.token_terms) summed with the
    micro-batch's token_weights, which carry the aggregation and the global batch's
    normaliser; plus the KL to the reference (same weights), MTP's cross-entropy on the
    response tokens and the auxiliary terms. Metrics (token means over the global batch's
    response tokens): pg_clipfrac, ppo_kl, entropy, train_rollout_logprob_abs_diff (and its _max
    over the tokens), train_rollout_k3_kl, tis_weight, tis_clipfrac, kl_loss. Log-probs and
    entropy are those of the rollouts' sampling temperature (opts.temperature), the
    distribution the engines sampled from."""
    if mb.advantages is None or mb.token_weights is None:
        raise ValueError("the policy loss needs micro-batches with advantages and token_weights")
    cols = ctx.seq_chunk(mb.shape[1])
    m = mb.loss_mask[:, cols].float()
    lp = label_logprobs(ctx, out.head, mb, opts.temperature)  # [B, s]
    old = lp.detach() if mb.old_logprobs is None else mb.old_logprobs[:, cols]
    roll = None if mb.rollout_logprobs is None else mb.rollout_logprobs[:, cols]
    pg, clipped = token_terms(lp, old, mb.advantages[:, cols], opts.eps_low, opts.eps_high, opts.dual_clip,
                              roll, opts.tis_cap)
    weights = mb.token_weights[:, cols] * m
    loss = (pg * weights).sum()
    n = norm["lm"]
    metrics = {"pg_loss": loss.detach(), "pg_clipfrac": (clipped.float() * m).sum() / n,
               "ppo_kl": ((old - lp.detach()) * m).sum() / n,
               "entropy": (ctx.head_entropy(out.head, opts.temperature) * m).sum() / n}
    if roll is not None:
        gap = (lp.detach() - roll).abs() * m
        metrics["train_rollout_logprob_abs_diff"] = gap.sum() / n
        metrics["train_rollout_logprob_abs_diff_max"] = gap.amax() if gap.numel() else gap.sum()  # "_max": a max
        d = lp.detach() - roll  # k3 of KL(engine || trainer) on the engine's own samples
        metrics["train_rollout_k3_kl"] = ((torch.expm1(d) - d) * m).sum() / n
        if opts.tis_cap is not None:  # the truncated IS weights token_terms applied
            w = torch.exp(old - roll)
            metrics["tis_weight"] = (w.clamp(max=opts.tis_cap) * m).sum() / n
            metrics["tis_clipfrac"] = ((w > opts.tis_cap).float() * m).sum() / n
    if opts.kl_coef > 0:
        if mb.ref_logprobs is None:
            raise ValueError("algo.kl_coef > 0 needs the reference log-probs (ref_logprobs)")
        kl = (kl_estimate(lp, mb.ref_logprobs[:, cols], opts.kl_estimator) * weights).sum()
        loss = loss + opts.kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    return _with_side_terms(loss, metrics, out, mb, norm, coef, ctx, m, lp)


def temperature(name: str, options: dict | None = None) -> float:
    """The temperature loss `name` takes its log-probs at (the policy loss's option; 1 for the
    others): forward-only log-probs (old, reference) must use the same."""
    return PolicyOptions(**(options or {})).temperature if name == "policy" else 1.0


LOSSES = {"lm": lm_loss, "policy": policy_loss}


def get(name: str, options: dict | None = None):
    """The loss function `name`; `options` are the policy loss's (PolicyOptions fields)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}'; known: {sorted(LOSSES)}")
    if name == "policy":
        return partial(policy_loss, opts=PolicyOptions(**(options or {})))
    if options:
        raise ValueError(f"loss '{name}' takes no options, got {sorted(options)}")
    return LOSSES[name]


def compute(model: DeepSeekV4ForCausalLM, mb: MicroBatch, coef: LossCoefs = LossCoefs(), name: str = "lm",
            norm: dict[str, torch.Tensor] | None = None, options: dict | None = None
            ) -> tuple[CausalLMOutput, LossResult]:
    """One process: forward `mb` and apply the loss, normalised by `norm` (default: this
    micro-batch's own counts). What a trainer rank computes, for tests and tools."""
    if norm is None:
        norm = {k: v.clamp_min(1) for k, v in counts(model, mb).items()}
    out = model(mb.input_ids, doc_ids=mb.doc_ids, aux=coef.aux_terms, routed_experts=mb.routed_experts,
                indexer_picks=mb.indexer_picks)
    return out, get(name, options)(out, mb, norm, coef, model.ctx)
