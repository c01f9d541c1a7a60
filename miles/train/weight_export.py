"""A trainer's weights as full tensors under DeepSeek's names, in buckets, from the ranks
that own them: one rank per tensor (data- and context-parallel rank 0, TP rank 0; experts
from their EP rank, layers from their pipeline stage). Every rank walks all tensors in the
same order (TP-split ones are gathered over the TP group, a collective), so `plan` (shapes
only, no communication) and `buckets` cut the same buckets."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from miles.rollout.weights import cut_names


def _items(model) -> Iterator[tuple[str, torch.Tensor, list[int], bool]]:
    """(name, this rank's tensor, full shape, this rank exports it) for every model tensor."""
    # Megatron loads in the worker's process only: the driver imports this module through
    # TrainWorker (the actor's class), and Megatron's import is ~4 s of CPU a job.
    from megatron.core import parallel_state as ps

    from miles.ckpt.sharded import model_tensors

    dense_owner = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0  # each expert lives on one EP rank
    tp0, tp = ps.get_tensor_model_parallel_rank() == 0, model.ctx.tp_size
    for name, t in model_tensors(model).items():
        split = getattr(t, "tensor_model_parallel", False) and tp > 1
        shape = list(t.shape)
        if split:
            shape[t.partition_dim] *= tp
        owned = tp0 and (expert_owner if getattr(t, "allreduce", True) is False else dense_owner)
        if name == "embed.weight" and not model.ctx.first_stage:
            owned = False  # the last stage's MTP copy equals the first stage's
        yield name, t, shape, owned


def plan(model, bucket_bytes: int) -> list[list[tuple[str, list[int], str]]]:
    """This rank's buckets as [(name, full shape, dtype)] without moving any data."""
    return _plan(list(_items(model)), bucket_bytes)


def _plan(items: list, bucket_bytes: int) -> list[list[tuple[str, list[int], str]]]:
    owned = [(n, s, t.dtype) for n, t, s, own in items if own]
    meta = {n: (s, d) for n, s, d in owned}
    sizes = ((n, math.prod(s) * d.itemsize) for n, s, d in owned)
    cuts = cut_names(sizes, bucket_bytes)
    return [[(n, meta[n][0], str(meta[n][1]).removeprefix("torch.")) for n in names] for names in cuts]


@torch.no_grad()
def buckets(model, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's buckets {name: full tensor on the model's device}, the same cut as `plan`.
    Every rank must exhaust it (TP gathers are collectives)."""
    from megatron.core import parallel_state as ps

    from miles.train.parallel_context import _all_gather

    items = list(_items(model))  # one walk of the state_dict for the plan and the data
    cuts = iter(_plan(items, bucket_bytes))
    want = next(cuts, [])
    cur: dict[str, torch.Tensor] = {}
    for name, t, _, own in items:
        if getattr(t, "tensor_model_parallel", False) and model.ctx.tp_size > 1:
            t = torch.cat(_all_gather(t.detach(), ps.get_tensor_model_parallel_group()), t.partition_dim)
        if not own:
            continue
        cur[name] = t.detach()
        if len(cur) == len(want):
            yield cur
            cur, want = {}, next(cuts, [])
