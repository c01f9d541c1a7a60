"""KV-QAT (`model.kv_quant: fp8`, issue 57): K = V's non-RoPE channels rounded as DeepSeek's
runtime caches them (FP8 e4m3, an fp32 scale per token and block of 64 channels), the RoPE
channels untouched, the gradient straight through; the model's plain, compressed and
indexer keys take it in training and in decoding alike."""

from __future__ import annotations

import copy

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
        keys = lc.keys.get((slice(0, 2),))
        assert torch.equal(ops.fp8_kv_fake_quant(keys, rope), keys), f"layer {i}: the cache holds unrounded keys"
    err = (steps - full[:, 20:]).abs().amax(-1)  # [2, 50]
    assert (err <= 1e-5).float().mean() >= 0.25, f"decode and forward differ beyond rounding ties: {err.max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_then_dequantize_is_the_rounding_and_a_rounded_row_keeps_its_codes(seed, dtype):
    """What an FP8 cache stores (fp8_kv_quant) and gives back (fp8_kv_dequant) is the
    training forward's rounding bit for bit; a row rounded once and quantized again (what the
    engine's cache is handed) keeps its codes, its scale within an ulp."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 9, 512, generator=g) * torch.logspace(-3, 2, 8).repeat_interleave(64)).to(dtype)
    codes, scales = ops.fp8_kv_quant(x, 64)
    assert codes.dtype == torch.uint8 and codes.shape == (4, 9, 448) and scales.shape == (4, 9, 7)
    back = torch.cat((ops.fp8_kv_dequant(codes, scales, dtype), x[..., 448:]), -1)
    assert torch.equal(back, ops.fp8_kv_fake_quant(x, 64))
    again, scales2 = ops.fp8_kv_quant(back, 64)
    assert torch.equal(again, codes), "a rounded row's codes changed"
    assert torch.allclose(scales2, scales, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_the_engines_fp8_cache_stores_codes_and_scales_and_decodes_as_the_rounded_cache(seed):
    """model.kv_quant: fp8 makes the engine's key pool FP8 codes with fp32 scales per block of
    64 and the RoPE channels in the model's dtype (kv_pool.Fp8KeyPool): at V4-Flash's K = V
    (448 + 64 channels) 604 bytes a row against 1,024 in bf16; the indexer's entries likewise
    (their RoPE channels fp32). The tiny model decodes with it as
    with the same rounded keys held in the model's dtype (1e-5: a rewritten scale is within an
    ulp), and n samples of one prompt copy its codes. (The kernels' path, the chosen rows
    gathered and dequantized for the sparse-attention kernel: the next test here, and on a GPU
    tests/gpu/test_engine_gpu.py.)"""
    from plugins.deepseek_v4.kv_pool import Fp8KeyPool, KeyPool

    pool = Fp8KeyPool.zeros(2, 8, 512, 64, torch.bfloat16, "cpu")
    row = sum(t[0, 0].numel() * t.element_size() for t in pool.tensors())
    assert row == 604 and KeyPool.zeros(2, 8, 512, torch.bfloat16, "cpu").t[0, 0].numel() * 2 == 1024

    model = tiny_model(seed, kv_quant="fp8").eval()
    end = 36  # past the window (16) and two HCA blocks (16)
    ids = random_ids(seed, 3, end)
    with torch.no_grad():
        cache = model.new_cache(4, end + 1)
        assert all(isinstance(lc.keys, Fp8KeyPool) for lc in cache.layers)
        assert all(lc.comp.entries.codes.data_ptr() == lc.keys.codes[:, model.config.sliding_window:].data_ptr()
                   for lc in cache.layers if lc.comp is not None), "compressed entries outside the key pool"
        assert all(isinstance(lc.idx.entries, Fp8KeyPool) for lc in cache.layers if lc.idx is not None)
        plain = model.new_cache(4, end + 1)
        for lc in plain.layers:  # the same pools as the model's dtype: the rounded values as they are
            lc.keys = KeyPool(lc.keys.get((slice(None),)))
            if lc.comp is not None:
                lc.comp.entries = lc.keys.positions(model.config.sliding_window)
            if lc.idx is not None:  # the indexer's entries, fp32
                lc.idx.entries = KeyPool(lc.idx.entries.get((slice(None),)))
        out = {}
        for name, c in (("fp8", cache), ("plain", plain)):
            model.prefill(list(ids[:2, :15]), c, [0, 1])
            c.copy_slots([1], [3])  # a second sample of prompt 1
            assert all(torch.equal(t[3], t[1]) for t in c.tensors()[1:]), "a copied slot lacks some state"
            out[name] = torch.stack([model.decode(ids[[0, 1, 1], t], c, torch.tensor([0, 1, 3]))
                                     for t in range(15, end)], 1)
    assert torch.isfinite(out["fp8"]).all() and torch.isfinite(out["plain"]).all()
    err = (out["fp8"] - out["plain"]).abs().max()
    assert err <= 1e-5, f"the FP8 cache decodes otherwise than the rounded keys: {err:.2e}"
    assert (out["fp8"][1] - out["fp8"][2]).abs().max() <= 1e-5, "a copied slot decodes otherwise"
    layer = cache.layers[0].keys
    stored = layer.get((slice(0, 2),))
    assert torch.equal(ops.fp8_kv_fake_quant(stored, model.config.qk_rope_head_dim), stored)
    assert layer.codes.any() and layer.scales.gt(0).any(), "nothing was stored"


def test_on_the_kernel_path_the_fp8_pool_is_read_in_place_and_attends_as_the_rounded_keys(seed, monkeypatch):
    """With kernels on (Triton's interpreter here), a decoding attention step reads the FP8
    pool's codes, scales and RoPE channels in place (kernels.sparse_attention.sparse_attention_fp8,
    every layer, every step) and gives what the reference path gives over the same rounded keys
    held in the model's dtype (1e-5): every layer kind (SWA, CSA with its indexer, HCA), two rows
    at different positions, past the window's end and across compressed blocks; a wrong row,
    scale or decoded code would not. (Only the attention runs in the interpreter: the whole
    model's decode there takes ~10 s a step.)"""
    from plugins.deepseek_v4.forward import Rope
    from plugins.deepseek_v4.kernels import sparse_attention as sa
    from plugins.deepseek_v4.kv_pool import KeyPool

    calls = []
    real = sa.sparse_attention_fp8
    monkeypatch.setattr(sa, "sparse_attention_fp8", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    model = tiny_model(seed, kv_quant="fp8", kernels="torch").eval()
    cfg = model.config
    ids = random_ids(seed, 2, 22)
    starts, steps = (16, 11), 5
    slots = torch.tensor([0, 1])
    ropes = {"swa": Rope(model.inv_freq_swa, None, None), "compressed": Rope(model.inv_freq_compressed, None, None)}
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        fp8 = model.new_cache(2, 22)
        model.prefill([ids[0, :starts[0]], ids[1, :starts[1]]], fp8, [0, 1])
        plain = copy.deepcopy(fp8)
        for lc in plain.layers:  # the same rows, dequantized, in pools of the model's dtype
            lc.keys = KeyPool(lc.keys.get((slice(None),)))
            if lc.comp is not None:
                lc.comp.entries = lc.keys.positions(cfg.sliding_window)
            if lc.idx is not None:
                lc.idx.entries = KeyPool(lc.idx.entries.get((slice(None),)))
        for k in range(steps):
            pos = torch.tensor(starts) + k
            for i, (layer, a, b) in enumerate(zip(model.layers, fp8.layers, plain.layers, strict=True)):
                x = torch.randn(2, 1, cfg.hidden_size, generator=g)
                monkeypatch.setattr(cfg, "kernels", "triton")
                got = layer.attn.step(x, a, slots, pos, ropes)
                monkeypatch.setattr(cfg, "kernels", "torch")
                want = layer.attn.step(x, b, slots, pos, ropes)
                assert torch.isfinite(got).all() and torch.isfinite(want).all()
                err = (got - want).abs().max()
                assert err <= 1e-5, f"step {k} layer {i}: the FP8 kernel attends otherwise: {err:.2e}"
    assert len(calls) == steps * cfg.num_hidden_layers and set(calls) == {torch.uint8}, calls


def test_kv_quant_with_sglang_engines_is_refused():
    """SGLang's engines would serve unrounded keys to a trainer that rounds them."""
    from pathlib import Path

    from miles.config import JobConfigError, load_job

    job = Path(__file__).resolve().parents[1] / "jobs" / "dapo_tiny.yaml"
    with pytest.raises(JobConfigError, match="model.kv_quant: SGLang's engines do not round"):
        load_job(job, ["rollout.engine=sglang", "model.kv_quant=fp8"])
    assert load_job(job, ["model.kv_quant=fp8"]).model.arch.kv_quant == "fp8"
