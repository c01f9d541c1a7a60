"""AdamW that also writes the bf16 model weights: one Triton kernel over an optimizer's fp32
parameters in place of torch's fused AdamW followed by a copy of each into its bf16 weight
(Megatron's DistributedOptimizer copies every main shard into its parameter buffer after the
step: a second read of the fp32 weights and 78 more launches for the ~1B config).

Per element the kernel reads the fp32 weight, the gradient and both moments and writes the
weight, the moments and the bf16 weight: 30 bytes, where fused AdamW with the clip's
grad_scale (which stores the scaled gradient back) and the copy move 38. The update is torch's
fused AdamW's (ADAMW mode: decoupled decay, eps outside the square root, bias corrections from
each tensor's own device step count), computed at least as exactly: the clip (a float64
reciprocal), the decay and the moments in float64 rounded to fp32, the step in fp32 with
correctly rounded division and square root, eps added in float64. (On an H100 torch's
weights land up to ~2.4 fp32 rounding bounds from float64 AdamW where these stay within one,
and most of its moments differ from these in the last bit: tests/test_kernels.py.) The tensors
are separate allocations, so each program reads their addresses from its row of a table, built
once per set of tensors.

Moments kept in bf16 (`set_moments`, a job's train.optim.moments; DeepSeek-V3's recipe): each
step widens them to fp32, computes as above, updates the weight from the fp32 moments and
keeps them rounded to nearest even in bf16 (22 bytes an element). The oracle does the same
around torch's fused AdamW.

`update` runs the kernel where Triton can run (CUDA, or its interpreter under
TRITON_INTERPRET=1), else `impl="torch"`: torch's fused AdamW, then the copies (the oracle).
"""

from __future__ import annotations

import weakref

import torch

