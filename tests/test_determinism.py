"""Deterministic mode: identical runs are bit-identical; a changed seed is not."""

from __future__ import annotations

import torch
from conftest import TINY_EACH_ONCE

from miles.data.synthetic import progressions
from miles.train import losses
from miles.train.batching import MicroBatch
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.checksum import named_md5, tensor_md5
from plugins.deepseek_v4.determinism import disable_deterministic, enable_deterministic

CUDA = torch.cuda.is_available()


def _run(seed: int, kernels: str = "torch", rows: int = 2, steps: int = 2, seq: int = 36,
         **overrides) -> list[tuple[str, str]]:
    """Loss bits and a checksum of every gradient, per step (bf16 on a GPU)."""
    enable_deterministic(seed)
    try:
        cfg = DeepSeekV4Config.tiny(kernels=kernels, **overrides)
        dev, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
        model = DeepSeekV4ForCausalLM(cfg, seed=seed, dtype=dtype).to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for step in range(steps):
            ids = progressions(rows, seq + 1, cfg.vocab_size, seed=seed + step).to(dev)
            loss = losses.compute(model, MicroBatch.lm(ids[:, :-1], ids[:, 1:].contiguous()))[1].loss
            opt.zero_grad()
            loss.backward()
            out.append((tensor_md5(loss.detach()), named_md5(sorted((k, p.grad) for k, p in model.named_parameters()))))
            opt.step()
            model.update_router_bias()
        return out
    finally:
        disable_deterministic()


def test_identical_runs_are_bitwise_equal_and_seed_changes_them():
    """Guards nondeterminism (atomics, unseeded init, order-dependent reductions): two runs
    with one seed match bit for bit at every step; another seed differs from step 1."""
    a, b, c = _run(11), _run(11), _run(12)
    assert a == b
    assert a[0] != c[0]


def test_deterministic_mode_on_the_kernel_path():
    """The same on the Triton kernels (the attention backward's per-split kv gradient summed in
    order instead of atomics; Sinkhorn; grouped expert GEMMs): Triton's interpreter on CPU
    (one row of 20 tokens, one step: the interpreter is slow; 20 still crosses the sliding
    window and an HCA block of 16), bf16 on a GPU. Two runs are bit-identical,
    and the kernels really ran (their gradient bits differ from the torch path's: other
    summation orders)."""
    shape = (2, 2, 36) if CUDA else (1, 1, 20)  # rows, steps, tokens
    small = {} if CUDA else TINY_EACH_ONCE  # each attention kind once: the interpreter pays per block
    a, b = _run(21, "triton", *shape, **small), _run(21, "triton", *shape, **small)
    assert a == b
    assert a[0][1] != _run(21, "torch", *shape, **small)[0][1], "the kernel path did not run"


def test_init_is_independent_of_dtype_and_construction():
    """Seeded init draws each tensor from its own name: a bf16 model is the fp32 model
    rounded, and rebuilding gives the same bits."""
    cfg = DeepSeekV4Config.tiny()
    m1, m2 = DeepSeekV4ForCausalLM(cfg, seed=5), DeepSeekV4ForCausalLM(cfg, seed=5)
    mb = DeepSeekV4ForCausalLM(cfg, seed=5, dtype=torch.bfloat16)
    for (k, v), v2, vb in zip(m1.state_dict().items(), m2.state_dict().values(), mb.state_dict().values(),
                              strict=True):
        assert torch.equal(v, v2), k
        assert torch.equal(v.to(vb.dtype), vb), k
    assert not torch.equal(m1.embed.weight, DeepSeekV4ForCausalLM(cfg, seed=6).embed.weight)
