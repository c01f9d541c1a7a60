"""A training rank's state as Megatron-core dist_checkpointing sharded tensors.

Every tensor is saved under its global name (DeepSeek's: layers.N.*, global layer ids on
every stage), as the slice this rank holds of the full tensor: TP-split parameters carry
(partition_dim, tp_rank, tp_size) offsets, everything else is whole. Routed experts are
saved stacked, `layers.N.ffn.experts.w1` [E, I, d], each EP rank its experts' rows. So a
checkpoint saved at one TP/PP/EP/CP/DP layout loads at any other.

replica_id is Megatron's (PP, TP, DP) triple; exactly one rank (all zeros) writes each
slice: the first stage's embedding (the last stage's MTP copy is a replica), TP rank 0 of
replicated tensors, data-parallel rank 0 (expert-data-parallel rank 0 for experts).

The optimizer's moments and fp32 main parameters go through Megatron's DistributedOptimizer
in its `fully_sharded_model_space` form: each state tensor is keyed and sliced like its
parameter, so it reshards with it. RNG states are per rank (restored when the layout is
unchanged). Loading reads tensors only (DCP data, torch.load with weights_only for objects)
after the metadata file passed `safe_metadata.check`.
"""

from __future__ import annotations

import functools
import queue
import threading

import torch

import miles.train.megatron_import  # noqa: F401  # isort: skip (first: megatron.core imports through it)
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from miles.ckpt import safe_metadata
from miles.train import adamw

