"""The plugin's ParallelContext backed by Megatron-core tensor parallelism.

Layers ask it for their linears: column-parallel (output split), row-parallel (input
split, output all-reduced), vocab-parallel embedding and head. The model code is the same
as in one process; only where its modules come from changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from plugins.deepseek_v4.parallel import ParallelContext


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


class MegatronContext(ParallelContext):
    def __init__(self, params_dtype: torch.dtype = torch.float32):
        super().__init__(tp_size=ps.get_tensor_model_parallel_world_size(),
                         tp_rank=ps.get_tensor_model_parallel_rank())
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
        return tp.copy_to_tensor_model_parallel_region(t)

    def sum_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        return t

    def lm_logits(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        shard = torch.nn.functional.linear(tp.copy_to_tensor_model_parallel_region(y.float()), weight.float())
        return tp.gather_from_tensor_model_parallel_region(shard)
