"""Megatron-core on GPU without Transformer Engine or apex: the one place that bridges it.

Without either library Megatron-core 0.16.1 falls back to torch's AdamW in its foreach
form and to Python loops for the gradient norm and the clipping scale: the norm turns
every gradient's norm into a Python float (one host sync per tensor, ~1,000 a step for
the ~1B config) and the scale is one launch per tensor. `apply()` swaps those two
fallbacks for torch's multi-tensor ops (`_foreach_norm`, `_foreach_mul_`), and
`fuse_adam(opt)` switches the optimizer's AdamW to a fused kernel (called after the
optimizer is built and after its state is loaded), and `step(opt)` runs Megatron's
optimizer step with the gradient clipping, AdamW and the copy of the weights into the
bf16 parameter buffer as that one kernel (miles.train.adamw). All do
nothing where TE or apex is installed (Megatron then uses theirs) or CUDA is absent
(megatron_cpu covers CPU). `fuse_wgrad_accumulation()` supplies the one apex extension
Megatron's linears call under gradient_accumulation_fusion (device-neutral: the CPU
trainer runs the same path). No other module patches Megatron-core on GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from miles.train.megatron_cpu import PINNED_MEGATRON_CORE, MegatronVersionError

_applied = False


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: (norm [1] fp32 on the device, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: dst = src * scale (src and dst may be the same list)."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def apply() -> bool:
    """Replace Megatron's per-tensor Python fallbacks with multi-tensor ops. True when active."""
    global _applied
    if not torch.cuda.is_available():
        return False
    import megatron.core
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    version = getattr(megatron.core, "__version__", "unknown")
    if version != PINNED_MEGATRON_CORE:
        raise MegatronVersionError(f"miles' GPU bridge was written for megatron-core {PINNED_MEGATRON_CORE}, "
                                   f"found {version}: pin megatron-core=={PINNED_MEGATRON_CORE}")
    if _applied:
        return True
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:  # neither TE nor apex
        clip_grads.l2_norm_impl = _l2_norm
        clip_grads.multi_tensor_scale_impl = _scale
    if optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        optimizer.multi_tensor_scale_impl = _scale
    _applied = True
    return True


class _WgradAccumulation:
    """apex's `fused_weight_gradient_mlp_cuda` as Megatron's tensor-parallel linears call it
    under gradient_accumulation_fusion: main_grad += grad_output^T @ input, both [T, *], by
    one GEMM into the fp32 buffer (ops.accumulate_wgrad). Without it each linear returns a
    bf16 weight gradient that DDP's hook (or the graphed backward) then adds: a write, a
    read and an fp32 read-modify-write of the buffer more per micro-batch, and the gradient
    rounded to bf16 before its sum."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        from plugins.deepseek_v4.ops import accumulate_wgrad

        accumulate_wgrad(main_grad, grad_output, total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32  # main_grad in half precision: same contract


def fuse_wgrad_accumulation() -> None:
    """Let Megatron's linears take gradient_accumulation_fusion (each adds its weight gradient
    into the parameter's main_grad and returns none) without apex: its layers module gets
    the extension it looks for (a private name of the pinned version). Leaves an installed
    apex alone."""
    import megatron.core
    from megatron.core.tensor_parallel import layers

    version = getattr(megatron.core, "__version__", "unknown")
    if version != PINNED_MEGATRON_CORE:
        raise MegatronVersionError(f"miles' wgrad accumulation was written for megatron-core "
                                   f"{PINNED_MEGATRON_CORE}, found {version}: pin "
                                   f"megatron-core=={PINNED_MEGATRON_CORE}")
    if torch.cuda.is_available():  # the GEMM's capability probe, eagerly (not inside a graph capture)
        from plugins.deepseek_v4.ops import _addmm_takes_fp32_addend

        _addmm_takes_fp32_addend()
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _WgradAccumulation
        layers._grad_accum_fusion_available = True


def fuse_adam(opt) -> int:
    """Switch every torch AdamW inside a Megatron optimizer (chained or not) to a fused kernel:
    `step` then updates it with miles.train.adamw (torch's fused CUDA AdamW where it is
    stepped directly), its step counts on the device as both keep them. Returns the number of
    parameter groups switched."""
    n = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):
            continue  # TE's or apex's FusedAdam, or no parameters on this rank
        for group in inner.param_groups:
            if not all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                continue
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:  # the fused kernel reads step counts on the device (fp32)
                st = inner.state.get(p)
                if st and "step" in st and not st["step"].is_cuda:
                    st["step"] = st["step"].to(p.device, torch.float32)
            n += 1
    return n


def _fused_adams(opt) -> list[torch.optim.AdamW] | None:
    """The torch AdamW inside each of opt's optimizers when every one is fused, else None."""
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])
             if getattr(o, "optimizer", None) is not None]
    fused = all(isinstance(o, torch.optim.AdamW) and all(g.get("fused") for g in o.param_groups) for o in inner)
    return inner if inner and fused else None


