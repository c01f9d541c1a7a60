"""Read-only views of a TrainWorker's training state, for parity checks and debugging.

`TrainWorker.inspect(name, *args)` runs one of these functions in the worker's process. They
read what training itself uses (Megatron DDP's reduced gradient buffers, the
DistributedOptimizer's shards and moments), so a parity check through them checks the
training path, not a copy of it. Each parameter part is reported as (start, end) in the
flattened TP-local tensor: the elements this data-parallel rank's optimizer shard owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from miles.train.batching import MicroBatch
from plugins.deepseek_v4.checksum import named_md5
from plugins.deepseek_v4.model import MoE


def _parts(model, name: str, p: torch.nn.Parameter) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(DeepSeek name, view, its first element in the flattened parameter): a parameter is
    itself, a stacked expert weight one view per expert."""
    for n, v in model.deepseek_named([(name, p)]):
        yield n, v, v.storage_offset() - p.storage_offset()


def _owned(worker) -> Iterator[tuple[str, torch.Tensor, int, int, torch.Tensor, dict]]:
    """(name, its flattened reduced gradient, start, end, optimizer shard, its optimizer
    state) for every parameter part this rank's DistributedOptimizer owns (dense and expert
    optimizers alike), under DeepSeek's names (per expert)."""
    if worker.opt is None:
        raise RuntimeError(f"rank {worker.rank}: setup_training() first (the optimizer owns the shards)")
    model = worker.model
    names = {p: n for n, p in model.named_parameters()}
    for o in getattr(worker.opt, "chained_optimizers", [worker.opt]):
        models = o.model_float16_groups + o.model_fp32_groups
        shards = o.shard_fp32_from_float16_groups + o.shard_fp32_groups
        for model_group, shard_group in zip(models, shards, strict=True):
            for p, shard in zip(model_group, shard_group, strict=True):
                r = o._get_model_param_range_map(p)["param"]
                state = o.optimizer.state.get(shard, {})
                for name, v, off in _parts(model, names[p], p):
                    lo, hi = max(r.start, off), min(r.end, off + v.numel())
                    if lo >= hi:
                        continue
                    cut = slice(lo - r.start, hi - r.start)
                    grad = p.main_grad.detach().reshape(-1)[off:off + v.numel()]
                    yield (name, grad, lo - off, hi - off, shard[cut],
                           {k: t[cut] if k != "step" else t for k, t in state.items()})


def _split_dims(worker) -> dict[str, int | None]:
    return {k: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            for k, p in worker.model.deepseek_named(worker.model.named_parameters())}


@contextlib.contextmanager
def routes(model: torch.nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the experts each learned router picks: {MoE module name: one [B, S, k] tensor
    (experts sorted) per forward of the block, in run order}, on the host, for the tokens this
    rank holds. A block's forward run again in the backward (config.recompute, `fwd.replay`)
    picks the same experts and is not recorded."""
    out: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, moe in model.named_modules():
        if isinstance(moe, MoE) and not moe.gate.is_hash:
            seen, picks = {}, out.setdefault(name, [])  # seen: the block's [B, S], whether a replay

            def enter(mod, args, seen=seen):  # MoE.forward(x [B, S, d], fwd, ids, valid)
                seen.update(shape=args[0].shape[:-1], replay=args[1] is not None and args[1].replay)

            def record(gate, args, result, seen=seen, picks=picks):
                if not seen["replay"]:  # result: experts [B*S, k], weights, scores
                    picks.append(result[0].sort(-1).values.reshape(*seen["shape"], -1).cpu())

            hooks += [moe.register_forward_pre_hook(enter), moe.gate.register_forward_hook(record)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def step_gradients(worker, micro_batches: list[MicroBatch]) -> dict:
    """The training step without its update (TrainWorker.reduced_gradients): the global
    batch's loss metrics, per-token log-probs of this rank's tokens (last stage: this CP
    rank's chunk, per micro-batch), and this rank's owned part of every reduced gradient
    {name: (start, end, values)}, with each tensor's TP split dim and TP-local size, and the
    experts each learned router picked for this rank's tokens, per micro-batch (`routes`). The
    gradient buffers are zeroed and the router's load counts restored afterwards: the next
    training step sees none of this pass."""
    loads = [(b, b.clone()) for n, b in worker.model.named_buffers() if n.endswith("expert_load")]
    with routes(worker.model) as picked:
        res, aux = worker.reduced_gradients(micro_batches)
    for b, before in loads:  # the router's load counts are the training step's, not this look's
        b.copy_(before)
    grads = {name: (a, b, g[a:b].float().cpu().clone()) for name, g, a, b, _, _ in _owned(worker)}
    numel = {k: p.numel() for k, p in worker.model.deepseek_named(worker.model.named_parameters())}
    out = {"losses": worker._reported(res, aux), "logprobs": [r["logprobs"].cpu() for r in res], "grads": grads,
           "dims": _split_dims(worker), "numel": numel, "routes": picked}
    worker.ddp.zero_grad_buffer()  # nothing of this pass reaches the next step
    return out


def reduction_overlap(worker) -> tuple[int, int] | None:
    """Of the last step's gradient bucket groups (dense and expert), how many began their
    reduction during the backward, and how many there are; None when the reduction is not
    overlapped (one data-parallel rank, or train.optim.overlap_grad_reduce off)."""
    return worker.ddp.early


def optimizer_shards(worker) -> dict[str, dict]:
    """This rank's optimizer state: per owned parameter part, its (start, end), the fp32 main
    values and Adam's first and second moments."""
    out = {}
    for name, _, a, b, shard, st in _owned(worker):
        if "exp_avg" not in st:
            raise RuntimeError(f"rank {worker.rank}: no optimizer step yet, no moments for {name}")
        out[name] = {"start": a, "end": b, "param": shard.detach().float().cpu().clone(),
                     **{k: st[k].float().cpu().clone() for k in ("exp_avg", "exp_avg_sq")}}
    return out


def moment_dtypes(worker) -> list[str]:
    """The dtypes this rank's optimizer keeps Adam's moments in (train.optim.moments), one a
    kind present: ['torch.float32'] or ['torch.bfloat16']; [] before any step or load."""
    return sorted({str(st[k].dtype) for *_, st in _owned(worker) for k in ("exp_avg", "exp_avg_sq") if k in st})


def model_state(worker) -> dict[str, torch.Tensor]:
    """Parameters and router biases (TP-local), on the host. Megatron's linears add `None`
    entries for absent biases and `_extra_state`, which are not model tensors."""
    from miles.ckpt.sharded import model_tensors

    return {k: v.detach().cpu().clone() for k, v in model_tensors(worker.model, keep_vars=False).items()}


def resident_bytes(worker) -> int:
    """Device bytes of every training-state storage (what sleep frees and wake_up restores)."""
    return sum(t.untyped_storage().nbytes() for t in worker._storages())


def state_digest(worker) -> str:
    """MD5 over the bytes of every training-state storage (weights, DDP buffers, optimizer
    parameters and moments), in a fixed order."""
    views = [torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
             for t in worker._storages()]
    return named_md5((str(i), v) for i, v in enumerate(views))
