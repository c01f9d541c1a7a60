"""Where layers get their linear and embedding modules from.

The model definition asks this context for every weight-bearing linear/embedding, so
the same layer code runs in one process (plain torch, here) and sharded inside
Megatron workers (a context that returns tensor-parallel layers and reports its
tp/ep sizes). Layers divide heads, groups and experts by the sizes reported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ParallelContext:
    """Single-process context: plain torch modules, no sharding."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def column_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Output dim sharded over TP (q/kv up-projections, expert w1/w3)."""
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def row_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Input dim sharded over TP; output reduced (wo_b, expert w2)."""
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def replicated_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Same weight on every rank (down-projections to latents, compressors, gates)."""
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def embedding(self, num: int, dim: int, dtype: torch.dtype) -> nn.Module:
        return nn.Embedding(num, dim, dtype=dtype)

    def sharded_parameter(self, full_shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> nn.Parameter:
        """A parameter split along `dim` over TP ranks (attn_sink over heads). Marked the way
        Megatron marks its own (tensor_model_parallel, partition_dim) so init and checkpoint
        code can find the full tensor."""
        shape = list(full_shape)
        shape[dim] //= self.tp_size
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = self.tp_size > 1, dim, 1
        return p

    def to_tp_region(self, t: torch.Tensor) -> torch.Tensor:
        """A replicated tensor about to be consumed by TP-split work (the shared K = V of all
        heads, routing weights of split experts): identity forward, gradient summed over TP."""
        return t

    def sum_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a detached per-rank partial (attention mass of the local heads)."""
        return t

    def lm_logits(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits from the (possibly vocab-split) head weight."""
        return F.linear(y.float(), weight.float())

    def local_experts(self, n_experts: int) -> range:
        """Global ids of the routed experts this rank holds."""
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)
