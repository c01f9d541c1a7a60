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

import torch

from miles.train.batching import MicroBatch
from plugins.deepseek_v4.layout import SequenceLayout
from plugins.deepseek_v4.model import IGNORE_INDEX, CausalLMOutput, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.parallel import ParallelContext


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


def label_logprobs(ctx: ParallelContext, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """log p(label) [B, s] for this rank's chunk of `mb` (context parallel), 0 where there is
    no label; differentiable."""
    labels = mb.labels[:, ctx.seq_chunk(mb.shape[1])]
    return torch.where(labels != IGNORE_INDEX, ctx.token_logprobs(logits, labels), 0.0)


def lm_loss(out: CausalLMOutput, mb: MicroBatch, norm: dict[str, torch.Tensor], coef: LossCoefs,
            ctx: ParallelContext) -> LossResult:
    """Cross-entropy of the labels (SFT, pre-training), plus MTP's on the same labels where it
    has a prediction, plus the auxiliary terms."""
    w = mb.loss_mask[:, ctx.seq_chunk(mb.shape[1])].float()  # 0 wherever the label is IGNORE_INDEX
    lp = label_logprobs(ctx, out.logits, mb)  # [B, s]
    lm = -(lp * w).sum() / norm["lm"]
    loss, metrics = lm, {"lm_loss": lm.detach()}
    if out.mtp_logits is not None:
        mtp = -(label_logprobs(ctx, out.mtp_logits, mb) * w * out.mtp_rows).sum() / norm["mtp"]
        loss = loss + coef.mtp * mtp
        metrics["mtp_loss"] = mtp.detach()
    aux, aux_metrics = aux_loss(out.aux, norm, coef)
    loss = loss + aux
    metrics.update(aux_metrics, loss=loss.detach())
    return LossResult(loss, metrics, lp.detach())


LOSSES = {"lm": lm_loss}


def get(name: str):
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}'; known: {sorted(LOSSES)}")
    return LOSSES[name]


def compute(model: DeepSeekV4ForCausalLM, mb: MicroBatch, coef: LossCoefs = LossCoefs(), name: str = "lm",
            norm: dict[str, torch.Tensor] | None = None) -> tuple[CausalLMOutput, LossResult]:
    """One process: forward `mb` and apply the loss, normalised by `norm` (default: this
    micro-batch's own counts). What a trainer rank computes, for tests and tools."""
    if norm is None:
        norm = {k: v.clamp_min(1) for k, v in counts(model, mb).items()}
    out = model(mb.input_ids, doc_ids=mb.doc_ids, aux=coef.aux_terms)
    return out, get(name)(out, mb, norm, coef, model.ctx)
