"""Routing replay (R3) in the model (issue 56): the trainer's forward can take the experts each
token used in the rollout's engine instead of choosing them with its own router, while the
expert weights still come from its own router's scores (so the router keeps its gradient).
The engine is stood in for by the same model with other router weights: routing then differs
for a share of tokens, which replay removes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_ids, tiny_model


def _logprobs(model, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(next token) [B, S-1] and the experts the forward chose [B, S, L, k]."""
    out = model(ids, record_routes=True, **kw)
    lp = torch.log_softmax(out.head.logits().double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return lp, out.routes


def _engine_and_trainer(seed: int, dtype=torch.float32):
    """(engine, trainer): the trainer's learned routers perturbed enough that some tokens pick
    other experts."""
    engine = tiny_model(seed, dtype=dtype).eval()
    trainer = tiny_model(seed, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if name.endswith(".ffn.gate.weight"):
                p.add_((torch.randn(p.shape, generator=g) * 0.5 * p.float().std()).to(p.dtype))
    return engine, trainer


def test_replay_uses_the_engines_experts_and_its_log_probs_are_the_forced_forward(seed):
    engine, trainer = _engine_and_trainer(seed)
    ids = random_ids(seed, 2, 40)
    with torch.no_grad():
        want, routed = _logprobs(engine, ids)
        own, own_routes = _logprobs(trainer, ids)
        replayed, replayed_routes = _logprobs(trainer, ids, routed_experts=routed)
        partly = routed.clone()
        partly[:, ::2] = -1  # even positions: the trainer's own routing
        mixed, mixed_routes = _logprobs(trainer, ids, routed_experts=partly)
    for t in (want, own, replayed, mixed):
        assert torch.isfinite(t).all()
    cfg = trainer.config
    assert routed.shape == (2, 40, cfg.num_hidden_layers - cfg.num_hash_layers, cfg.num_experts_per_tok)
    differ = (own_routes.sort(-1).values != routed.sort(-1).values).any(-1)  # [B, S, L]
    assert differ.float().mean() > 0.05, "the perturbation left routing unchanged: the test would not see replay"
    assert torch.equal(replayed_routes, routed), "a replayed token took other experts than the engine's"
    assert torch.equal(mixed_routes[:, 1::2], routed[:, 1::2]), "a replayed position took other experts"
    assert not torch.equal(mixed_routes[:, ::2], routed[:, ::2]), "positions marked -1 did not route on their own"
    assert not torch.equal(replayed, own), "replay changed no log-prob"


def test_replaying_a_models_own_routing_changes_nothing(seed):
    model = tiny_model(seed).eval()
    ids = random_ids(seed, 2, 33)
    with torch.no_grad():
        lp, routes = _logprobs(model, ids)
        again, again_routes = _logprobs(model, ids, routed_experts=routes)
    assert torch.isfinite(lp).all()
    assert torch.equal(lp, again) and torch.equal(routes, again_routes)


def test_the_router_gradient_under_replay_is_the_finite_difference(seed):
    """d(sum of replayed log-probs)/d(gate weight) against central differences in fp64: the
    forced experts' weights come from the router's scores, so the gradient flows, and the
    choice itself (held fixed by replay) adds no step."""
    engine, trainer = _engine_and_trainer(seed, dtype=torch.float64)
    ids = random_ids(seed, 1, 24)
    with torch.no_grad():
        _, routed = _logprobs(engine, ids)
    gates = [(n, p) for n, p in trainer.named_parameters() if n.endswith(".ffn.gate.weight") and "layers.2." in n]
    assert gates, [n for n, _ in trainer.named_parameters() if "gate" in n]
    name, w = gates[0]

    def total() -> torch.Tensor:
        return _logprobs(trainer, ids, routed_experts=routed)[0].sum()

    trainer.zero_grad(set_to_none=True)
    total().backward()
    grad = w.grad.clone()
    assert torch.isfinite(grad).all() and grad.abs().max() > 0, "no gradient reaches the router under replay"
    # The router's scores are computed in fp32 (ops.fp32_linear) even in an fp64 model: steps
    # of 1e-3 keep the difference above fp32's rounding; the entries with the largest gradients.
    picks = [divmod(int(i), w.shape[1]) for i in grad.abs().flatten().topk(6).indices]
    h = 1e-3
    with torch.no_grad():
        for i, j in picks:
            old = w[i, j].item()
            w[i, j] = old + h
            up = total().item()
            w[i, j] = old - h
            down = total().item()
            w[i, j] = old
            fd = (up - down) / (2 * h)
            assert abs(grad[i, j].item() - fd) <= 2e-2 * abs(fd) + 1e-4, f"{name}[{i}, {j}]: {grad[i, j]} vs {fd}"


def test_a_replay_of_the_wrong_shape_is_refused(seed):
    model = tiny_model(seed).eval()
    ids = random_ids(seed, 1, 8)
    with pytest.raises(ValueError, match="routing replay needs"):
        model(ids, routed_experts=torch.zeros(1, 8, 1, 1, dtype=torch.long))


def test_the_engine_returns_the_experts_every_token_it_read_took(seed):
    """return_routed_experts: meta_info["routed_experts"] holds, for the prompt and every
    generated token fed back (prompt + output - 1 tokens), the experts of each learned MoE
    layer; they are the ones a full forward of that sequence chooses (fp32 on CPU), whatever
    the batch (requests joining a running batch, two of them sharing one prompt's prefill);
    a request that did not ask gets none. Prompts whose sequences meet a near tie are drawn
    again (conftest.answers_margin): there the two forwards' rounding may choose."""
    from miles.rollout.engine import decode_choices
    from miles.rollout.sampling import SamplingParams
    from tests.conftest import NEAR_TIE, answers_margin, engine_answers, randomize

    model = randomize(tiny_model(seed), seed).eval()
    cfg = model.config
    layers, k = cfg.num_hidden_layers - cfg.num_hash_layers, cfg.num_experts_per_tok
    for draw in range(5):
        g = torch.Generator().manual_seed(seed + 11 + 1000 * draw)
        lens = torch.randint(3, 30, (5,), generator=g)
        prompts = [torch.randint(2, 320, (int(n),), generator=g).tolist() for n in lens]
        prompts.append(list(prompts[0]))  # shares the first one's prefill
        results = engine_answers(model, prompts, 4, lambda i: (
            SamplingParams(temperature=1.0, max_new_tokens=8 + i, seed=seed + i, ignore_eos=True),
            {"return_routed_experts": i != 2}))
        if answers_margin(model, prompts, [results[str(i)] for i in range(len(prompts))], greedy=False) > NEAR_TIE:
            break
    assert "routed_experts" not in results["2"]["meta_info"]
    for i, p in enumerate(prompts):
        if i == 2:
            continue
        out = results[str(i)]["output_ids"]
        got = decode_choices(results[str(i)]["meta_info"]["routed_experts"], layers, k)
        seq = torch.tensor([p + out[:-1]])
        assert got.shape == (seq.shape[1], layers, k), got.shape
        with torch.no_grad():
            want = model(seq, record_routes=True).routes[0]  # [T, L, k]
        assert torch.equal(torch.from_numpy(got).sort(-1).values, want.sort(-1).values.to(torch.int32)), \
            f"request {i}: the engine's experts are not the full forward's"