# a program updates ITERS x BLOCK elements, BLOCK at a time (tuned: benchmarks/adamw_gpu.py)
BLOCK, ITERS, WARPS = 512, 4, 4
# each optimizer's kernel table (dropped with the optimizer): (key, table, aligned)
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def triton_runs(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device` (a GPU's, or the CPU's under Triton's
    interpreter)."""
    from plugins.deepseek_v4 import kernels

    return kernels.available() and (device.type == "cuda") != kernels.INTERPRET


MOMENTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def set_moments(opt: torch.optim.AdamW, dtype: str) -> None:
    """Keep opt's moments in `dtype` ("float32" or "bfloat16"): those made from now on, and
    those there now or loaded later, converted at their next step or load (widening is exact)."""
    if dtype not in MOMENTS:
        raise ValueError(f"miles.train.adamw: moments must be one of {sorted(MOMENTS)}, not {dtype!r}")
    opt.defaults["moments"] = dtype


def moments_dtype(opt: torch.optim.Optimizer) -> torch.dtype:
    """The dtype opt keeps its moments in (set_moments; fp32 unless set)."""
    return MOMENTS[opt.defaults.get("moments", "float32")]


def conform_moments(opt: torch.optim.Optimizer) -> None:
    """Every moment opt holds in moments_dtype(opt): those made or loaded in the other dtype
    (torch's load_state_dict makes them the weights' dtype) converted now."""
    dtype = moments_dtype(opt)
    for st in opt.state.values():
        _conform(st, dtype)


def _conform(st: dict, dtype: torch.dtype) -> None:
    for name in ("exp_avg", "exp_avg_sq"):
        t = st.get(name)
        if t is not None and t.dtype in MOMENTS.values() and t.dtype != dtype:
            st[name] = t.to(dtype)


def _check(opt: torch.optim.AdamW, outs: dict[int, torch.Tensor | None]) -> list[list[torch.Tensor]]:
    """Each group's parameters that have a gradient; a clear error for what the kernel does not do."""
    groups = []
    for i, group in enumerate(opt.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"miles.train.adamw: param group {i} sets {flag}, which this AdamW does not do")
        if torch.is_tensor(group["lr"]):
            raise ValueError(f"miles.train.adamw: param group {i} has a tensor lr; give a float")
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            out = outs.get(id(p))
            if p.dtype != torch.float32 or p.grad.dtype != torch.float32 or not p.is_contiguous() \
                    or not p.grad.is_contiguous():
                raise ValueError(f"miles.train.adamw: group {i} holds a {p.dtype} weight {list(p.shape)} with a "
                                 f"{p.grad.dtype} gradient; both must be contiguous fp32")
            if out is not None and (out.dtype != torch.bfloat16 or out.numel() != p.numel()
                                    or not out.is_contiguous() or out.device != p.device):
                raise ValueError(f"miles.train.adamw: the bf16 copy of a weight {list(p.shape)} in group {i} is "
                                 f"{out.dtype} {list(out.shape)} on {out.device}; it must be contiguous bf16 "
                                 f"with the weight's size and device")
        groups.append(params)
    return groups


def _state(opt: torch.optim.AdamW, p: torch.Tensor) -> dict:
    """p's AdamW state as torch's fused AdamW keeps it (created on the first step, as torch
    does), its moments in moments_dtype(opt)."""
    st, dtype = opt.state[p], moments_dtype(opt)
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    missing = {"step", "exp_avg", "exp_avg_sq"} - set(st)
    if missing:
        raise ValueError(f"miles.train.adamw: the AdamW state of a weight {list(p.shape)} lacks {sorted(missing)}")
    if not torch.is_tensor(st["step"]) or st["step"].dtype != torch.float32 or st["step"].device != p.device:
        st["step"] = torch.as_tensor(st["step"]).to(p.device, torch.float32)  # the kernel reads it as fp32
    _conform(st, dtype)
    for name in ("exp_avg", "exp_avg_sq"):
        t = st[name]
        if t.dtype != dtype or t.shape != p.shape or t.device != p.device or not t.is_contiguous():
            raise ValueError(f"miles.train.adamw: {name} of a weight {list(p.shape)} is {t.dtype} {list(t.shape)} "
                             f"on {t.device}; it must be contiguous {dtype} with the weight's shape and device")
    return st


@torch.no_grad()
def update(opt: torch.optim.AdamW, outs: dict[int, torch.Tensor | None], grad_scale: torch.Tensor | None = None,
           impl: str = "auto") -> None:
    """One AdamW step of `opt` (its groups' lr, weight decay, betas and eps as they are now) over
    the parameters that have a gradient, each then written in bf16 to outs[id(param)] where
    one is given. `grad_scale` (a float32 [] tensor on the device, or None) divides every
    gradient, as torch's fused AdamW's grad_scale does; the gradients are left as they were.
    impl: "triton", "torch" (torch's fused AdamW and the copies), or "auto" (Triton where it runs)."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"miles.train.adamw: impl must be auto, triton or torch, not {impl!r}")
    groups = _check(opt, outs)
    flat = [(p, gi) for gi, ps in enumerate(groups) for p in ps]
    if not flat:
        return
    states = [_state(opt, p) for p, _ in flat]
    torch._foreach_add_([st["step"] for st in states], 1)  # as torch's AdamW: the step counts first
    if impl == "auto":
        impl = "triton" if triton_runs(flat[0][0].device) else "torch"
    if impl == "torch":
        for gi, ps in enumerate(groups):
            if not ps:
                continue
            g, sts = opt.param_groups[gi], [opt.state[p] for p in ps]
            beta1, beta2 = g["betas"]
            kept = [st[name] for st in sts for name in ("exp_avg", "exp_avg_sq")]
            wide = [t.float() for t in kept]  # the fp32 moments themselves, or fp32 copies of bf16 ones
            torch._fused_adamw_(ps, [p.grad.clone() if grad_scale is not None else p.grad for p in ps],
                                wide[0::2], wide[1::2], [], [st["step"] for st in sts], lr=g["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=False,
                                maximize=False, grad_scale=grad_scale, found_inf=None)
            for t, w in zip(kept, wide, strict=True):
                if t is not w:
                    t.copy_(w)  # rounded to nearest even
            for p in ps:
                if outs.get(id(p)) is not None:
                    outs[id(p)].copy_(p)
        return
    device = flat[0][0].device
    blocks, aligned = _table(opt, flat, states, outs, device)
    hyper = torch.tensor([[g["lr"], g["weight_decay"], *g["betas"], g["eps"]] for g in opt.param_groups],
                         dtype=torch.float64)
    from miles.memory import to_device

    hyper = to_device(hyper, device)  # pinned: the host does not wait for the GPU here
    scale = grad_scale if grad_scale is not None else hyper  # any pointer; unread without HAS_SCALE
    _launch(blocks, hyper, scale, grad_scale is not None, aligned, moments_dtype(opt) == torch.bfloat16)


def _table(opt, flat, states, outs, device) -> tuple[torch.Tensor, bool]:
    """The kernel's table for these tensors, a row a program, on the device: [B, 9] int64
    (numel, the addresses of weight, gradient, exp_avg, exp_avg_sq, step count and bf16 copy
    (0: none), the group, the program's first element); and whether every address is 16-byte
    aligned (the kernel's vector loads). Each row holds all a program needs, so a program
    waits on one load before it reads its elements (a row per tensor, indexed by a row per
    program, was ~20% slower on an H200). Kept with the optimizer while its tensors stay where they are
    (a load may replace its state)."""
    entries = []
    for (p, gi), st in zip(flat, states, strict=True):
        out = outs.get(id(p))
        entries.append((p.numel(), p.data_ptr(), p.grad.data_ptr(), st["exp_avg"].data_ptr(),
                        st["exp_avg_sq"].data_ptr(), st["step"].data_ptr(), 0 if out is None else out.data_ptr(), gi))
    span = BLOCK * ITERS  # elements a program updates
    key = (str(device), span, tuple(entries))
    cached = _tables.get(opt)
    if cached is None or cached[0] != key:
        rows = torch.tensor(entries, dtype=torch.int64)  # [N, 8]
        per = (rows[:, 0] + span - 1) // span  # programs of each tensor
        tensor = torch.repeat_interleave(torch.arange(len(entries)), per)  # [B]
        start = (torch.arange(len(tensor)) - (torch.cumsum(per, 0) - per)[tensor]) * span
        aligned = all(a % 16 == 0 for e in entries for a in e[1:5]) and all(e[6] % 16 == 0 for e in entries)
        cached = _tables[opt] = (key, torch.cat([rows[tensor], start[:, None]], 1).to(device), aligned)
    return cached[1:]


def _launch(blocks, hyper, scale, has_scale: bool, aligned: bool, bf16_moments: bool) -> None:
    from miles.train.adamw_kernel import adamw_kernel

    adamw_kernel[(blocks.shape[0],)](blocks, hyper, scale, HAS_SCALE=has_scale, ALIGNED=aligned,
                                     BF16_MOMENTS=bf16_moments, BLOCK=BLOCK, ITERS=ITERS, num_warps=WARPS)
