"""KV-QAT (`model.kv_quant: fp8`, issue 57): K = V's non-RoPE channels rounded as DeepSeek's
runtime caches them (FP8 e4m3, an fp32 scale per token and block of 64 channels), the RoPE
channels untouched, the gradient straight through; the model's plain, compressed and
indexer keys take it in training and in decoding alike."""

from __future__ import annotations

import pytest
import torch

from plugins.deepseek_v4 import ops
from tests.conftest import random_ids, tiny_model


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, in float64."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    return torch.unique(v[torch.isfinite(v)])


def _reference(x: torch.Tensor, rope: int, block: int = 64) -> torch.Tensor:
    """The runtime's rule written out: per token and block, scale = amax / 448 in fp32; each
    value divided by it in fp32, then rounded to the nearest e4m3 value (ties to the even
    mantissa) in float64, times the scale."""
    d = x.shape[-1] - rope
    nope = x[..., :d].float().unflatten(-1, (d // block, block))
    scale = (nope.abs().amax(-1, keepdim=True) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    y = (nope / scale).double()
    grid = _e4m3_grid()
    hi = torch.searchsorted(grid, y.clamp(grid[0], grid[-1])).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    even = {float(v): int(c) % 2 == 0 for c, v in zip(range(256), codes.double().tolist(), strict=True)
            if v == v and abs(v) != float("inf")}
    pick_hi = (y - lo_v > hi_v - y) | ((y - lo_v == hi_v - y) & torch.tensor(
        [even[float(v)] for v in hi_v.flatten().tolist()]).view(hi_v.shape))
    q = torch.where(pick_hi, hi_v, lo_v)
    out = (q.float() * scale).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., d:]), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rounding_is_the_runtimes_rule_and_leaves_rope_channels_alone(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    # V4's K = V: 448 non-RoPE channels (7 blocks of 64) and 64 RoPE ones; blocks of very
    # different magnitudes, a zero block, values on both sides of e4m3's subnormals
    x = torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 2, 8).repeat_interleave(64)
    x[1, 2, 64:128] = 0
    x = x.to(dtype)
    got = ops.fp8_kv_fake_quant(x, 64)
    want = _reference(x, 64)
    assert torch.isfinite(got).all() and got.dtype == dtype
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(got[..., 448:], x[..., 448:]), "the RoPE channels were touched"
    assert not torch.equal(got[..., :448], x[..., :448]), "nothing was rounded"
    assert (got[1, 2, 64:128] == 0).all()
    # a token's bits are its own: the same values quantized alone or in any batch
    assert torch.equal(ops.fp8_kv_fake_quant(x[2:3, 1:2], 64), got[2:3, 1:2])


def test_the_gradient_passes_straight_through(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 96, generator=g, requires_grad=True)
    w = torch.randn(4, 96, generator=g)
    (ops.fp8_kv_fake_quant(x, 32) * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_with_kv_quant_the_engine_caches_rounded_keys_and_decodes_the_forward(seed):
    """Both paths round: every key the full forward attends (K = V, compressed entries) and
    every key the engine caches (window and compressed entries) lies on the FP8 grid of its
    block (rounding it again changes nothing: a path that skipped the rounding would not).
    Decoding then equals the full forward within 1e-5 except where a key within fp32 noise
    of a rounding tie went the other way in one path (one e4m3 step, 1/16 of the value): a
    property of rounding, not of either path (measured over 40 seeds: 11 had such a key, the
    worst logit 3.9e-2 off, the median 5e-7, at most 46% of a run's positions off); so at least a
    quarter agree."""
    from plugins.deepseek_v4.forward import Trace

    model = tiny_model(seed, kv_quant="fp8").eval()
    plain = tiny_model(seed).eval()
    rope = model.config.qk_rope_head_dim
    ids = random_ids(seed, 2, 70)
    trace = Trace(frozenset(range(model.config.num_hidden_layers)), frozenset({"kv", "entries"}))
    with torch.no_grad():
        full = model(ids, trace=trace).logits
        unrounded = plain(ids).logits
        cache = model.new_cache(2, 71)
        model.prefill(list(ids[:, :20]), cache, [0, 1])
        steps = torch.stack([model.decode(ids[:, t], cache, torch.tensor([0, 1])) for t in range(20, 70)], 1)
    assert torch.isfinite(full).all() and torch.isfinite(steps).all()
    assert (full - unrounded).abs().max() > 1e-4, "kv_quant changed nothing"
    for layer, (cap,) in trace.captured.items():
        for name in ("kv", "entries"):
            if name in cap:
                again = ops.fp8_kv_fake_quant(cap[name], rope)
                assert torch.equal(again, cap[name]), f"layer {layer} {name}: unrounded"
    for i, lc in enumerate(cache.layers):
        keys = lc.keys[:2]
        assert torch.equal(ops.fp8_kv_fake_quant(keys, rope), keys), f"layer {i}: the cache holds unrounded keys"
    err = (steps - full[:, 20:]).abs().amax(-1)  # [2, 50]
    assert (err <= 1e-5).float().mean() >= 0.25, f"decode and forward differ beyond rounding ties: {err.max():.2e}"


def test_kv_quant_with_sglang_engines_is_refused():
    """SGLang's engines would serve unrounded keys to a trainer that rounds them."""
    from pathlib import Path

    from miles.config import JobConfigError, load_job

    job = Path(__file__).resolve().parents[1] / "jobs" / "dapo_tiny.yaml"
    with pytest.raises(JobConfigError, match="model.kv_quant: SGLang's engines do not round"):
        load_job(job, ["rollout.engine=sglang", "model.kv_quant=fp8"])
    assert load_job(job, ["model.kv_quant=fp8"]).model.arch.kv_quant == "fp8"
