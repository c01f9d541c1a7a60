"""The plugin's ParallelContext backed by Megatron-core's parallel state.

Layers ask it for their linears: column-parallel (output split), row-parallel (input
split, output all-reduced), vocab-parallel embedding and head; and for the token moves
of context parallelism (sequence all-gather) and expert parallelism (each routed
(token, slot) pair sent to the EP rank holding its expert and its output sent back). The
model code is the same as in one process; only where its modules come from and how tokens
travel changes.

TP and CP use all-gather and all-reduce (a reduce-scatter is written as all-reduce +
slice). EP moves each routed (token, slot) pair to its expert's rank and back by
Megatron-core's differentiable all-to-all of uneven splits (gloo on CPU, nccl on GPU); the
exchange around it is ours, for three reasons:
- waits: the GPU's queue drains once an exchange, to bring the split sizes (one all-gather
  of every rank's per-expert counts) to the host, where all_to_all_single takes them.
  Megatron's MoEAlltoAllTokenDispatcher without Transformer Engine's fused permute waits
  three times (that copy, and two masked_selects whose sizes the host must learn): on two
  H200s its EP=2 step spent 36 host waits against the one GPU run's 9.
- routing: our gate gives expert ids and weights [N, k], each slot its own pair, so a token
  may take one expert in two slots (a loaded hash table can), as in one process; a bool
  routing map [N, E] cannot hold that.
- tensor parallelism: Megatron's expert-TP path assumes sequence parallelism (each TP rank
  holds other tokens). Our TP ranks hold the same tokens, so each TP rank exchanges over its
  EP group (ranks of its own TP rank) for its own width-slice of the experts, and the
  model's reduce_from_tp sums the slices, as for every other TP-split layer.
The returned rows are put back per (token, slot) and a token's k slots summed in slot order
in fp32, as one process sums them (ops.routed_experts); the routing weight is applied
before w2 in fp32 by the same routed_experts, on the rows that arrived.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

import miles.train.megatron_import  # noqa: F401  # isort: skip (first: megatron.core imports through it)
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.mappings import all_to_all
from torch import nn

from miles.train import megatron_gpu
from plugins.deepseek_v4.ops import embedding, fp32_linear, main_grad_of, main_grad_written
from plugins.deepseek_v4.parallel import ParallelContext, cp_chunk


def _no_init(_weight: torch.Tensor) -> None:
    """The model's own seeded init (`init_weights`) fills every tensor afterwards."""


class _AnnounceAfter(torch.autograd.Function):
    """Identity on a linear's input whose backward, which runs once the linear's has added the
    weight's gradient into main_grad, announces the weight to the trainer's DDP
    (ops.main_grad_written). Megatron's linear hands DDP a dummy gradient for that, but under
    recompute (torch's non-reentrant checkpoint) the weight it unpacks is another tensor, and
    it hands none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        main_grad_written(ctx.weight)
        return g, None


def _linear(layer, x: torch.Tensor) -> torch.Tensor:
    """A Megatron linear's output for x [..., in]. Its weight gradient goes into main_grad
    (gradient_accumulation_fusion) only where the weight has one: Megatron's backward would
    read a main_grad that a model outside DDP does not have. Its backward flattens two
    leading dims: 2-D inputs (experts) get one."""
    layer.gradient_accumulation_fusion = (layer.config.gradient_accumulation_fusion
                                          and main_grad_of(layer.weight) is not None)
    if layer.gradient_accumulation_fusion and layer.weight.requires_grad:
        x = _AnnounceAfter.apply(x, layer.weight)
    out = super(type(layer), layer).forward(x[None] if x.dim() == 2 else x)[0]
    return out[0] if x.dim() == 2 else out


class _Column(tp.ColumnParallelLinear):
    forward = _linear


class _Row(tp.RowParallelLinear):
    forward = _linear


class _VocabEmbedding(tp.VocabParallelEmbedding):
    """Megatron's vocab-parallel embedding, its lookup by ops.embedding: the weight gradient
    goes into main_grad row by row, not through a dense [V / TP, d] gradient."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.reduce_scatter_embeddings:  # sequence parallel: Megatron's own path
            return super().forward(ids)
        split = self.tp_group.size() > 1
        if split:  # ids of other ranks' rows look up row 0 and are zeroed after
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            ids = torch.where(outside, 0, ids - self.vocab_start_index)
        out = embedding(ids, self.weight)
        if split:
            out = out.masked_fill(outside[..., None], 0.0)
        return tp.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


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


class _Route(NamedTuple):
    """What ep_combine needs of one ep_dispatch."""

    pairs: torch.Tensor  # [N*k] flat pair ids (token * k + slot) in send order
    tokens: int
    k: int
    send: list[int]  # pairs sent to each EP rank (and returned from it by the combine)
    arrived: torch.Tensor  # [ep, per] (host) rows that arrived from each EP rank for each local expert
    rows: torch.Tensor  # the rows that arrived and their weights (kept in the backward graph)
    weights: torch.Tensor