def grad_norm(opt) -> torch.Tensor:
    """Megatron's get_grad_norm (L2) left on the device: a float64 [] tensor, its value to 1 ulp
    (a sqrt where Megatron takes the host's pow(x, 0.5); the chained optimizers' branches as its).
    Megatron reads it to the host (.item()) at once, so the host waits there for the whole
    backward and the GPU then idles while the host launches the optimizer (~3 ms of the ~1B
    step on an H200); `step` keeps the clip on the device and the caller reads the norm after
    the step."""
    from megatron.core.optimizer import clip_grads

    def norm(o, grads) -> torch.Tensor:  # get_grad_norm_fp32's sum over its group, as float64 sqrt
        if grads:
            n, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl,
                                                   torch.zeros(1, dtype=torch.int, device=grads[0].device),
                                                   [grads], False)
            sq = n ** 2.0
        else:
            sq = torch.zeros(1, dtype=torch.float, device="cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(sq, group=o.get_grad_stats_parallel_group())
        return sq.double().sqrt().reshape(())

    subs = getattr(opt, "chained_optimizers", [opt])
    if len(subs) == 1:
        return norm(subs[0], subs[0].get_main_grads_for_grad_norm())
    if opt.grads_states_parallel_group_is_shared():
        return norm(subs[0], [g for o in subs for g in o.get_main_grads_for_grad_norm()])
    return torch.stack([norm(o, o.get_main_grads_for_grad_norm()) for o in subs]).square().sum().sqrt()


def model_copies(o) -> dict[int, torch.Tensor | None] | None:
    """Where Megatron's DistributedOptimizer copies each of its main shards after the step
    (`_copy_main_params_to_model_params`): id(main shard) -> its slice of the parameter
    buffer, bf16, or None where the shard is the fp32 weight itself (the copy is onto
    itself). None where `o` is another optimizer or copies otherwise (precision-aware, FSDP,
    fp8 or MXFP8 parameters)."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(o, DistributedOptimizer):
        return None
    out: dict[int, torch.Tensor | None] = {}
    if o.is_stub_optimizer:  # no parameters on this rank: Megatron's step skips it
        return out
    if (o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or o.ddp_config.use_megatron_fsdp
            or o.config.reuse_grad_buf_for_mxfp8_param_ag):
        return None
    for shard_groups, model_groups in ((o.shard_fp32_from_float16_groups, o.model_float16_groups),
                                       (o.shard_fp32_groups, o.model_fp32_groups)):
        for shards, params in zip(shard_groups, model_groups, strict=True):
            for shard, param in zip(shards, params, strict=True):
                gbuf, _, bucket = o.model_param_gbuf_map[param]
                data = o.buffers[gbuf].buckets[bucket].param_data
                if is_float8tensor(param) or data is None:
                    return None
                world = o._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                dst = data.view(-1)[world.start:world.end]
                if dst.data_ptr() == shard.data_ptr():
                    out[id(shard)] = None
                elif dst.dtype == torch.bfloat16:
                    out[id(shard)] = dst
                else:
                    return None
    # every parameter the inner AdamW steps has its destination (its copy is skipped): else Megatron's step
    stepped = {id(p) for g in o.optimizer.param_groups for p in g["params"]}
    return out if stepped == set(out) else None


@contextlib.contextmanager
def _update_writes_weights(subs, copies, scale):
    """Megatron's step_with_ready_grads with each optimizer's inner step swapped for
    adamw.update (which writes the bf16 weights as it steps) and its copy of the main shards
    into the parameter buffer skipped; the rest of Megatron's step (the parameters'
    all-gather, the chained optimizers' order) runs as it is."""
    from miles.train import adamw

    # (torch's optimizer step hooks and its profiler label do not run for the kernel)
    patches = [(o.optimizer, "step", functools.partial(adamw.update, o.optimizer, cp, scale))
               for o, cp in zip(subs, copies, strict=True) if not o.is_stub_optimizer]
    patches += [(o, "_copy_main_params_to_model_params", lambda: None) for o in subs if not o.is_stub_optimizer]
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in patches]  # instance attributes already there
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, before in saved:
            if before is None:
                delattr(obj, name)  # the class's method again
            else:
                setattr(obj, name, before)


