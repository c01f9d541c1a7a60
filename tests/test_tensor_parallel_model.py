"""The whole tiny DeepSeek-V4 model (all features) under Megatron-core TP=2 on CPU/gloo, in 2
TrainWorker actors of a real local Ray cluster, against the single-process model: logits,
MTP logits, every loss and every gradient (shards against the matching full-gradient slice)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, random_ids

pytest.importorskip("megatron.core")

from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM  # noqa: E402
from plugins.deepseek_v4.model import IGNORE_INDEX  # noqa: E402


def _batch(seed: int):
    ids = random_ids(seed, 2, 40)
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    return ids, lab


def test_tp2_in_ray_actors_matches_single_process(ray_cluster, seed):
    """TP=2 in two TrainWorker Ray actors (heads, output groups, experts, vocab split)
    computes what one process computes: per-token logits and MTP logits, lm/mtp/indexer
    losses, and every gradient, within fp32 reordering error (collectives sum partial
    products in another order: ~1e-6 relative)."""
    from miles.cluster.train_group import TrainGroup

    group = TrainGroup(2, tp=2)
    try:
        assert [lay["tp"] for lay in group.layout] == [2, 2], "the layout silently fell back to one rank"
        assert [lay["tp_rank"] for lay in group.layout] == [0, 1], "rank order must follow bundle order"
        cfg = DeepSeekV4Config.tiny()
        group.call("build_model", cfg.to_dict(), seed)
        ids, lab = _batch(seed)
        ranks = group.call("loss_and_grads", ids, lab)
    finally:
        group.shutdown()
    ref = DeepSeekV4ForCausalLM(cfg, seed=seed).train()
    out = ref(ids, labels=lab)
    out.losses["total"].backward()
    full = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    for rank, r in enumerate(ranks):
        assert_close(r["logits"], out.logits.detach(), atol=1e-5, what=f"rank {rank} logits")
        assert_close(r["mtp"], out.mtp_logits.detach(), atol=1e-5, what=f"rank {rank} mtp logits")
        for k in ("lm", "mtp", "indexer", "total"):
            assert_close(r["losses"][k], out.losses[k].detach(), atol=1e-6, what=f"rank {rank} {k} loss")
        assert r["grads"].keys() == full.keys()
        split = [k for k, d in r["dims"].items() if d is not None]
        assert len(split) > 20, "too few tensors were actually split"
        for k, g in r["grads"].items():
            want = full[k] if r["dims"][k] is None else full[k].chunk(2, r["dims"][k])[rank]
            scale = want.abs().max().item()
            assert_close(g, want, atol=1e-5 * max(scale, 1e-3), rtol=1e-4, what=f"rank {rank} grad {k}")
