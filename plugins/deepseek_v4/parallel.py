"""Where layers get their linear and embedding modules from.

The model definition asks this context for every weight-bearing linear/embedding, so
the same layer code runs in one process (plain torch, here) and sharded inside
Megatron workers (a context that returns tensor-parallel layers and reports its
tp/ep sizes). Layers divide heads, groups and experts by the sizes reported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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

    def local_experts(self, n_experts: int) -> range:
        """Global ids of the routed experts this rank holds."""
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)
