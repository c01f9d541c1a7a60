"""The whole tiny DeepSeek-V4 model (all features) under Megatron-core TP=2 on CPU/gloo, in 2
real processes, against the single-process model: logits, MTP logits, every loss and every
gradient (shards compared with the matching slice of the full gradient)."""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_close, random_ids

pytest.importorskip("megatron.core")

from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM  # noqa: E402
from plugins.deepseek_v4.model import IGNORE_INDEX  # noqa: E402


def _batch(seed: int):
    ids = random_ids(seed, 2, 40)
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    return ids, lab


def _worker(rank: int, port: int, seed: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from miles.train import megatron_cpu

    megatron_cpu.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from miles.train.parallel_context import MegatronContext

    ctx = MegatronContext()
    assert ctx.tp_size == 2, "the layout silently fell back to one rank"
    model = DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(), ctx=ctx, seed=seed).train()
    ids, lab = _batch(seed)
    out = model(ids, labels=lab)
    out.losses["total"].backward()
    grads = {k: (p.grad, getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None)
             for k, p in model.named_parameters() if p.grad is not None}
    torch.save({"logits": out.logits.detach(), "mtp": out.mtp_logits.detach(),
                "losses": {k: v.detach() for k, v in out.losses.items()},
                "grads": {k: g for k, (g, _) in grads.items()}, "dims": {k: d for k, (_, d) in grads.items()}},
               f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_tp2_matches_single_process(tmp_path, seed):
    """TP=2 (heads, output groups, experts, vocab split) computes what one process computes:
    per-token logits and MTP logits, lm/mtp/indexer losses, and every gradient, within fp32
    reordering error (collectives sum partial products in another order: ~1e-6 relative)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, seed, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    ref = DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(), seed=seed).train()
    ids, lab = _batch(seed)
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