@contextlib.contextmanager
def _bf16_moments_by_update(subs):
    """Megatron's own step with each torch AdamW that keeps bf16 moments stepped by
    adamw.update (torch's AdamW takes moments of its weights' dtype only); the rest as it is."""
    from miles.train import adamw

    inner = [o.optimizer for o in subs if isinstance(getattr(o, "optimizer", None), torch.optim.AdamW)
             and adamw.moments_dtype(o.optimizer) != torch.float32]
    saved = [vars(o).get("step") for o in inner]  # an instance attribute already there
    impl = "auto" if torch.cuda.is_available() else "torch"  # not Triton's interpreter on CPU (tests set it)
    for o in inner:
        o.step = functools.partial(adamw.update, o, {}, impl=impl)
    try:
        yield
    finally:
        for o, before in zip(inner, saved, strict=True):
            if before is None:
                del o.step  # the class's method again
            else:
                o.step = before


def step(opt) -> tuple[bool, torch.Tensor | float | None]:
    """Megatron's optimizer step (main gradients prepared, their global norm, clipping, AdamW,
    weights copied back, parameters all-gathered) with nothing read to the host and the
    clipping, AdamW and the copy back as one kernel (miles.train.adamw): the clip's divisor
    reaches it as a device tensor (it divides each gradient as it reads it, instead of a pass
    that scales every gradient in place before it: a read and a write of 4 bytes a parameter,
    ~4 ms of the ~1B step on an H100), it writes the bf16 weights as it updates the fp32 ones
    (instead of Megatron's second read of them), and the norm stays on the device
    (`grad_norm`). The factor is Megatron's, clip / (norm + 1e-6) applied below 1, in float64:
    the divisor is (norm + 1e-6) / clip where the norm exceeds the clip, else 1 (a NaN norm:
    1, no clip, as Megatron; an infinite one: inf, the gradients scaled to 0 as Megatron's
    clip by 0 does). Where an optimizer is not a DistributedOptimizer over torch's AdamW
    switched by `fuse_adam` (CPU: foreach), Megatron's own step.
    Returns (ok, grad_norm) as opt.step()'s first two, the norm a float64 [] tensor on the
    device on the fused path (a float otherwise); the norm is measured with clipping off too
    (Megatron's step measures it only to clip)."""
    subs = getattr(opt, "chained_optimizers", [opt])
    copies = [model_copies(o) for o in subs] if _fused_adams(opt) is not None else [None]
    if any(cp is None for cp in copies):
        with _bf16_moments_by_update(subs):
            ok, norm, _ = opt.step()
        return ok, (opt.get_grad_norm() if ok and opt.config.clip_grad == 0 else norm)
    if opt.prepare_grads():  # inf/NaN found by a loss scaler (fp16): Megatron skips the step
        return False, None
    norm = grad_norm(opt)
    clip = opt.config.clip_grad
    scale = (torch.where(norm + 1.0e-6 > clip, (norm + 1.0e-6) / clip, 1.0).float() if clip > 0 else None)
    with _update_writes_weights(subs, copies, scale):
        ok = opt.step_with_ready_grads()
    return ok, norm
