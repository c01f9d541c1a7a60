"""Cross-check against an independent implementation: transformers' DeepseekV4ForCausalLM.

Our tiny model (randomised, all three layer kinds: SWA 0, CSA 4, HCA 128; hash and learned
routers) is saved with our own `save_pretrained` (config.json + sharded safetensors under
DeepSeek's names), loaded by transformers, and both forwards must give the same fp32 logits.
Nothing is shared between the two beyond the checkpoint directory.

Known differences, handled here rather than hidden:
* Top-k ties. Our indexer (and router) top-k breaks exact ties towards the lower index;
  transformers' `torch.topk` leaves the order unspecified, and ReLU in the indexer gives
  exact ties at 0. The two forwards also round differently (~1e-7), so a near-tie at the
  k-th place can flip. We record transformers' choices (and scores), check in our forward
  that every query (token) where ours differs is a tie under our scores and under
  transformers' (the chosen scores agree after sorting, to 1e-5 of the score scale), and let
  our forward follow transformers' choice there, so that one tie cannot spread through the
  window and the compressors into every later position. Any other difference in a choice
  fails the test.
* Padding. transformers' compressors ignore the attention mask (they pool pad tokens), so
  only unpadded rows are compared: no padding is used.
"""

from __future__ import annotations

import torch
from conftest import assert_close, random_ids, tiny_model
from transformers import DeepseekV4ForCausalLM

from plugins.deepseek_v4 import ops

# Layers SWA, CSA, HCA, CSA (+ the SWA MTP block, which transformers does not build); the
# first two use hash routing. 128 is the HCA ratio transformers knows (it maps 0/4/128 to
# its layer types). max_position_embeddings = factor * original_max_position_embeddings as
# in DeepSeek's own config.json (otherwise transformers warns that the two disagree).
CONFIG = dict(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], index_n_heads=8,
              max_position_embeddings=1024)
SEQ = 290  # two complete HCA blocks (the second seen from position 255) and a partial one
TIE_TOL = 1e-5  # of the largest |score|: rounding (~1e-7 relative) is far below it


