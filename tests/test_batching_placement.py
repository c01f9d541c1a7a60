"""Pure policies: samples to micro-batches, sequence packing, token-budget micro-batching, bundle plans."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from miles.cluster.placement import colocate_on_gpus
from miles.data.sample import Sample
from miles.train.batching import MicroBatch, micro_batches, pack, positions, to_micro_batch
from plugins.deepseek_v4.model import IGNORE_INDEX


def _samples(seed: int, n: int) -> list[Sample]:
    """Random lengths 2..41 and random loss masks (a prompt of random length, then trained)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(2, 41)
        prompt = rng.randint(1, k - 1)
        out.append(Sample([rng.randrange(320) for _ in range(k)], [0] * prompt + [1] * (k - prompt)))
    return out


def test_pack_keeps_every_sample_once_and_documents_apart(seed):
    """Guards lost or duplicated samples, documents that bleed into each other and masks that
    slip: every sample lands once in a row within the budget, and in the micro-batch each is a
    contiguous run under its own doc id whose inputs, labels and loss weights are its own."""
    samples = _samples(seed, 30)
    rows = pack(samples, max_tokens=64)
    assert all(sum(positions(x) for x in row) <= 64 for row in rows)
    assert sorted(id(x) for row in rows for x in row) == sorted(map(id, samples))
    # First fit's own guarantee, any order of samples: the first sample of a later row did not fit
    # in any earlier row, so any two rows hold more than 64 positions between them (a row count
    # bound such as total // 64 + 2 is no theorem: FFD can need 11/9 of the optimum).
    used = [sum(map(positions, row)) for row in rows]
    assert all(a + b > 64 for i, a in enumerate(used) for b in used[i + 1:]), f"rows that would fit together: {used}"
    mb = to_micro_batch(rows, pad_to_multiple=2)
    for i, row in enumerate(rows):
        docs = mb.doc_ids[i].tolist()
        for d, x in enumerate(row):
            at = [t for t, v in enumerate(docs) if v == d]
            assert at == list(range(at[0], at[0] + positions(x))), "documents must be contiguous runs"
            assert mb.input_ids[i, at].tolist() == x.tokens[:-1] and mb.labels[i, at].tolist() == x.tokens[1:]
            assert mb.loss_mask[i, at].tolist() == [float(v) for v in x.loss_mask[1:]]


def test_pack_errors_name_the_sample():
    with pytest.raises(ValueError, match="sample 1: 70 positions exceed the packing budget of 64"):
        pack([Sample([1, 2], [0, 1]), Sample([0] * 71, [0] * 71)], max_tokens=64)
    with pytest.raises(ValueError, match="sample: 2 tokens but 1 loss-mask entries"):
        Sample([1, 2], [0])


def test_to_micro_batch_pads_as_padding():
    """Padding gets doc id -1, ignored labels and weight 0, and the length rounds up (CP
    chunks); one document per row without padding needs no doc ids at all."""
    a, b = Sample([5, 6, 7, 8], [0, 1, 1, 1]), Sample([9, 1], [0, 1])
    mb = to_micro_batch(pack([a, b], 8), pad_to_multiple=8)
    assert mb.shape == (1, 8) and mb.doc_ids[0].tolist() == [0, 0, 0, 1, -1, -1, -1, -1]
    assert mb.input_ids[0, :4].tolist() == [5, 6, 7, 9] and mb.labels[0, :4].tolist() == [6, 7, 8, 1]
    pad = mb.doc_ids == -1
    assert (mb.labels[pad] == IGNORE_INDEX).all() and (mb.loss_mask[pad] == 0).all() and (mb.input_ids[pad] == 0).all()
    assert to_micro_batch([[a], [Sample([1, 2, 3, 4], [0, 0, 1, 1])]]).doc_ids is None


def test_a_micro_batch_is_checked_when_made_and_moved_whole(monkeypatch):
    """A micro-batch whose fields disagree fails when made, naming the field; `to` moves every
    field (values kept, optional fields left None) without checking again, and onto a GPU
    without a pageable copy's wait (pinned memory)."""
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    with pytest.raises(ValueError, match="loss_mask has shape"):
        MicroBatch(ids, labels, torch.ones(2, 6))
    with pytest.raises(ValueError, match="loss_mask trains positions whose label is IGNORE_INDEX"):
        MicroBatch(ids, labels, torch.ones(2, 7))
    mb = MicroBatch.lm(ids, labels)
    mb = MicroBatch(mb.input_ids, mb.labels, mb.loss_mask, advantages=torch.randn(2, 7))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pinned = []
    pin = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pinned.append(t.shape) or pin(t, *a))

    def check(self):
        raise AssertionError("checked again")

    monkeypatch.setattr(MicroBatch, "__post_init__", check)  # made already: `to` must not check
    moved = mb.to(torch.device(device))
    present = sum(getattr(mb, f.name) is not None for f in fields(mb))  # 4: ids, labels, mask, advantages
    assert len(pinned) == (present if device == "cuda" else 0), pinned
    for f in fields(mb):
        a, b = getattr(mb, f.name), getattr(moved, f.name)
        assert (a is None) == (b is None), f.name
        if a is not None:
            assert b.device.type == device and b.dtype == a.dtype and torch.equal(b.cpu(), a), f.name
    assert mb.to(None) is mb


