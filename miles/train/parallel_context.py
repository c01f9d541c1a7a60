"""The plugin's ParallelContext backed by Megatron-core's parallel state.

Layers ask it for their linears: column-parallel (output split), row-parallel (input
split, output all-reduced), vocab-parallel embedding and head; and for the token moves
of context parallelism (sequence all-gather) and expert parallelism (token all-gather to
the experts, partial outputs summed back). The model code is the same as in one process;
only where its modules come from and how tokens travel changes.

The collectives are all-gather and all-reduce only (gloo runs them on CPU, nccl on GPU);
a reduce-scatter is written as all-reduce + slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from plugins.deepseek_v4.ops import fp32_linear
from plugins.deepseek_v4.parallel import ParallelContext, cp_chunk


def _no_init(_weight: torch.Tensor) -> None:
    """The model's own seeded init (`init_weights`) fills every tensor afterwards."""


class _Column(tp.ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Megatron's linear backward flattens two leading dims: give 2-D inputs (experts) one.
        out = super().forward(x[None] if x.dim() == 2 else x)[0]
        return out[0] if x.dim() == 2 else out


class _Row(tp.RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x[None] if x.dim() == 2 else x)[0]
        return out[0] if x.dim() == 2 else out


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def _gather_rows(t: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rows of every rank, in rank order (rank r holds sizes[r] rows)."""
    pad = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    pad[: t.shape[0]] = t
    return torch.cat([part[:n] for part, n in zip(_all_gather(pad, group), sizes, strict=True)])


def _own_rows(t: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    start = sum(sizes[: dist.get_rank(group)])
    return t[start: start + sizes[dist.get_rank(group)]]


class _GatherSeq(torch.autograd.Function):
    """[B, s, ...] tokens of each CP rank -> [B, S, ...] in sequence order; backward: sum over
    ranks, own tokens. order [S]: the gathered row of each sequence position; own [s]: this
    rank's positions (cp_chunk)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, order: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.own = group, own
        return torch.cat(_all_gather(t, group), 1)[:, order]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = _all_reduce(g.float(), ctx.group).to(g.dtype)  # partial sums added in fp32
        return g[:, ctx.own], None, None, None


class _GatherRows(torch.autograd.Function):
    """[N_r, ...] rows of each EP rank -> [sum N, ...]; backward: sum over ranks, own rows."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(t, sizes, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _own_rows(_all_reduce(g.float(), ctx.group).to(g.dtype), ctx.sizes, ctx.group), None, None


class _SumOwnRows(torch.autograd.Function):
    """Partial outputs for all ranks' rows [sum N, ...] -> own rows summed over ranks;
    backward: every rank's row gradients gathered (the dual of _GatherRows)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _own_rows(_all_reduce(t, group), sizes, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_rows(g, ctx.sizes, ctx.group), None, None


class MegatronContext(ParallelContext):
    def __init__(self, params_dtype: torch.dtype = torch.float32):
        super().__init__(tp_size=ps.get_tensor_model_parallel_world_size(),
                         tp_rank=ps.get_tensor_model_parallel_rank(),
                         ep_size=ps.get_expert_model_parallel_world_size(),
                         ep_rank=ps.get_expert_model_parallel_rank(),
                         pp_size=ps.get_pipeline_model_parallel_world_size(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(),
                         cp_size=ps.get_context_parallel_world_size(),
                         cp_rank=ps.get_context_parallel_rank())
        self.mp = ModelParallelConfig(tensor_model_parallel_size=self.tp_size, use_cpu_initialization=True,
                                      perform_initialization=False, params_dtype=params_dtype)

    @staticmethod
    def _split(module: nn.Module, dim: int) -> nn.Module:
        # Megatron marks split weights only inside its own initializer, which the model's
        # seeded init replaces: mark them here so init and checkpoints see the full shape.
        tp.set_tensor_model_parallel_attributes(module.weight, True, dim, 1)
        return module

    def column_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return self._split(_Column(in_features, out_features, config=self.mp, init_method=_no_init, bias=False,
                                   gather_output=False, skip_bias_add=True), 0)

    def row_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return self._split(_Row(in_features, out_features, config=self.mp, init_method=_no_init, bias=False,
                                input_is_parallel=True, skip_bias_add=True), 1)

    def embedding(self, num: int, dim: int, dtype: torch.dtype) -> nn.Module:
        return self._split(tp.VocabParallelEmbedding(num, dim, init_method=_no_init, config=self.mp), 0)

    def to_tp_region(self, t: torch.Tensor) -> torch.Tensor:
        # The backward all-reduce sums the TP ranks' partial gradients: in fp32, so a bf16
        # model rounds once (as one process does), not once per rank.
        return tp.copy_to_tensor_model_parallel_region(t.float()).to(t.dtype)

    def reduce_from_tp(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return t
        # Megatron all-reduces its input in place: give it a tensor of its own (`.float()` of an
        # fp32 tensor is the tensor itself, which autograd may have saved, e.g. exp's output).
        return tp.reduce_from_tensor_model_parallel_region(t.float() if t.dtype != torch.float32 else t.clone())

    def sum_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        return t

    def max_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        return t

    def vocab_logits(self, y: torch.Tensor, weight: torch.Tensor, tf32: bool = False) -> torch.Tensor:
        # The hidden state is replicated over TP, each rank's logits a vocabulary shard: its
        # gradient sums over the ranks (in fp32, as one process adds its terms).
        y = tp.copy_to_tensor_model_parallel_region(y.float()) if self.tp_size > 1 else y
        return fp32_linear(y, weight, tf32)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return tp.gather_from_tensor_model_parallel_region(logits) if self.tp_size > 1 else logits

    def mark_expert(self, module: nn.Module) -> None:
        # Megatron DDP reduces parameters with allreduce=False over the expert-data-parallel
        # group (each expert lives on one EP rank) and the optimizer shards them apart.
        for p in module.parameters():
            p.allreduce = False

    def gather_seq(self, t: torch.Tensor) -> torch.Tensor:
        if self.cp_size == 1:
            return t
        seq = t.shape[1] * self.cp_size
        chunks = torch.cat([cp_chunk(seq, self.cp_size, r) for r in range(self.cp_size)])  # [S] gathered order
        order = torch.argsort(chunks).to(t.device)
        own = cp_chunk(seq, self.cp_size, self.cp_rank).to(t.device)
        return _GatherSeq.apply(t, ps.get_context_parallel_group(), order, own)

    def ep_gather(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        if self.ep_size == 1:
            return x, idx, w, None
        group = ps.get_expert_model_parallel_group()
        sizes = [int(n) for n in _all_gather(torch.tensor([x.shape[0]], device=x.device), group)]
        xs, ws = _GatherRows.apply(x, sizes, group), _GatherRows.apply(w, sizes, group)
        return xs, _gather_rows(idx, sizes, group), ws, (sizes, xs, ws)

    def ep_combine(self, out: torch.Tensor, route) -> torch.Tensor:
        if self.ep_size == 1:
            return out
        sizes, xs, ws = route
        # Every rank must run the same collectives in backward, also when no token reached
        # its experts: an empty-slice term keeps both gathers (and this sum) in the graph.
        if torch.is_grad_enabled():
            out = out + (xs[:0].sum() + ws[:0].sum()).float()
        return _SumOwnRows.apply(out, sizes, ps.get_expert_model_parallel_group())