def _mask(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Chosen indices [..., k] (-1 = none) -> bool mask [..., n]."""
    m = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool)
    return m.scatter(-1, torch.where(idx >= 0, idx, n), True)[..., :n]


def _ties_only(mine: torch.Tensor, theirs: torch.Tensor, what: str, **keys: torch.Tensor) -> int:
    """mine, theirs: chosen masks [..., n]. Where they differ, both must be a top-k under each of
    the `keys` (our scores and transformers' own: a tie on one side only is no excuse, e.g. ours
    all 0): equally many picks whose sorted scores agree to TIE_TOL. Returns the differing rows."""
    differ = (mine != theirs).any(-1)
    if not differ.any():
        return 0
    a, b = mine[differ], theirs[differ]
    assert (a.sum(-1) == b.sum(-1)).all(), f"{what}: transformers chose a different number of entries"
    top = int(a.sum(-1).max())
    for side, key in keys.items():
        k = key[differ].float()
        va = k.masked_fill(~a, float("-inf")).sort(-1, descending=True).values[:, :top]
        vb = k.masked_fill(~b, float("-inf")).sort(-1, descending=True).values[:, :top]
        gap = (va - vb).abs().masked_fill(~torch.isfinite(va), 0).max().item()
        tol = TIE_TOL * key.float().abs().max().item()
        assert gap <= tol, (f"{what}: choices differ beyond a tie under {side} scores (sorted chosen scores "
                            f"differ by {gap:.3e} > {tol:.3e})")
    return int(differ.sum())


def _reference(hf: DeepseekV4ForCausalLM, ids: torch.Tensor):
    """transformers' logits and, per layer, its indexer scores [B, S, G] and picks [B, S, k] and
    router picks [B*S, k] with its selection scores [B*S, E] (recorded with forward hooks; its
    forward is not altered)."""
    picks, routes, scores, hooks = {}, {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        indexer = getattr(layer.self_attn.compressor, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(lambda m, a, out, i=i: picks.__setitem__(i, out)))
            hooks.append(indexer.scorer.register_forward_hook(lambda m, a, out, i=i: scores.__setitem__(i, out)))
        if not layer.mlp.is_hash:
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: routes.__setitem__(
                i, (out[2], m.score_fn(out[0]) + m.e_score_correction_bias))))
    try:
        with torch.no_grad():
            logits = hf(ids, use_cache=False).logits  # the stateless path (a cache gives the same)
    finally:
        for h in hooks:
            h.remove()
    return logits, picks, routes, scores


def _ours(model, ids: torch.Tensor, picks: dict, routes: dict, ref_scores: dict,
          monkeypatch) -> tuple[torch.Tensor, dict]:
    """Our logits, each top-k choice checked against transformers' and following it at ties."""
    ties = {"indexer": 0, "router": 0}
    csa = iter(sorted(picks))  # our forward selects in layer order, the CSA layers only
    select = ops.topk_select

    def topk_select(scores, visible, k):
        layer = next(csa)
        ours, ref = select(scores, visible, k), _mask(picks[layer], scores.shape[-1])
        assert not (ref & ~visible).any(), f"layer {layer}: transformers picked a block our layout hides"
        # Which side of the top-k a difference comes from: the scores or the selection.
        diff = (scores - ref_scores[layer]).masked_fill(~visible, 0).abs().max().item()
        what = f"indexer of layer {layer} (visible scores differ by up to {diff:.2e})"
        ties["indexer"] += _ties_only(ours, ref, what, our=scores, transformers=ref_scores[layer])
        return ref

    def gate_hook(gate, args, out, layer):
        idx, w, s = out
        ref, ref_key = routes[layer]
        ref = ref.view_as(idx)
        n = _ties_only(_mask(idx, s.shape[-1]), _mask(ref, s.shape[-1]), f"router of layer {layer}",
                       our=s + gate.bias, transformers=ref_key)
        ties["router"] += n
        if not n:
            return None
        w = s.gather(-1, ref)  # DSV4.md 5: normalised scores of the chosen experts, scaled
        return ref, w / w.sum(-1, keepdim=True) * gate.scaling, s

    monkeypatch.setattr(ops, "topk_select", topk_select)
    hooks = [model.layers[i].ffn.gate.register_forward_hook(lambda g, a, o, i=i: gate_hook(g, a, o, i))
             for i in routes]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert next(csa, None) is None, "our forward made fewer indexer selections than transformers'"
    return logits, ties


def test_logits_match_transformers(tmp_path, seed, monkeypatch):
    """Our checkpoint loads into transformers with no missing or unexpected tensor (MTP aside)
    and both give the same fp32 logits (max abs 1e-5) on a fresh random batch of two rows.

    Guards (each mutation was run and fails this test): the attention sink dropped from the
    softmax; YaRN applied to the SWA (ratio 0) layers' RoPE; mHC comb applied untransposed;
    compressed blocks visible one token early (future leak); the CSA overlap's previous-block
    half dropped; the HCA compressor's position bias (ape) dropped; the indexer's top-k taking
    the lowest scores; the Hadamard rotation applied to the indexer's queries only; the
    indexer's scores all 0 (every choice a tie on our side); routing weights not normalised;
    the final norm's weight ignored. With the choice checks switched off (our forward simply
    following transformers' choices), the logits comparison alone still fails all of them but
    the three that only change which blocks the indexer picks (lowest scores, Hadamard, scores
    0): those only the choice check sees."""
    model = tiny_model(seed, **CONFIG)
    cfg = model.config
    assert {0, 4, 128} <= set(cfg.compress_ratios[: cfg.num_hidden_layers]) and SEQ // 128 >= 2
    model.save_pretrained(tmp_path, max_shard_bytes=200_000)  # several shards + index

    hf, info = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager",
                                                     output_loading_info=True)
    hf.eval()
    # transformers builds no MTP block and drops its tensors (its _keys_to_ignore_on_load_unexpected
    # filters them out of the report, so they may or may not be listed); nothing else may be left.
    ours = model.state_dict()
    allowed_unexpected = {k for k in ours if k.startswith("mtp.")}
    assert set(info["missing_keys"]) == set(), f"missing in our checkpoint: {sorted(info['missing_keys'])}"
    assert set(info["unexpected_keys"]) <= allowed_unexpected, \
        f"not read by transformers: {sorted(set(info['unexpected_keys']) - allowed_unexpected)}"
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    # Every element of our non-MTP tensors is accounted for (experts are merged by transformers).
    assert sum(t.numel() for t in hf.state_dict().values()) == \
        sum(t.numel() for k, t in ours.items() if k not in allowed_unexpected)
    # config.json (DeepSeek's field names) as transformers reads it.
    hc = hf.config
    assert hc.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"]
    assert hc.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert hc.qk_rope_head_dim == cfg.qk_rope_head_dim and hc.index_topk == cfg.index_topk
    assert hc.rope_parameters["main"]["rope_type"] == "default"
    assert hc.rope_parameters["compress"]["rope_type"] == "yarn"

    ids = random_ids(seed, 2, SEQ, cfg.vocab_size)
    ref, picks, routes, scores = _reference(hf, ids)
    assert sorted(picks) == [1, 3] and sorted(routes) == [2, 3]
    got, ties = _ours(model, ids, picks, routes, scores, monkeypatch)
    print(f"rows where ours followed transformers' choice at a tie: {ties}")
    assert_close(got, ref, atol=1e-5, what="logits vs transformers")
