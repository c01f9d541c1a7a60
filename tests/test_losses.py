"""The trainer's loss functions (miles.train.losses) on the tiny all-features model, one process.

Each term is a sum over its own positions divided by the global batch's count of them; the
layout parity suite (tests/test_parallel_layouts.py) runs the same functions sharded.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, random_ids, tiny_model, without_near_ties

from miles.train import losses
from miles.train.batching import MicroBatch
from plugins.deepseek_v4.model import IGNORE_INDEX


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    return lab


def ones() -> dict[str, torch.Tensor]:
    """Normalisers of 1: every term a plain sum."""
    return {k: torch.tensor(1.0) for k in ("lm", "mtp", "indexer", "balance")}


def test_packed_loss_equals_separate_losses(seed):
    """Token losses of packed documents equal the separate runs (summed, unnormalised),
    including the MTP loss, whose first token of each document has no prediction. (Documents
    with a near tie in the packed forward are drawn again: there the rounding may choose.)"""
    model = tiny_model(seed).eval()
    docs = torch.tensor([[0] * 37 + [1] * 29])
    g = torch.Generator().manual_seed(seed + 7)
    ab = without_near_ties(model, lambda: torch.randint(0, 320, (1, 66), generator=g), doc_ids=docs)
    a, b = ab[:, :37], ab[:, 37:]
    with torch.no_grad():
        la = losses.compute(model, MicroBatch.lm(a, labels_of(a)), norm=ones())[1].metrics
        lb = losses.compute(model, MicroBatch.lm(b, labels_of(b)), norm=ones())[1].metrics
        mb = MicroBatch.lm(ab, torch.cat((labels_of(a), labels_of(b)), 1), docs)
        lp = losses.compute(model, mb, norm=ones())[1].metrics
    for k in ("lm_loss", "mtp_loss"):
        assert_close(lp[k], la[k] + lb[k], atol=1e-4, what=k)


def test_loss_values_and_mask(seed):
    """lm / mtp losses are token means of cross-entropy over trained positions only (MTP's
    where it has a prediction: row 0's second document starts at 15, inside the trained span,
    and has none there); the total adds the weighted terms."""
    model = tiny_model(seed).train()
    ids = random_ids(seed, 2, 30)
    docs = torch.zeros(2, 30, dtype=torch.long)
    docs[0, 15:] = 1
    lab = labels_of(ids)
    lab[0, 14] = IGNORE_INDEX
    mask = torch.zeros(ids.shape)
    mask[:, 10:25] = 1
    mask[0, 14] = 0
    coef = losses.LossCoefs(mtp=0.7, indexer=0.05)
    out, res = losses.compute(model, MicroBatch(ids, lab, mask, docs), coef)
    lm_at, mtp_at = mask.bool(), mask.bool().clone()
    mtp_at[0, 15] = False
    ce = torch.nn.functional.cross_entropy(out.logits[lm_at], lab[lm_at])
    mce = torch.nn.functional.cross_entropy(out.mtp_logits[mtp_at], lab[mtp_at])
    m = res.metrics
    assert_close(m["lm_loss"], ce, atol=1e-5, what="lm")
    assert_close(m["mtp_loss"], mce, atol=1e-5, what="mtp")
    assert m["indexer_loss"] > 0
    assert_close(res.loss.detach(), m["lm_loss"] + 0.7 * m["mtp_loss"] + 0.05 * m["indexer_loss"], atol=1e-6)
    assert_close(m["loss"], res.loss.detach(), atol=0)
    want = -torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), lab.clamp_min(0).flatten(),
                                              reduction="none").view_as(lab)
    assert_close(res.logprobs, torch.where(lab != IGNORE_INDEX, want, 0.0).detach(), atol=1e-5, what="logprobs")


def test_micro_batches_sum_to_full_batch_gradients(seed):
    """With the global batch's counts as normalisers, 1 micro-batch of 4 equals 4
    micro-batches of 1 in every gradient, MTP and indexer auxiliary losses included. (Ids with a
    near tie are drawn again: rows alone and together round differently.)"""
    model = tiny_model(seed).train()
    g = torch.Generator().manual_seed(seed + 7)
    ids = without_near_ties(model, lambda: torch.randint(0, 320, (4, 40), generator=g))
    lab = labels_of(ids)
    lab[1, :13] = IGNORE_INDEX
    full_mb = MicroBatch.lm(ids, lab)
    norm = losses.counts(model, full_mb)
    losses.compute(model, full_mb, norm=norm)[1].loss.backward()
    full = {k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for i in range(4):
        losses.compute(model, full_mb.rows(i, i + 1), norm=norm)[1].loss.backward()
    for k, p in model.named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        # fp32 sums in a different order: ~1e-7 relative; 1e-6 + 1e-4 relative leaves margin.
        assert_close(got, full[k], atol=1e-6, rtol=1e-4, what=k)


def test_counts_cover_each_terms_own_positions():
    """Packed documents of 5 and 3 tokens and 2 of padding; training only the second half:
    MTP counts trained positions that are not a document's first, the indexer every query
    row that sees a CSA block (in-document position >= 3, prompt included), balance the rows."""
    model = tiny_model(0)
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1], [0] * 10])
    ids = torch.zeros(2, 10, dtype=torch.long)
    lab = torch.where(docs >= 0, 1, IGNORE_INDEX)
    mask = (lab != IGNORE_INDEX).float()
    mask[:, :5] = 0
    c = losses.counts(model, MicroBatch(ids, lab, mask, docs))
    assert c["lm"] == 3 + 5
    assert c["mtp"] == 2 + 5, "position 5 starts document 1: no MTP prediction"
    assert c["indexer"] == 2 + 7, "rows at in-document positions 3, 4 and 3..9"
    assert c["balance"] == 2


def test_indexer_count_is_the_rows_the_kl_covers(seed):
    """Guards the count drifting from the KL: losses.counts' indexer rows are exactly the query
    rows that see a compressed entry of a CSA layer (layout.visible), on random packed rows."""
    from plugins.deepseek_v4.layout import SequenceLayout

    model = tiny_model(0)
    g = torch.Generator().manual_seed(seed)
    docs = torch.cumsum((torch.rand(3, 50, generator=g) < 0.08).long(), 1)
    docs[2, 40:] = -1
    ids = torch.zeros(3, 50, dtype=torch.long)
    mb = MicroBatch(ids, torch.full((3, 50), IGNORE_INDEX), torch.zeros(3, 50), docs)
    layout = SequenceLayout.build(3, 50, None, None, docs)
    sees = layout.visible(layout.blocks(4)).any(-1)  # [B, S]: some CSA entry is visible
    assert losses.counts(model, mb)["indexer"] == sees.sum()


def test_aux_losses_do_not_change_when_positions_are_masked_as_prompt(seed):
    """Guards auxiliary losses normalised by the wrong count:
    - the indexer KL covers every query row that sees a CSA block, prompt or not: masking 60
      of 64 positions as prompt must not change its value or the indexer's gradients (the
      old normalisation, by the number of trained labels, grew it ~16x);
    - the MTP loss covers trained positions that have an MTP prediction: masking each
      document's first position (which has none) must not change its value or the MTP
      block's gradients (the old normalisation, by the LM's count, changed it).
    Each check also shows that the old normaliser would have moved, so the test can fail."""
    model = tiny_model(seed).train()
    ids = random_ids(seed, 2, 64)
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64])
    lab = labels_of(ids)
    lab[0, [19, 49]] = IGNORE_INDEX  # a document's last token has no target inside it
    full = MicroBatch.lm(ids, lab, docs)

    def run(mb: MicroBatch) -> tuple[dict, dict, dict]:
        model.zero_grad()
        norm = losses.counts(model, mb)
        _, res = losses.compute(model, mb, norm=norm)
        res.loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()
                 if p.grad is not None and (".indexer." in k or k.startswith("mtp."))}
        return {k: v.item() for k, v in res.metrics.items()}, grads, norm

    base, g_base, n_base = run(full)
    mask = full.loss_mask.clone()
    mask[:, :60] = 0  # the first 60 of each row's 64 positions are prompt
    prompt, g_prompt, n_prompt = run(MicroBatch(ids, lab, mask, docs))
    assert abs(prompt["indexer_loss"] - base["indexer_loss"]) <= 1e-6 * base["indexer_loss"]
    for k in (k for k in g_base if ".indexer." in k):
        assert_close(g_prompt[k], g_base[k], atol=1e-9, rtol=1e-5, what=f"indexer grad {k}")
    assert n_base["lm"] / n_prompt["lm"] > 15, "the old normaliser (trained labels) would have moved"

    first = full.loss_mask.clone()
    first[0, [0, 20, 50]] = 0
    first[1, 0] = 0
    firsts, g_first, n_first = run(MicroBatch(ids, lab, first, docs))
    assert abs(firsts["mtp_loss"] - base["mtp_loss"]) <= 1e-6 * base["mtp_loss"]
    for k in (k for k in g_base if k.startswith("mtp.") and ".indexer." not in k):
        assert_close(g_first[k], g_base[k], atol=1e-9, rtol=1e-4, what=f"mtp grad {k}")
    assert n_first["lm"] != n_base["lm"] and n_first["mtp"] == n_base["mtp"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_loss_in_the_trainer_is_the_formula(seed, temperature):
    """The trainer's policy loss with the RL loop's token weights (response_weights, GRPO's
    per-response mean) equals the clipped objective (docs/algorithms.md) written out here in
    float64 from the logits at the rollouts' temperature, log_softmax(z / T): loss, head
    gradient, clip fraction; the entropy metric is the tempered softmax's too, and the
    trainer-engine metrics (mean and largest |log-prob difference|, the k3 KL) are theirs
    against rollout log-probs that differ from the trainer's. (Old log-probs that put a ratio
    within 1e-4 of a clip edge are drawn again: there fp32 and float64 may clip otherwise.)"""
    from miles.algo.losses import response_weights

    model = tiny_model(seed)
    ids = random_ids(seed, 3, 24)
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    mask = (lab != IGNORE_INDEX).float()
    mask[:, :7] = 0  # the prompt
    mask[2, 15:] = 0  # a shorter response
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lp0 = losses.compute(model, MicroBatch(ids, lab, mask))[1].logprobs
        lp_t = torch.log_softmax(model(ids).head.logits().double() / temperature, -1)
        lp_t = lp_t.gather(-1, lab.clamp_min(0)[..., None])[..., 0]  # [B, S]
    for _ in range(20):
        old = lp0 + 0.3 * torch.randn(lp0.shape, generator=g)
        r = torch.exp(lp_t - old.double())[mask.bool()]
        if all(((r / edge - 1).abs() > 1e-4).all() for edge in (0.8, 1.28, 3.0)):
            break
    roll = lp0 + 0.2 * torch.randn(lp0.shape, generator=g)  # the engine's (no TIS: only measured)
    adv = torch.tensor([1.3, -0.8, 0.4])
    weights = torch.tensor(response_weights([int(n) for n in mask.sum(1)], "seq_mean_token_mean", 24))
    opts = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0, "temperature": temperature}
    mb = MicroBatch(ids, lab, mask, advantages=adv[:, None].expand_as(mask).contiguous() * mask, old_logprobs=old,
                    token_weights=(weights[:, None] * mask).float(), rollout_logprobs=roll)
    out, res = losses.compute(model, mb, losses.LossCoefs(mtp=0.0, indexer=0.0), name="policy", options=opts)
    (gw,) = torch.autograd.grad(res.loss, [model.head.weight], retain_graph=True)
    z = out.logits.double() / temperature  # [B, S, V]
    lp = torch.log_softmax(z, -1).gather(-1, lab.clamp_min(0)[..., None])[..., 0]
    ratio, a = torch.exp(lp - old.double()), adv.double()[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
    pg = torch.where(a < 0, torch.minimum(pg, -a * 3.0), pg)  # dual clip
    want = (pg * weights.double()[:, None] * mask).sum()
    (gw_want,) = torch.autograd.grad(want, [model.head.weight])
    assert_close(res.loss, want.detach(), atol=1e-6, what="loss")
    assert_close(gw, gw_want, atol=1e-6, what="head gradient")
    clipped = ((-a * ratio.clamp(0.8, 1.28) > -a * ratio).double() * mask).sum() / mask.sum()
    assert res.metrics["pg_clipfrac"].item() == pytest.approx(clipped.item(), abs=1e-6) and clipped > 0
    p = torch.softmax(z.detach(), -1)
    entropy = (-(p * p.log()).sum(-1) * mask).sum() / mask.sum()
    assert abs(res.metrics["entropy"].item() - entropy.item()) <= 1e-5 * entropy.item()
    d = lp.detach() - roll.double()
    gap = {"train_rollout_logprob_abs_diff": (d.abs() * mask).sum() / mask.sum(),
           "train_rollout_logprob_abs_diff_max": (d.abs() * mask).amax(),
           "train_rollout_k3_kl": ((torch.exp(d) - 1 - d) * mask).sum() / mask.sum()}
    for k, v in gap.items():
        assert torch.isfinite(res.metrics[k]) and v > 1e-3, k
        assert res.metrics[k].item() == pytest.approx(v.item(), rel=1e-5), k


@pytest.mark.parametrize("chunk_rows, temperature, fused", [(None, 1.0, False), (1, 1.0, False), (7, 1.0, False),
                                                             (None, 0.7, False), (7, 1.3, False), (7, 0.7, True)])
def test_chunked_head_logprobs_equal_the_full_logits(seed, chunk_rows, temperature, fused, monkeypatch):
    """ctx.head_logprobs / head_entropy (the trainer's path: no [N, V] logits kept) against
    log-softmax of the whole logits divided by the temperature: values and the gradients of
    the hidden state and the head weight (fp32, fresh asymmetric inputs, ignored labels, one
    chunk, 7-row chunks with a ragged last one, 1-row chunks; the fused kernels too). At
    temperature 1 one chunk's log-probabilities are the full path's bits; the gradients are
    the head's own in-place formula (1e-5)."""
    from plugins.deepseek_v4 import parallel
    from plugins.deepseek_v4.parallel import ParallelContext, VocabHead

    v = 37
    if chunk_rows is not None:
        monkeypatch.setattr(parallel, "HEAD_CHUNK_ELEMENTS", chunk_rows * v)
    g = torch.Generator().manual_seed(seed)
    y0, w0 = torch.randn(3, 10, 16, generator=g), torch.randn(v, 16, generator=g) * 0.3
    labels = torch.randint(0, v, (3, 10), generator=g)
    labels[0, :3] = IGNORE_INDEX
    cot = torch.randn(3, 10, generator=g)
    ctx = ParallelContext()
    runs = []
    for chunked in (False, True):
        y, w = y0.clone().requires_grad_(), w0.clone().requires_grad_()
        head = VocabHead(y, w, ctx, fused=fused)
        lp = (ctx.head_logprobs(head, labels, temperature) if chunked
              else ctx.token_logprobs(head.logits() / temperature, labels))
        ent = ctx.head_entropy(head, temperature) if chunked else ctx.token_entropy(head.logits() / temperature)
        lp = torch.where(labels != IGNORE_INDEX, lp, 0.0)
        (lp * cot).sum().backward()
        runs.append((lp.detach(), ent, y.grad, w.grad))
    for name, a, b in zip(("logprobs", "entropy", "d y", "d w"), runs[1], runs[0], strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5, what=name)
        if chunk_rows is None and temperature == 1 and name == "logprobs":  # one chunk: the full path's operations
            assert torch.equal(a, b), f"{name}: one chunk is not bitwise the full logits' path"
    assert runs[0][2].abs().sum() > 0 and runs[0][3].abs().sum() > 0