def test_micro_batches_respect_the_token_budget(seed):
    """Guards a micro-batch over budget (padded rows x longest) or a row dropped/reordered."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 50) for _ in range(40)]
    groups = micro_batches(lens, max_tokens=100)
    assert [i for g in groups for i in g] == list(range(40))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lens[i] for i in g) <= 100
    assert micro_batches([120, 10], 100) == [[0], [1]]


def test_colocation_on_gpus_shares_each_trainer_gpu_with_one_engine():
    """Colocated on GPUs: a bundle per trainer GPU holding the rank's CPUs and, for the first
    num_engines, its engine's; the engine asks for its share of the GPU, the rank for the
    rest (together one GPU: Ray puts them on the same one). Shares that are no share, and
    more engines than trainer GPUs, are refused naming the key."""
    p = colocate_on_gpus(world=4, num_engines=2, gpus_per_engine=0.25, cpus_per_worker=2, cpus_per_engine=1)
    assert p.bundles == [{"CPU": 3, "GPU": 1.0}] * 2 + [{"CPU": 2, "GPU": 1.0}] * 2
    assert p.rank == {"CPU": 2, "GPU": 0.75} and p.engine == {"CPU": 1, "GPU": 0.25} and p.engine_bundles == [0, 1]
    for share in (0.0, 1.0, 2.0):
        with pytest.raises(ValueError, match=rf"rollout.gpus_per_engine={share:g}: .* between 0 and 1"):
            colocate_on_gpus(2, 1, share, 1, 1)
    with pytest.raises(ValueError, match="rollout.num_engines=3: .* at most 2 engines"):
        colocate_on_gpus(2, 3, 0.5, 1, 1)


def test_packed_rows_compute_what_the_samples_compute_alone(seed):
    """Packing is free of cross-talk end to end: the summed token losses of packed rows
    (documents apart by doc id, padding ignored, each sample's own loss mask) equal those of
    each sample run alone (with one document id per row instead, lm differs by ~0.5). Samples
    whose packed forward meets a near tie are drawn again (conftest.choice_margin)."""
    from conftest import NEAR_TIE, assert_close, choice_margin, tiny_model

    from miles.train import losses

    model = tiny_model(seed)
    for draw in range(20):
        samples = _samples(seed + 1000 * draw, 6)
        mb = to_micro_batch(pack(samples, max_tokens=48), pad_to_multiple=2)
        if choice_margin(model, mb.input_ids, doc_ids=mb.doc_ids) > NEAR_TIE:
            break
    ones = {k: torch.tensor(1.0) for k in ("lm", "mtp", "indexer", "balance")}
    packed = losses.compute(model, mb, norm=ones)[1]
    alone = {k: 0.0 for k in ("lm_loss", "mtp_loss")}
    for x in samples:
        out = losses.compute(model, to_micro_batch([[x]]), norm=ones)[1].metrics
        for k in alone:
            alone[k] = alone[k] + out[k]
    for k in alone:
        assert_close(packed.metrics[k], torch.as_tensor(alone[k]), atol=1e-4, rtol=1e-5, what=k)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_context_parallel_pieces_cover_the_sequence_with_equal_causal_work(cp):
    """cp_chunk: every position on exactly one rank, each rank's tokens ascending, and each
    rank the same causal attention work (sum of query positions + 1), which contiguous
    chunks do not give (the last rank's work is 2cp - 1 times the first's)."""
    from plugins.deepseek_v4.parallel import cp_chunk

    seq = 2 * cp * 7
    chunks = [cp_chunk(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(chunks)).values, torch.arange(seq))
    for c in chunks:
        assert c.numel() == seq // cp and torch.equal(c, torch.sort(c).values)
    work = {int((c + 1).sum()) for c in chunks}
    assert len(work) == 1, f"unequal causal work per rank: {work}"
    contiguous = [int((torch.arange(r * seq // cp, (r + 1) * seq // cp) + 1).sum()) for r in range(cp)]
    assert len(set(contiguous)) == cp  # the property is not trivial
    with pytest.raises(ValueError, match=f"multiple of {2 * cp}"):
        cp_chunk(seq + cp, cp, 0)
