"""Megatron-core's DDP with the gradient reduction overlapped with the backward.

With `overlap_grad_reduce`, Megatron reduce-scatters a bucket of gradients as soon as every
parameter in it has its gradient, while the backward goes on: DDP's hook on each parameter's
gradient accumulator adds the gradient into main_grad and counts the parameter ready. Some of
the model's ops add a weight's gradient into main_grad themselves and hand autograd none (the
grouped expert GEMMs, the LM/MTP head, the embedding, the projections of
ops.projection_main_grad, the CUDA graphs' backward) or, from Megatron's linears, a dummy
(none under recompute). Megatron's hook asserts a gradient under
overlap, and the engine runs the accumulator of a None gradient on the thread that called
backward, not on the device's thread: a bucket's collective launched from there could race the
device thread's and go out in another order than on another rank. So those ops announce the
weight themselves, on the thread that ran them (`main_grad_ready`, called through
plugins.deepseek_v4.ops.main_grad_written; for Megatron's linears
miles.train.parallel_context._AnnounceAfter), and the hook here counts only the gradients it
adds. A weight announced twice a micro-batch (the head: main and MTP) is counted twice:
Megatron compares each step's counts with the first step's, so a change of what the backward
reaches (the loss's terms: TrainWorker.set_loss) makes the next step count afresh
(`relearn_counts`). Every rank must reach the same parameters in a step, as this model's
static structure does (empty compressed blocks and expert groups keep their ops): a bucket
reached on one rank and not on another would start at another point on each.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

import miles.train.megatron_import  # noqa: F401  # isort: skip (first: megatron.core imports through it)
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.cuda_graphs import is_graph_capturing


def _announce(ddp_ref: weakref.ref, param_ref: weakref.ref) -> None:
    """A parameter's `main_grad_ready`: weak both ways, so that no reference cycle through the
    parameter keeps a released model alive (the worker freezes the collector's generations)."""
    ddp, param = ddp_ref(), param_ref()
    if ddp is not None and param is not None:
        ddp._ready(param)


def overlap_wanted(flag: bool, reduce_ranks: int) -> bool:
    """Overlap the reduction where it is asked for and there is one (gradients summed over more
    than one data- or context-parallel rank); on one rank it would only add launches."""
    return flag and reduce_ranks > 1


class OverlappedDDP(DistributedDataParallel):
    """Megatron's DistributedDataParallel whose parameters can be announced ready by the ops
    that write their main_grad (`param.main_grad_ready()`); see the module's docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.param_to_bucket_group:
            p.main_grad_ready = partial(_announce, weakref.ref(self), weakref.ref(p))
        self.early = None  # of the last step's bucket groups, those whose reduction began in the backward

    def _groups(self) -> list:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _ready(self, param: torch.nn.Parameter) -> None:
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        def hook(*unused):
            # A gradient this hook adds is counted here; one an op added itself (a None or, from
            # Megatron's linears, a dummy with grad_added_to_main_grad) the op announced.
            if is_graph_capturing() or param not in self.param_to_bucket_group or param.grad is None:
                return
            if not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
                self._ready(param)
            param.grad = None

        return hook

    def relearn_counts(self) -> None:
        """Megatron starts a bucket group's reduction when this step's per-parameter counts equal
        the first step's. Where what the backward reaches changes (another loss, with or without
        MTP), the next step counts afresh, as a first step: its reductions start after its
        backward, the ones after it overlap again."""
        for group in self._groups():  # (Megatron's reset records a first step's counts, then clears them)
            group.is_first_batch = True
            group.golden_per_param_grad_ready_counts, group.per_param_grad_ready_counts = {}, {}

    def announce_rest(self) -> None:
        """Count ready every parameter the backward did not (one the loss does not reach: its
        main_grad holds zeros); their buckets' reductions start now. Before finish_grad_sync.
        Records how many bucket groups had begun theirs in the backward (`early`, of all): none
        on a step that learns the counts (the first, or the one after relearn_counts), all on
        the later ones where the backward reaches every parameter."""
        if not self.ddp_config.overlap_grad_reduce:
            return
        self.early = (sum(g.grad_reduce_handle is not None for g in self._groups()), len(self._groups()))
        for group in self._groups():
            if group.is_last_microbatch:
                for p in group.params:
                    if p not in group.per_param_grad_ready_counts:
                        group.register_grad_ready(p, self.force_all_reduce)
