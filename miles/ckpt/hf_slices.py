"""A trainer rank's slices of DeepSeek's HF checkpoint (FP8/FP4 dequantized by the plugin's
reader): only the tensors the rank holds, each cut to its tensor-parallel part."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from plugins.deepseek_v4.hf_io import iter_tensors


def hf_slices(model, directory: str, own: dict[str, torch.Tensor], rank: int,
              peak: list[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) of each tensor of `own` (the rank's tensors by DeepSeek name)
    in `directory`, read one at a time and checked against the model's shape; peak[0]: the
    most bytes in flight."""
    ctx = model.ctx
    for name, full, held in iter_tensors(directory, sorted(own)):
        if peak is not None:
            peak[0] = max(peak[0], held)
        t = own[name]
        if getattr(t, "tensor_model_parallel", False) and ctx.tp_size > 1:
            full = full.chunk(ctx.tp_size, t.partition_dim)[ctx.tp_rank]
        if tuple(full.shape) != tuple(t.shape):
            raise ValueError(f"{directory}: tensor '{name}' gives {list(full.shape)} on rank {rank}, "
                             f"the model needs {list(t.shape)} (does config.json match the job?)")
        yield name, full
