"""The EP token exchange (MegatronContext.ep_dispatch / ep_combine over Megatron-core's
all-to-all) in 2 real gloo processes: it moves only the routed pairs, each to the rank
holding its expert, and the routed experts computed that way equal one process (outputs,
token, weight and expert gradients), also when one rank's experts receive no pair at all
(every rank still runs the same backward collectives: no hang) and when a token takes one
expert in two of its slots (a loaded hash table may: each slot is its own pair)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_close

pytest.importorskip("megatron.core")

from miles.cluster.node import free_port  # noqa: E402
from plugins.deepseek_v4 import ops  # noqa: E402

E, K, D, INTER, LIMIT = 4, 2, 6, 5, 7.0
TOKENS = (7, 5)  # rank 0 and rank 1 hold different numbers of tokens


def _inputs(seed: int, routing: str) -> dict:
    """Both ranks' tokens, routing and the experts' weights. routing "idle": every pair goes
    to experts 0 and 1 (rank 0's), so rank 1's experts receive nothing; "repeated": every
    other token takes its first expert in both slots."""
    g = torch.Generator().manual_seed(seed)
    n = sum(TOKENS)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    if routing == "idle":
        idx = torch.tensor([[0, 1], [1, 0]]).repeat(n, 1)[:n]
    elif routing == "repeated":
        idx[::2, 1] = idx[::2, 0]
    return {"x": torch.randn(n, D, generator=g), "idx": idx, "w": torch.rand(n, K, generator=g) + 0.1,
            "w1": torch.randn(E, INTER, D, generator=g) * 0.5, "w3": torch.randn(E, INTER, D, generator=g) * 0.5,
            "w2": torch.randn(E, D, INTER, generator=g) * 0.5, "g": torch.randn(n, D, generator=g)}


def _worker(rank: int, port: int, seed: int, routing: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from miles.train import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    from megatron.core.tensor_parallel import mappings

    from miles.train.parallel_context import MegatronContext

    # Every collective this process starts: (name, rows sent to each rank or None, elements in).
    calls = []

    def record(name, fn):
        def wrapper(*args, **kwargs):
            if name == "all_to_all_single":
                splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
                calls.append((name, [int(n) for n in splits], args[1].numel()))
            else:  # all_reduce(t), all_gather(list, t), all_gather_into_tensor(out, t)
                calls.append((name, None, args[0 if name == "all_reduce" else 1].numel()))
            return fn(*args, **kwargs)
        return wrapper
    for name in ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce"):
        setattr(dist, name, record(name, getattr(dist, name)))
    mappings.dist_all_gather_func = record("all_gather_into_tensor", mappings.dist_all_gather_func)

    ctx = MegatronContext()
    inp = _inputs(seed, routing)
    mine = slice(sum(TOKENS[:rank]), sum(TOKENS[:rank + 1]))
    x = inp["x"][mine].clone().requires_grad_()
    w = inp["w"][mine].clone().requires_grad_()
    idx = inp["idx"][mine]
    local = ctx.local_experts(E)
    w1, w3, w2 = (inp[n][local.start:local.stop].clone().requires_grad_() for n in ("w1", "w3", "w2"))

    xs, idxs, ws, route = ctx.ep_dispatch(x, idx, w, E)
    forward_calls = len(calls)
    y = ctx.ep_combine(ops.routed_experts(xs, idxs, ws, w1, w3, w2, local.start, LIMIT), route)
    n_forward = len(calls)
    (y * inp["g"][mine]).sum().backward()
    res = {"y": y.detach(), "dx": x.grad, "dw": w.grad, "dw1": w1.grad, "dw3": w3.grad, "dw2": w2.grad,
           "rows_in": torch.tensor(xs.shape[0]), "experts_in": idxs.flatten(),
           "calls": calls, "dispatch_calls": forward_calls, "forward_calls": n_forward}
    with pytest.raises(ValueError, match="outside"):  # on every rank, before any all-to-all: no hang
        ctx.ep_dispatch(x, torch.full_like(idx, E), w, E)
    torch.save(res, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("routing", ["random", "idle", "repeated"])
def test_ep_all_to_all_moves_routed_pairs_and_matches_one_process(tmp_path, seed, routing):
    """Guards pairs sent to the wrong rank, pairs sent to every rank (the old all-gather), the
    routing weight lost or applied twice, a token's slots summed in the wrong place, the
    backward collectives diverging when a rank's experts get no pair, and an expert id out of
    range lost without a word."""
    mp.spawn(_worker, args=(free_port(), seed, routing, str(tmp_path)), nprocs=2)
    r = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in range(2)]
    inp = _inputs(seed, routing)
    per = E // 2
    for rank in range(2):
        mine = slice(sum(TOKENS[:rank]), sum(TOKENS[:rank + 1]))
        owner = inp["idx"][mine] // per  # the EP rank of each (token, slot) pair's expert
        a2a = [c for c in r[rank]["calls"][:r[rank]["dispatch_calls"]] if c[0] == "all_to_all_single"]
        # The dispatch: token rows then their weights, each pair to its expert's rank only.
        want = [int((owner == dst).sum()) for dst in range(2)]
        assert [c[1] for c in a2a] == [want, want], f"rank {rank}: rows sent per rank {[c[1] for c in a2a]}"
        assert a2a[0][2] == sum(want) * D and a2a[1][2] == sum(want)
        # Nothing else moves token data: one all-gather of the per-expert counts [E].
        others = [c for c in r[rank]["calls"][:r[rank]["forward_calls"]] if c[0] != "all_to_all_single"]
        assert [c[2] for c in others] == [E], f"rank {rank}: other collectives {others}"
        combine = [c for c in r[rank]["calls"][r[rank]["dispatch_calls"]:r[rank]["forward_calls"]]]
        arrived = [int((inp["idx"][sum(TOKENS[:s]):sum(TOKENS[:s + 1])] // per == rank).sum()) for s in range(2)]
        assert [c[1] for c in combine] == [arrived], f"rank {rank}: rows returned {combine}"
        assert int(r[rank]["rows_in"]) == sum(arrived)
        # The rows arrive grouped by local expert (the layout routed_experts expects).
        e = r[rank]["experts_in"]
        assert bool((e[1:] >= e[:-1]).all()) and bool(((e // per) == rank).all())

    # One process: every token, all experts.
    x, w = inp["x"].clone().requires_grad_(), inp["w"].clone().requires_grad_()
    ws = [inp[n].clone().requires_grad_() for n in ("w1", "w3", "w2")]
    y = ops.routed_experts(x, inp["idx"], w, *ws, 0, LIMIT)
    (y * inp["g"]).sum().backward()
    for rank in range(2):
        mine = slice(sum(TOKENS[:rank]), sum(TOKENS[:rank + 1]))
        # Each pair's output is the one-process value and a token's slots add in the same
        # order: equal up to the matmuls' blocking over another set of rows.
        assert_close(r[rank]["y"], y.detach()[mine], atol=1e-6, rtol=1e-6, what=f"rank {rank} output")
        assert_close(r[rank]["dx"], x.grad[mine], atol=1e-6, rtol=1e-6, what=f"rank {rank} token gradient")
        assert_close(r[rank]["dw"], w.grad[mine], atol=1e-6, rtol=1e-6, what=f"rank {rank} weight gradient")
        for name, full in zip(("dw1", "dw3", "dw2"), ws, strict=True):
            assert_close(r[rank][name], full.grad[rank * per:(rank + 1) * per], atol=1e-5, rtol=1e-6,
                         what=f"rank {rank} {name}")
