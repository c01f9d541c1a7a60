"""Megatron-core on GPU without Transformer Engine or apex: the one place that bridges it.

Without either library Megatron-core 0.16.1 falls back to torch's AdamW in its foreach
form and to Python loops for the gradient norm and the clipping scale: the norm turns
every gradient's norm into a Python float (one host sync per tensor, ~1,000 a step for
the ~1B config) and the scale is one launch per tensor. `apply()` swaps those two
fallbacks for torch's multi-tensor ops (`_foreach_norm`, `_foreach_mul_`), and
`fuse_adam(opt)` switches the optimizer's AdamW to torch's fused CUDA kernel (called
after the optimizer is built and after its state is loaded). Both do
nothing where TE or apex is installed (Megatron then uses theirs) or CUDA is absent
(megatron_cpu covers CPU). No other module patches Megatron-core on GPU.
"""

from __future__ import annotations

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


def fuse_adam(opt) -> int:
    """Switch every torch AdamW inside a Megatron optimizer (chained or not) to the fused
    CUDA implementation (one kernel for all parameters of a group, in place of foreach).
    Returns the number of parameter groups switched."""
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