OPTIM_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def model_tensors(model, keep_vars: bool = True) -> dict[str, torch.Tensor]:
    """The model's state_dict without what Megatron's linears add that is not a model tensor
    (`None` for absent biases, `_extra_state`)."""
    return {k: v for k, v in model.state_dict(keep_vars=keep_vars).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The parameters themselves (the optimizer holds them: stacked routed experts whole, not
    the per-expert views state_dict gives) and the persistent buffers, by module path."""
    persistent = model_tensors(model)
    return {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in persistent}}


def model_sharded_state_dict(model) -> dict[str, ShardedTensor]:
    """{global name: ShardedTensor over the parameter or buffer itself} (parameters by
    identity: the optimizer's state is matched to them). A stacked expert weight
    (`expert_dim`) is split over EP along that dim, its global shape all experts'."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    dense_dp = ps.get_data_parallel_rank(with_context_parallel=True)
    expert_dp = ps.get_expert_data_parallel_rank()
    out = {}
    for name, t in checkpoint_tensors(model).items():
        split = getattr(t, "tensor_model_parallel", False) and tp > 1
        pp_copy = int(name == "embed.weight" and not model.ctx.first_stage)
        dp = expert_dp if getattr(t, "allreduce", True) is False else dense_dp
        replica = (pp_copy, 0 if split else tp_rank, dp)
        offsets = [(t.partition_dim, tp_rank, tp)] if split else []
        if hasattr(t, "expert_dim"):
            offsets.insert(0, (t.expert_dim, ep_rank, ep))
        out[name] = ShardedTensor.from_rank_offsets(name, t, *offsets, replica_id=replica)
    return out


def rng_state() -> dict:
    cuda = torch.cuda.is_available()
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if cuda else torch.empty(0),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _prime(optimizer) -> None:
    """A fresh torch Adam has no state until its first step, and Megatron's state_dict needs
    one to load into: zero moments and step 0 (all overwritten by the load)."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    dtype = adamw.moments_dtype(inner)
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p, dtype=dtype),
                                      "exp_avg_sq": torch.zeros_like(p, dtype=dtype)}


def _load_optimizer(optimizer, state: dict) -> None:
    """DistributedOptimizer.load_state_dict, in its two halves. Megatron-core 0.16.1 with torch's
    Adam (no Apex / Transformer Engine, as here) keeps each parameter's `step` in the state
    that the fully_reshardable loader copies key by key, and finds no `step` in the checkpoint
    (it is restored from the param groups): the steps are set aside around that copy. Megatron
    also gives every parameter the same `step` tensor, which torch's Adam increments in place
    once per parameter; each gets its own copy."""
    subs = optimizer.chained_optimizers if hasattr(optimizer, "chained_optimizers") else [optimizer]
    states = [state] if len(subs) == 1 else [state[i] for i in range(len(subs))]
    for sub, st in zip(subs, states, strict=True):
        param_state = st.pop("param_state")
        st.pop("param_state_sharding_type")
        sub.load_state_dict(st)  # param groups and step; allocates the moments
        inner = sub.optimizer.state
        # torch's load_state_dict makes each moment its weight's dtype (fp32): bf16 moments
        # (train.optim.moments) are made bf16 again before the checkpoint's values land in them
        adamw.conform_moments(sub.optimizer)
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        sub.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():  # one tensor each: Adam increments them in place
            inner[p]["step"] = step.clone()


def sharded_state_dict(model, optimizer, scheduler, world: int, rank: int, is_loading: bool = False) -> dict:
    """What one rank saves: model, optimizer (+ its param groups), LR schedule, RNG."""
    model_sd = model_sharded_state_dict(model)
    if optimizer is None:
        return {"model": model_sd}
    if is_loading:
        _prime(optimizer)
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_FORMAT),
            "scheduler": scheduler.state_dict(),
            "rng": ShardedObject(f"rng.world{world}", rng_state(), (world,), (rank,), replica_id=0)}


def save(directory: str, model, optimizer, scheduler, world: int, rank: int,
         async_save: bool = False) -> BackgroundSave | None:
    """Collective: every rank writes its shards of one checkpoint into `directory` (the model
    alone when `optimizer` is None: a conversion). With `async_save`, the tensors are copied
    to host memory now and written by a thread; returns the BackgroundSave every rank must
    finish(). The files are written by this process: Megatron's writer forks a process per
    file (its async caller, one per save), and a fork of a Ray actor, whose other threads may
    hold locks at that instant, can hang in the child while the parent waits on it forever (a
    DP=2 job hung in its second save on CI; Ray advises against forking in actors)."""
    sd = sharded_state_dict(model, optimizer, scheduler, world, rank)
    # The files are written in this process (_write_here), so their results need no queue
    # between processes: Megatron's, made on its first use, is a multiprocessing Manager's
    # (a spawned interpreter: ~2 s at the first save, and every save's results pickled
    # through it, ~4 s of its CPU in a 3-step tiny job).
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    request = dist_checkpointing.save(sd, directory, content_metadata=OPTIM_FORMAT, async_sharded_save=True)
    if request.async_fn is not None:  # None: nothing to write on this rank
        multiproc = request.async_fn
        assert multiproc.func is FileSystemWriterAsync.write_preloaded_data_multiproc, multiproc.func
        request = request._replace(async_fn=functools.partial(_write_here, *multiproc.args))
    if not async_save:
        request.execute_sync()  # stage, write, barrier, then the metadata (.metadata, metadata.json)
        return None
    return BackgroundSave(request)


def _write_here(transforms, use_msc: bool, rank: int, buckets: list, results) -> None:
    """Megatron's write_preloaded_data_multiproc without its forked writers: each bucket
    (one file) written in turn by the calling thread, the results (or the first error)
    handed to Megatron's finalization through its queue, as the forked writers do."""
    # Undecorated: its decorator turns the garbage collector off for the process (for a forked
    # child's sake), which from a writer thread would stop it for training too.
    write = FileSystemWriterAsync.write_preloaded_data.__wrapped__
    written: dict | Exception = {}
    for i, bucket in enumerate(buckets):
        out, done = queue.SimpleQueue(), queue.Queue()
        done.put(i)
        write(transforms, i, bucket, out, done, True, use_msc=use_msc)
        idx, result = out.get()
        if isinstance(result, Exception):
            written = result
            break
        written[idx] = result
    results.put(written)


class BackgroundSave:
    """An async save: the files written by a thread from a host copy of the tensors taken at
    construction (training goes on changing them), finalized by every rank together."""

    def __init__(self, request):
        self.request, self.thread = request, None
        if request.async_fn is not None:
            args = list(request.async_fn_args)  # (rank, buckets, results queue)
            # GPU tensors: copied to pinned host memory asynchronously, one synchronize for all
            # (as Megatron's preload); CPU tensors: cloned.
            args[1] = [(file, key, (objects, [(item, t.to("cpu", non_blocking=True) if t.is_cuda else t.clone())
                                              for item, t in tensors]))
                       for file, key, (objects, tensors) in args[1]]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.thread = threading.Thread(target=request.async_fn, args=args, name="miles-ckpt-writer", daemon=True)
            self.thread.start()

    def finish(self, blocking: bool) -> bool:
        """Collective: True once every rank's files are written and the checkpoint's metadata
        is too (blocking: wait for that). A rank's failed write raises here, on every rank."""
        if blocking and self.thread is not None:
            self.thread.join()
        busy = torch.tensor([int(self.thread is not None and self.thread.is_alive())],
                            device="cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(busy)
        if busy.item():
            return False
        for finalize in self.request.finalize_fns:
            finalize()
        return True


@torch.no_grad()
def load(directory: str, model, optimizer, scheduler, world: int, rank: int, same_layout: bool,
         with_optimizer: bool = True) -> None:
    """Collective: load this rank's slices of a checkpoint saved at any layout (the RNG states
    only when it was saved at this one)."""
    sd = sharded_state_dict(model, optimizer if with_optimizer else None, scheduler, world, rank, is_loading=True)
    if not same_layout:
        sd.pop("rng", None)
    safe_metadata.check(directory)
    loaded = dist_checkpointing.load(sd, directory)
    params = checkpoint_tensors(model)
    for name, t in loaded["model"].items():
        if params[name].data_ptr() != t.data_ptr():
            params[name].copy_(t)
    if with_optimizer:
        _load_optimizer(optimizer, loaded["optimizer"])
        scheduler.num_steps = 0  # Megatron's load adds the checkpoint's count to the current one
        scheduler.load_state_dict(loaded["scheduler"])
    elif optimizer is not None:  # weights alone: the fp32 main copies (bf16) start from them
        optimizer.reload_model_params()
    if "rng" in loaded:
        set_rng_state(loaded["rng"])
