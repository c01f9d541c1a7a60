"""Import megatron.core with its fused functions compiled when first called, not when imported.

Megatron-core decorates ~40 functions with `jit_fuser`, which is `torch.compile`; decorating
imports Dynamo and Inductor, ~2 s of CPU in every process that imports megatron.core (each
training actor, each test worker) though miles' model calls none of them on most layouts.
While megatron.core imports, `torch.compile` here returns a wrapper that calls the real
`torch.compile` on the function's first call: torch.compile itself compiles only on the first
call, so what runs, and when it compiles, is unchanged. megatron.core.jit.jit_fuser stays the
wrapper for the process (modules imported later, and per-instance uses, get it too). Every
module that imports megatron.core imports this module first; it must be the first to import
megatron.core in the process.
"""

from __future__ import annotations

import functools
import sys

import torch


def _compile_on_first_call(real):
    def compile(model=None, **options):  # noqa: A001 (torch.compile's signature)
        if model is None:  # @torch.compile(**options)
            return lambda f: compile(f, **options)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile


if "megatron.core" not in sys.modules:
    _real = torch.compile
    torch.compile = _compile_on_first_call(_real)
    try:
        import megatron.core  # noqa: F401
        import megatron.core.jit  # noqa: F401  (binds jit_fuser to the wrapper)
    finally:
        torch.compile = _real