def _swap_chunks(t: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """t's rows in chunks of sizes [a, b] (host; chunk (i, j) is the i*b+j-th) -> the same
    chunks in (j, i) order."""
    a, b = sizes.shape
    chunks = t.split(sizes.flatten().tolist())
    return torch.cat([chunks[i * b + j] for j in range(b) for i in range(a)])


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
        # gradient_accumulation_fusion: each linear adds its weight gradient into main_grad (the
        # one GEMM megatron_gpu supplies); a model without DDP (no main_grad) returns it as usual
        megatron_gpu.fuse_wgrad_accumulation()
        self.mp = ModelParallelConfig(tensor_model_parallel_size=self.tp_size, use_cpu_initialization=True,
                                      perform_initialization=False, params_dtype=params_dtype,
                                      gradient_accumulation_fusion=True)

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
        return self._split(_VocabEmbedding(num, dim, init_method=_no_init, config=self.mp), 0)

    def to_tp_region(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to sum (the casts below cost two copies each way)
            return t
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

    def head_input(self, y: torch.Tensor) -> torch.Tensor:
        # As vocab_logits: every rank's shard reads the same hidden state; the backward sums
        # the ranks' partial gradients in fp32.
        return tp.copy_to_tensor_model_parallel_region(y.float()) if self.tp_size > 1 else y

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

    def ep_dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int):
        if self.ep_size == 1:
            return x, idx, w, None
        n, k = idx.shape
        ep, group = self.ep_size, ps.get_expert_model_parallel_group()
        local = self.local_experts(n_experts)
        per = len(local)
        # The pairs in send order: by expert, so by destination rank (experts lie in blocks
        # of `per` a rank), tokens ascending within an expert.
        flat = idx.flatten()  # [N*k], pair id = token * k + slot
        experts_sent, pairs = torch.sort(flat, stable=True)  # [N*k] each
        # [E] pairs this rank sends each expert, from the sorted ids (bincount would wait for
        # the GPU to learn its output's size)
        bounds = torch.arange(n_experts + 1, device=idx.device, dtype=experts_sent.dtype)
        counts = torch.searchsorted(experts_sent, bounds).diff()
        every = counts.new_empty(ep * n_experts)
        dist.all_gather_into_tensor(every, counts, group=group)  # [ep*E]: every rank's counts
        mine = every.view(ep, n_experts)[:, local.start:local.stop]  # [ep, per]: to each local expert
        # The exchange's one wait: all_to_all_single takes its split sizes on the host.
        host = every.view(ep, n_experts).cpu()
        send = host[self.ep_rank].view(ep, per).sum(1).tolist()
        if sum(send) != flat.numel():  # counted from the sorted ids: one outside [0, E) is missing
            raise ValueError(f"EP rank {self.ep_rank}: {flat.numel() - sum(send)} routed expert ids lie outside "
                             f"[0, {n_experts})")
        arrive = host[:, local.start:local.stop]  # [ep, per]
        recv = arrive.sum(1).tolist()
        rows = all_to_all(group, x.index_select(0, pairs // k), recv, send)  # [R, d]: by source, then expert
        p = all_to_all(group, w.flatten().index_select(0, pairs), recv, send)  # [R]
        # regrouped by local expert, then source (the layout routed_experts takes)
        rows, p = _swap_chunks(rows, arrive), _swap_chunks(p, arrive)
        experts = torch.repeat_interleave(torch.arange(local.start, local.stop, device=idx.device), mine.sum(0),
                                          output_size=rows.shape[0])  # [R], no wait: the size is known
        return rows, experts[:, None], p[:, None], _Route(pairs, n, k, send, arrive, rows, p)

    def ep_combine(self, out: torch.Tensor, route) -> torch.Tensor:
        if route is None:
            return out
        # Every rank must run the same collectives in backward, also when no pair reached its
        # experts: an empty-slice term keeps the dispatch's all-to-alls in the graph.
        if torch.is_grad_enabled():
            out = out + (route.rows[:0].sum() + route.weights[:0].sum()).float()
        # A row is one pair's output (routed_experts' fp32 sum over one slot of a value of the
        # model's dtype): it travels in that dtype without loss, back in the order it came.
        back = _swap_chunks(out.to(route.rows.dtype), route.arrived.T)  # by source rank again, as they came
        back = all_to_all(ps.get_expert_model_parallel_group(), back, route.send,
                          route.arrived.sum(1).tolist())  # [N*k, d] in send order
        per_pair = back.new_zeros(back.shape).index_copy(0, route.pairs, back)
        return per_pair.view(route.tokens, route.k, back.shape[1]).sum(1, dtype=torch.float32)
