"""Megatron-core on CPU: the one place that bridges its CUDA assumptions.

Megatron-core (pinned below) hard-codes CUDA in places that are not about GPUs at all:
buffers allocated on `torch.cuda.current_device()`, `torch.cuda.synchronize()` around
communication, the model-parallel RNG tracker built on `torch.cuda.get_rng_state`.
`apply()` redirects exactly those calls to their CPU equivalents, only when CUDA is
absent, and refuses any other Megatron-core version (its CUDA call sites move between
releases, so an unchecked version could silently take a different path). On a GPU
machine `apply()` does nothing. No other module patches anything (megatron_import swaps
`torch.compile` only while megatron.core imports).
"""

from __future__ import annotations

import torch

PINNED_MEGATRON_CORE = "0.16.1"
_applied = False


class MegatronVersionError(RuntimeError):
    pass


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _noop(*_args, **_kwargs) -> None:
    return None


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "zeros_like", "empty_like",
              "ones_like", "full_like")


def _is_cuda(device) -> bool:
    return device is not None and (device == "cuda" or str(device).startswith("cuda") or isinstance(device, int))


def _serve_on_cpu(fn):
    """Without CUDA a request for a CUDA tensor can only raise; serve it on the CPU instead."""
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


def apply() -> bool:
    """Make Megatron-core usable on CPU (gloo). Returns True when the bridge is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version != PINNED_MEGATRON_CORE:
        raise MegatronVersionError(f"miles' CPU bridge was written for megatron-core {PINNED_MEGATRON_CORE}, "
                                   f"found {version}: pin megatron-core=={PINNED_MEGATRON_CORE}")
    if _applied:
        return True
    # Buffers, staging tensors and p2p receive buffers are allocated on current_device() or
    # on a literal device="cuda"; .cuda() moves optimizer state.
    torch.cuda.current_device = _cpu_device
    for name in _FACTORIES:
        setattr(torch, name, _serve_on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    # Optimizers accept parameters by their CUDA type names ("torch.cuda.FloatTensor").
    plain_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        name = plain_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name

    torch.Tensor.type = cuda_type_name
    # Synchronisation points around collectives and timers: nothing to wait for on CPU.
    torch.cuda.synchronize = _noop
    # The model-parallel RNG tracker keeps CUDA generator states; use the CPU generator.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _applied = True
    return True
