"""Pure policies: sequence packing, token-budget micro-batching, bundle plans."""

from __future__ import annotations

import random

import pytest
import torch

from miles.cluster.placement import plan_bundles
from miles.train.batching import MicroBatch, micro_batches, pack, to_tensors
from plugins.deepseek_v4.model import IGNORE_INDEX


def _samples(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        ids = [rng.randrange(320) for _ in range(k)]
        out.append((ids, ids[1:] + [IGNORE_INDEX]))
    return out


def test_pack_keeps_every_token_once_and_documents_apart(seed):
    """Guards lost or duplicated samples and documents that bleed into each other: every
    sample appears exactly once, contiguous, under one doc id unique within its row, and
    no row exceeds the budget."""
    samples = _samples(seed, 30)
    rows = pack(samples, max_tokens=64)
    assert all(len(r.input_ids) <= 64 for r in rows)
    found = []
    for r in rows:
        docs = r.doc_ids
        assert docs == sorted(docs), "documents must be contiguous runs"
        for d in sorted(set(docs)):
            idx = [i for i, x in enumerate(docs) if x == d]
            found.append((r.input_ids[idx[0]: idx[-1] + 1], r.labels[idx[0]: idx[-1] + 1]))
    assert sorted(map(str, found)) == sorted(map(str, samples))
    assert len(rows) <= sum(len(s[0]) for s in samples) // 64 + 2, "first-fit-decreasing packs densely"


def test_pack_errors_name_the_sample():
    with pytest.raises(ValueError, match="sample 1: 70 tokens exceed the packing budget of 64"):
        pack([([1], [2]), ([0] * 70, [0] * 70)], max_tokens=64)
    with pytest.raises(ValueError, match="sample 0: 2 input ids but 1 labels"):
        pack([([1, 2], [3])], max_tokens=64)


def test_to_tensors_pads_as_padding():
    """Padding gets doc id -1 and ignored labels, and the length rounds up (CP chunks)."""
    ids, lab, doc = to_tensors(pack([([5, 6, 7], [6, 7, 8]), ([9], [1])], 8), pad_to_multiple=4)
    assert ids.shape == (1, 4) and doc[0].tolist() == [0, 0, 0, 1] and ids[0].tolist() == [5, 6, 7, 9]
    ids, lab, doc = to_tensors(pack([([5, 6, 7], [6, 7, 8]), ([9, 1], [1, 2])], 4), pad_to_multiple=4)
    assert ids.shape == (2, 4)
    assert (doc == -1).sum() == 3 and (lab[doc == -1] == IGNORE_INDEX).all()
    assert torch.equal(ids[doc == -1], torch.zeros(3, dtype=torch.long))


def test_micro_batches_respect_the_token_budget(seed):
    """Guards a micro-batch over budget (padded rows x longest) or a row dropped/reordered."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 50) for _ in range(40)]
    groups = micro_batches(lens, max_tokens=100)
    assert [i for g in groups for i in g] == list(range(40))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lens[i] for i in g) <= 100
    assert micro_batches([120, 10], 100) == [[0], [1]]


def test_bundle_plans():
    """Colocated engines reuse the trainer's devices; disaggregated ones follow them."""
    p = plan_bundles(4, 2, 2, colocate=True)
    assert len(p.bundles) == 4 and p.train == [0, 1, 2, 3] and p.engines == [[0, 1], [2, 3]]
    assert p.bundles[0] == {"CPU": 1.0, "GPU": 1.0}
    p = plan_bundles(2, 2, 1, colocate=False, device="CPU")
    assert len(p.bundles) == 4 and p.train == [0, 1] and p.engines == [[2], [3]]
    assert p.bundles[3] == {"CPU": 1.0}
    with pytest.raises(ValueError, match="exceed the trainer's 2 devices"):
        plan_bundles(2, 2, 2, colocate=True)


def test_packed_rows_compute_what_the_samples_compute_alone(seed):
    """Packing is free of cross-talk end to end: the summed token losses of packed rows
    (documents apart by doc id, padding ignored) equal those of each sample run alone
    (with one document id per row instead, lm differs by ~0.5)."""
    from conftest import assert_close, tiny_model

    from miles.train import losses

    model = tiny_model(seed)
    samples = [(ids, ids[1:] + [IGNORE_INDEX]) for ids, _ in _samples(seed, 6)]
    ids, lab, doc = to_tensors(pack(samples, max_tokens=48), pad_to_multiple=2)
    ones = {k: torch.tensor(1.0) for k in ("lm", "mtp", "indexer", "balance")}
    packed = losses.compute(model, MicroBatch.lm(ids, lab, doc), norm=ones)[1].metrics
    alone = {k: 0.0 for k in ("lm_loss", "mtp_loss")}
    for s_ids, s_lab in samples:
        out = losses.compute(model, MicroBatch.lm(torch.tensor([s_ids]), torch.tensor([s_lab])), norm=ones)[1].metrics
        for k in alone:
            alone[k] = alone[k] + out[k]
    for k in alone:
        assert_close(packed[k], torch.as_tensor(alone[k]), atol=1e-4, rtol=1e-5, what=k)
