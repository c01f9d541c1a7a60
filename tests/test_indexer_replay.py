"""Indexer replay (issue 56): the trainer's forward can take the compressed entries each token's
query attended in the rollout's engine (the CSA indexer's top-k) instead of its own indexer's.
The engine is stood in for by the same model with other indexer weights: its picks then differ
for a share of queries, which replay removes. Entries travel as in-document block numbers (the
engine's slot cache indexes them so), so packed rows must place each document's numbers on that
document's own entries."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, random_ids, tiny_model


def _forward(model, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(next token) [B, S-1] and the indexer's entries [B, S, C, K]."""
    out = model(ids, record_picks=True, **kw)
    lp = torch.log_softmax(out.head.logits().double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return lp, out.picks


def _engine_and_trainer(seed: int):
    """(engine, trainer): equal but for the trainer's indexer weights, perturbed enough that its
    top-k picks other entries for some queries. The indexer changes nothing else: with the
    engine's picks the trainer computes the engine's forward."""
    engine, trainer = tiny_model(seed).eval(), tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".indexer." in name and not name.startswith("mtp."):
                p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(0.05))
    return engine, trainer


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, S, C]: the queries whose entry sets differ."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def test_replay_takes_the_engines_entries_and_computes_the_engines_forward(seed):
    engine, trainer = _engine_and_trainer(seed)
    ids = random_ids(seed, 2, 72)
    with torch.no_grad():
        want, picked = _forward(engine, ids)
        own, own_picks = _forward(trainer, ids)
        replayed, replayed_picks = _forward(trainer, ids, indexer_picks=picked)
    for t in (want, own, replayed):
        assert torch.isfinite(t).all()
    cfg = trainer.config
    csa = sum(cfg.is_csa(cfg.layer_ratio(i)) for i in range(cfg.num_hidden_layers))
    assert picked.shape == (2, 72, csa, cfg.index_topk) and csa > 0
    assert (picked[:, :3] == -1).all() and (picked[:, -1] >= 0).all(), "entries before the first block / at the end"
    assert _differ(own_picks, picked).float().mean() > 0.05, "the perturbation left the picks unchanged"
    assert torch.equal(replayed_picks, picked), "a replayed query attended other entries than the engine's"
    assert (own - want).abs().max() > 1e-4, "other picks changed no log-prob: the test could not see replay"
    assert_close(replayed, want, atol=1e-5, what="the replayed forward against the engine's")


def test_packed_documents_replay_their_own_entries(seed):
    """Two documents in one row (doc_ids), each with the picks of its own forward: the packed,
    replayed forward equals each document's engine forward, and records the same numbers."""
    engine, trainer = _engine_and_trainer(seed)
    a, b = random_ids(seed, 1, 45)[0], random_ids(seed + 1, 1, 38)[0]
    with torch.no_grad():
        (want_a, picks_a), (want_b, picks_b) = _forward(engine, a[None]), _forward(engine, b[None])
        ids = torch.cat((a, b))[None]
        doc = torch.cat((torch.zeros(45), torch.ones(38))).long()[None]
        picked = torch.cat((picks_a, picks_b), 1)
        lp, got = _forward(trainer, ids, doc_ids=doc, indexer_picks=picked)
        own, own_picks = _forward(trainer, ids, doc_ids=doc)
    assert torch.equal(got, picked), "a document's numbers landed on another document's entries"
    assert _differ(own_picks, picked).any(), "the trainer's own picks equal the engine's: nothing to replay"
    assert_close(lp[:, :44], want_a, atol=1e-5, what="first document")
    assert_close(lp[:, 45:], want_b, atol=1e-5, what="second document")


def test_replaying_a_models_own_picks_changes_nothing(seed):
    model = tiny_model(seed).eval()
    ids = random_ids(seed, 2, 50)
    with torch.no_grad():
        lp, picks = _forward(model, ids)
        again, again_picks = _forward(model, ids, indexer_picks=picks)
    assert torch.isfinite(lp).all()
    assert torch.equal(lp, again) and torch.equal(picks, again_picks)


def test_an_indexer_replay_of_the_wrong_shape_is_refused(seed):
    model = tiny_model(seed).eval()
    with pytest.raises(ValueError, match="indexer replay needs"):
        model(random_ids(seed, 1, 8), indexer_picks=torch.zeros(1, 8, 1, 1, dtype=torch.long))


def test_the_engine_returns_the_entries_every_token_it_read_attended(seed):
    """return_indexer_picks: meta_info["indexer_picks"] holds, for the prompt and every generated
    token fed back, each CSA layer's entries as block numbers; they are a full forward's of that
    sequence (fp32 on CPU), whatever the batch; requests that did not ask get none. Prompts whose
    sequences meet a near tie are drawn again (conftest.answers_margin)."""
    from miles.rollout.engine import decode_choices
    from miles.rollout.sampling import SamplingParams
    from tests.conftest import NEAR_TIE, answers_margin, engine_answers, randomize

    model = randomize(tiny_model(seed), seed).eval()
    cfg = model.config
    csa = sum(cfg.is_csa(cfg.layer_ratio(i)) for i in range(cfg.num_hidden_layers))
    for draw in range(5):
        g = torch.Generator().manual_seed(seed + 13 + 1000 * draw)
        lens = torch.randint(3, 40, (4,), generator=g)
        prompts = [torch.randint(2, 320, (int(n),), generator=g).tolist() for n in lens]
        results = engine_answers(model, prompts, 3, lambda i: (
            SamplingParams(temperature=1.0, max_new_tokens=20 + 3 * i, seed=seed + i, ignore_eos=True),
            {"return_indexer_picks": i != 1}))
        if answers_margin(model, prompts, [results[str(i)] for i in range(len(prompts))], greedy=False) > NEAR_TIE:
            break
    assert "indexer_picks" not in results["1"]["meta_info"] and "routed_experts" not in results["0"]["meta_info"]
    for i, p in enumerate(prompts):
        if i == 1:
            continue
        out = results[str(i)]["output_ids"]
        got = decode_choices(results[str(i)]["meta_info"]["indexer_picks"], csa, cfg.index_topk)
        seq = torch.tensor([p + out[:-1]])
        assert got.shape == (seq.shape[1], csa, cfg.index_topk), got.shape
        with torch.no_grad():
            want = model(seq, record_picks=True).picks[0]  # [T, C, K]
        assert (want >= 0).any(), "no token saw an entry: the test would not see the picks"
        assert torch.equal(torch.from_numpy(got), want.to(torch.int32)), f"request {i}: not the full forward's entries"

