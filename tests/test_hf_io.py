"""Tests for plugins.deepseek_v4.hf_io: sharded safetensors I/O and FP8/FP4 dequantization."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plugins.deepseek_v4 import hf_io
from plugins.deepseek_v4.checksum import tensor_md5
from plugins.deepseek_v4.hf_io import (
    FP32_NAMES_SUFFIXES,
    dequantize_fp4,
    dequantize_fp8_block,
    load_safetensors_dir,
    quantize_fp4_experts,
    quantize_fp8_block,
    save_safetensors_shards,
)


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    """On conftest's seed (printed; MILES_TEST_SEED=<it> replays a failure)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _spread_magnitudes(gen: torch.Generator, w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Multiply row/column bands by random powers of ten so that blocks need different scales."""
    r = 10.0 ** torch.randint(-3, 3, (math.ceil(w.shape[0] / rows), 1), generator=gen).float()
    c = 10.0 ** torch.randint(-2, 2, (1, math.ceil(w.shape[1] / cols)), generator=gen).float()
    f = r.repeat_interleave(rows, 0)[: w.shape[0]] * c.repeat_interleave(cols, 1)[:, : w.shape[1]]
    return w * f


def _index(directory) -> dict:
    return json.loads((directory / hf_io.INDEX_FILE).read_text())


def _rewrite_index(directory, index: dict) -> None:
    (directory / hf_io.INDEX_FILE).write_text(json.dumps(index))


# ----------------------------------------------------------------------------------------------------------
# tensor_md5


def test_tensor_md5_is_md5_of_raw_bytes():
    """Guards against tensor_md5 hashing something other than the raw little-endian bytes (e.g. a repr, or
    failing on 0-dim / float8 / bfloat16 / empty tensors)."""
    assert tensor_md5(torch.tensor(1.0)) == hashlib.md5(struct.pack("<f", 1.0)).hexdigest()
    assert (
        tensor_md5(torch.tensor([1, -2], dtype=torch.int64))
        == hashlib.md5(struct.pack("<2q", 1, -2)).hexdigest()
    )
    bf = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # bf16 = top half of the fp32 bits
    assert tensor_md5(bf) == hashlib.md5(bytes([0x80, 0x3F, 0x00, 0xC0])).hexdigest()
    f8 = torch.tensor([1.0, 448.0]).to(torch.float8_e4m3fn)
    assert tensor_md5(f8) == hashlib.md5(bytes([0x38, 0x7E])).hexdigest()
    e8 = torch.tensor([1.0, 0.5]).to(torch.float8_e8m0fnu)
    assert tensor_md5(e8) == hashlib.md5(bytes([127, 126])).hexdigest()
    assert tensor_md5(torch.zeros(0, 3)) == hashlib.md5(b"").hexdigest()
    # non-contiguous input hashes as its contiguous copy
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert tensor_md5(t.t()) == tensor_md5(t.t().contiguous())


# ----------------------------------------------------------------------------------------------------------
# round trip


def test_round_trip_many_shards_byte_identical(tmp_path, gen):
    """Guards against lossy/duplicated/missing tensors when sharding: dtype changes, a tensor written to two
    shards or none, shared storage breaking safetensors, a 0-dim tensor being dropped, a wrong index."""
    base = _randn(gen, 41, 23)
    sd = {
        "embed.weight": _randn(gen, 97, 31, dtype=torch.bfloat16),
        "layers.0.attn.wq_a.weight": _randn(gen, 53, 37),
        "layers.0.attn.attn_sink": _randn(gen, 7),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 1000, (129, 3), generator=gen, dtype=torch.int64),
        "layers.0.ffn.gate.bias": _randn(gen, 13, dtype=torch.float16),
        "layers.3.ffn.experts.2.w1.weight": _randn(gen, 29, 61, dtype=torch.bfloat16),
        "mtp.0.e_proj.weight": base,
        "mtp.0.h_proj.weight": base[3:17, 2:9],  # a non-contiguous view sharing storage with base
        "head.weight": base,  # the very same tensor twice (tied weights)
        "scalar": torch.tensor(3.25),
        "flags": torch.rand(19, generator=gen) > 0.5,
    }
    for t in sd.values():
        if t.is_floating_point():
            assert torch.isfinite(t).all()
    limit = 4096
    files = save_safetensors_shards(sd, tmp_path, max_shard_bytes=limit)
    assert len(files) >= 3, files
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # only shards and the index, no temporary files left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, hf_io.INDEX_FILE])

    # every name exactly once in the raw JSON text, and weight_map covers exactly the state dict
    pairs = json.loads((tmp_path / hf_io.INDEX_FILE).read_text(), object_pairs_hook=lambda kv: kv)
    index = dict(pairs)
    wm_pairs = index["weight_map"]
    names = [k for k, _ in wm_pairs]
    assert sorted(names) == sorted(sd) and len(names) == len(set(names))
    wm = dict(wm_pairs)
    assert set(wm.values()) == set(files)
    total = dict(index["metadata"])["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in sd.values())

    # each shard holds exactly what the index says, each within the limit unless it is a single tensor
    for f in files:
        with safe_open(str(tmp_path / f), framework="pt") as h:
            keys = set(h.keys())
            assert keys == {k for k, v in wm.items() if v == f}
            size = sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in keys)
            assert size <= limit or len(keys) == 1
    # sorted name order, greedy packing: the files' name ranges do not interleave
    order = [wm[k] for k in sorted(sd)]
    assert order == sorted(order)

    loaded = load_safetensors_dir(tmp_path)
    assert set(loaded) == set(sd)
    for k, t in sd.items():
        assert loaded[k].dtype == t.dtype, k
        assert loaded[k].shape == t.shape, k
        assert tensor_md5(loaded[k]) == tensor_md5(t), k
    assert loaded["scalar"].dim() == 0

    # the same tied / overlapping tensors in one shard (safetensors refuses shared storage in one file)
    one = {"a": base, "b": base, "c": base[3:17], "d": base[5]}
    assert save_safetensors_shards(one, tmp_path / "one") == ["model-00001-of-00001.safetensors"]
    back = load_safetensors_dir(tmp_path / "one")
    assert {k: tensor_md5(v) for k, v in back.items()} == {k: tensor_md5(v) for k, v in one.items()}


def test_single_shard_still_writes_index_and_single_file_loads(tmp_path, gen):
    """Guards against skipping the index for one shard, and against not reading a lone model.safetensors."""
    sd = {"a.weight": _randn(gen, 5, 3), "b": torch.arange(4)}
    files = save_safetensors_shards(sd, tmp_path / "sharded")
    assert files == ["model-00001-of-00001.safetensors"]
    assert _index(tmp_path / "sharded")["weight_map"] == dict.fromkeys(sd, files[0])

    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"))
    loaded = load_safetensors_dir(single)
    assert {k: tensor_md5(v) for k, v in loaded.items()} == {k: tensor_md5(v) for k, v in sd.items()}

    with pytest.raises(FileNotFoundError):
        load_safetensors_dir(tmp_path / "nothing-here")


# ----------------------------------------------------------------------------------------------------------
# FP8


def _fp8_reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-by-block slicing reference, written independently of the module's repeat_interleave."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rs = slice(bi * block[0], (bi + 1) * block[0])
            cs = slice(bj * block[1], (bj + 1) * block[1])
            # the e8m0 byte is a biased exponent
            factor = 2.0 ** (int(s[bi, bj].view(torch.uint8)) - 127)
            out[rs, cs] = q[rs, cs].float() * factor
    return out


def test_fp8_block_round_trip(tmp_path, gen):
    """Guards against wrong FP8 block dequantization: scale applied to the wrong block, edge blocks not
    cropped, scale not a power of two / not e8m0 in the file, or quantization error beyond fp8 precision."""
    w = _spread_magnitudes(gen, _randn(gen, 300, 200), 128, 128)
    w[256:, 128:] = 0.0  # an all-zero (edge) block gets scale 1
    assert torch.isfinite(w).all()
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    assert float(s[2, 1].float()) == 1.0

    save_safetensors_shards({"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": s}, tmp_path)
    with safe_open(str(tmp_path / "model-00001-of-00001.safetensors"), framework="pt") as h:
        assert h.get_tensor("layers.0.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
        assert h.get_tensor("layers.0.attn.wq_a.weight").dtype == torch.float8_e4m3fn
    loaded = load_safetensors_dir(tmp_path)
    assert set(loaded) == {"layers.0.attn.wq_a.weight"}
    got = loaded["layers.0.attn.wq_a.weight"]
    assert got.dtype == torch.float32 and got.shape == (300, 200)

    ref = _fp8_reference(q, s, (128, 128))
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert torch.equal(got, ref)
    assert torch.equal(dequantize_fp8_block(q, s, (128, 128)), ref)

    # per block: the scale is the tightest power of two, and the error is within fp8 precision
    for bi in range(3):
        for bj in range(2):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            amax = w[blk].abs().max().item()
            sc = s[bi, bj].float().item()
            assert math.log2(sc) == round(math.log2(sc))
            if amax == 0:
                assert got[blk].abs().max().item() == 0.0
                continue
            assert amax / sc <= 448.0 and amax / sc > 224.0
            rel = ((got[blk] - w[blk]).abs().max() / amax).item()
            assert rel <= 2**-3, (bi, bj, rel)
            # fp8 e4m3 has 3 mantissa bits: every element is within 2**-4 of itself (or below the min normal)
            err = (got[blk] - w[blk]).abs()
            assert (err <= w[blk].abs() * 2**-4 + sc * 2**-9).all()


def test_fp8_block_size_from_config(tmp_path, gen):
    """Guards against ignoring quantization_config.weight_block_size in config.json."""
    w = _randn(gen, 70, 45)
    assert torch.isfinite(w).all()
    q, s = quantize_fp8_block(w, block=(64, 16))
    assert s.shape == (2, 3)
    sd = {"layers.2.attn.wo_b.weight": q, "layers.2.attn.wo_b.scale": s}
    save_safetensors_shards(sd, tmp_path)
    # without config the default 128x128 block does not fit this scale: a clear error
    with pytest.raises(ValueError, match="layers.2.attn.wo_b"):
        load_safetensors_dir(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"weight_block_size": [64, 16]}})
    )
    got = load_safetensors_dir(tmp_path)["layers.2.attn.wo_b.weight"]
    ref = _fp8_reference(q, s, (64, 16))
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert torch.equal(got, ref)


def test_fp8_float32_scale_accepted(tmp_path, gen):
    """Guards against only accepting e8m0 scales (float32 scales must work the same)."""
    w = _randn(gen, 130, 129)
    q, s = quantize_fp8_block(w)
    sd = {"x.weight": q, "x.scale": s.float()}
    save_safetensors_shards(sd, tmp_path)
    got = load_safetensors_dir(tmp_path)["x.weight"]
    ref = _fp8_reference(q, s, (128, 128))
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert torch.equal(got, ref)


# ----------------------------------------------------------------------------------------------------------
# FP4


def _e2m1_value(code: int) -> float:
    """Decode one e2m1 nibble from its bit fields: sign | exp(2) | mantissa(1), bias 1, subnormal at exp 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 0b1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2)
    return sign * mag


def _fp4_reference(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per-element decode: element c of a row is the low nibble of byte c//2 when c is even, else the high."""
    b = packed.view(torch.uint8).tolist()
    sc = scale.view(torch.uint8).tolist() if scale.dtype == torch.float8_e8m0fnu else None
    rows, cols = len(b), 2 * len(b[0])
    out = torch.empty(rows, cols, dtype=torch.float32)
    for r in range(rows):
        vals = []
        for c in range(cols):
            byte = b[r][c // 2]
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            factor = 2.0 ** (sc[r][c // group] - 127) if sc is not None else float(scale[r, c // group])
            vals.append(_e2m1_value(code) * factor)
        out[r] = torch.tensor(vals, dtype=torch.float32)
    return out


def test_fp4_expert_round_trip_and_nibble_order(tmp_path, gen):
    """Guards against a wrong FP4 decode: swapped nibbles, wrong e2m1 table or sign bit, a scale applied to
    the wrong group of 32, or not recognizing int8 expert weights as packed FP4."""
    name = "layers.1.ffn.experts.3.w2.weight"
    w = _spread_magnitudes(gen, _randn(gen, 64, 96), 8, 32)
    assert torch.isfinite(w).all()
    packed, s = quantize_fp4_experts(w)
    assert packed.dtype == torch.int8 and packed.shape == (64, 48)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (64, 3)

    save_safetensors_shards({name: packed, name.replace(".weight", ".scale"): s}, tmp_path / "ok")
    got = load_safetensors_dir(tmp_path / "ok")
    assert set(got) == {name}
    got = got[name]
    ref = _fp4_reference(packed, s)
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert got.dtype == torch.float32 and got.shape == (64, 96)
    assert torch.equal(got, ref)
    assert torch.equal(dequantize_fp4(packed, s), ref)

    # the nibble order matters: swapping the nibbles of every byte changes the loaded weight
    u = packed.view(torch.uint8)
    swapped = ((u << 4) | (u >> 4)).view(torch.int8)
    assert not torch.equal(swapped, packed)
    save_safetensors_shards({name: swapped, name.replace(".weight", ".scale"): s}, tmp_path / "swapped")
    got_swapped = load_safetensors_dir(tmp_path / "swapped")[name]
    assert torch.isfinite(got_swapped).all()
    assert not torch.equal(got_swapped, ref)
    assert torch.equal(got_swapped, _fp4_reference(swapped, s))

    # and, spelled out: byte 0x9A holds element 0 = code 0xA (-1.0) and element 1 = code 0x9 (-0.5)
    one = torch.full((1, 16), 0x21, dtype=torch.uint8)
    one[0, 0] = 0x9A
    unit = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    dec = dequantize_fp4(one.view(torch.int8), unit)
    assert torch.isfinite(dec).all()
    assert dec[0, :4].tolist() == [-1.0, -0.5, 0.5, 1.0]


def test_fp4_quantizer_rounds_to_nearest(gen):
    """Guards against the FP4 quantizer picking a non-nearest e2m1 code or a scale that overflows (>6)."""
    w = _spread_magnitudes(gen, _randn(gen, 24, 160), 4, 32)
    assert torch.isfinite(w).all()
    packed, s = quantize_fp4_experts(w)
    sf = s.float().repeat_interleave(32, dim=1)
    x = w / sf
    assert torch.isfinite(x).all()
    # tightest power of two with amax / scale <= 6
    amax = w.abs().reshape(24, 5, 32).amax(-1)
    ratio = amax / s.float()
    assert (ratio <= 6.0).all() and (ratio > 3.0).all()
    # every value is a nearest code among all 15 distinct e2m1 values
    grid = torch.tensor(sorted({_e2m1_value(c) for c in range(16)}))
    best = (x.unsqueeze(-1) - grid).abs().min(-1).values
    got = dequantize_fp4(packed, s) / sf
    assert torch.isfinite(got).all()
    assert torch.equal((got - x).abs(), best)

    # exact midpoints round to the even code (ties-to-even, as IEEE rounding does)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0] + [0.0] * 22])
    tp, ts = quantize_fp4_experts(ties)
    assert float(ts.float()) == 1.0
    assert dequantize_fp4(tp, ts)[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -4.0]


def test_fp4_needs_experts_name(tmp_path, gen):
    """Guards against silently decoding an int8 non-expert tensor that has a scale as FP4."""
    packed, s = quantize_fp4_experts(_randn(gen, 8, 64))
    save_safetensors_shards({"layers.0.ffn.w1.weight": packed, "layers.0.ffn.w1.scale": s}, tmp_path)
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.w1\.weight"):
        load_safetensors_dir(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# dtype_for_float


def test_dtype_for_float_keeps_fp32_names(tmp_path, gen):
    """Guards against casting the float32-only parameters (attn_sink, hc_*, gate.bias, ...) to bf16, and
    against casting integer tensors."""
    fp32_names = [f"layers.0.attn.{s}" if "." not in s else f"layers.0.ffn.{s}" for s in FP32_NAMES_SUFFIXES]
    fp32_names.append("mtp.0.hc_head_fn")
    sd = {n: _randn(gen, 3 + i, 2) for i, n in enumerate(fp32_names)}
    sd["embed.weight"] = _randn(gen, 11, 6)
    sd["layers.0.attn_norm.weight"] = _randn(gen, 6, dtype=torch.float16)
    sd["layers.0.attn.shape"] = _randn(gen, 4)  # ends with "ape" but is not the "ape" parameter
    sd["layers.0.ffn.gate.tid2eid"] = torch.randint(0, 50, (17, 2), generator=gen)
    q, sc = quantize_fp8_block(_randn(gen, 40, 24))
    sd["layers.0.attn.wq_a.weight"] = q
    sd["layers.0.attn.wq_a.scale"] = sc
    save_safetensors_shards(sd, tmp_path)

    got = load_safetensors_dir(tmp_path, dtype_for_float=torch.bfloat16)
    assert "layers.0.attn.wq_a.scale" not in got
    for n in fp32_names:
        assert got[n].dtype == torch.float32, n
        assert tensor_md5(got[n]) == tensor_md5(sd[n]), n
    for n in ("embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.shape"):
        assert got[n].dtype == torch.bfloat16, n
        assert torch.isfinite(got[n]).all()
        assert torch.equal(got[n], sd[n].to(torch.bfloat16)), n
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    deq = dequantize_fp8_block(q, sc)
    assert torch.isfinite(deq).all()
    assert torch.equal(got["layers.0.attn.wq_a.weight"], deq.to(torch.bfloat16))
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(got["layers.0.ffn.gate.tid2eid"], sd["layers.0.ffn.gate.tid2eid"])

    # without dtype_for_float nothing is cast
    plain = load_safetensors_dir(tmp_path)
    assert plain["layers.0.attn_norm.weight"].dtype == torch.float16


# ----------------------------------------------------------------------------------------------------------
# errors


def _three_shards(tmp_path, gen) -> tuple[list[str], dict[str, str]]:
    sd = {f"layers.{i}.attn.wkv.weight": _randn(gen, 16, 16 + i) for i in range(3)}
    files = save_safetensors_shards(sd, tmp_path, max_shard_bytes=1200)
    assert len(files) == 3
    return files, _index(tmp_path)["weight_map"]


def test_error_orphan_scale(tmp_path, gen):
    """Guards against silently dropping (or returning) a .scale whose weight is missing."""
    _, s = quantize_fp8_block(_randn(gen, 10, 10))
    files = save_safetensors_shards(
        {"embed.weight": _randn(gen, 3, 4), "layers.5.attn.wq_b.scale": s}, tmp_path
    )
    with pytest.raises(ValueError) as ei:
        load_safetensors_dir(tmp_path)
    assert "layers.5.attn.wq_b.scale" in str(ei.value) and files[0] in str(ei.value)


def test_error_scale_shape_mismatch(tmp_path, gen):
    """Guards against dequantizing with a scale of the wrong shape (broadcasting garbage)."""
    q, s = quantize_fp8_block(_randn(gen, 300, 200))
    files = save_safetensors_shards(
        {"layers.0.attn.wo_a.weight": q, "layers.0.attn.wo_a.scale": s[:2]}, tmp_path
    )
    with pytest.raises(ValueError) as ei:
        load_safetensors_dir(tmp_path)
    assert "layers.0.attn.wo_a.weight" in str(ei.value) and files[0] in str(ei.value)

    packed, s4 = quantize_fp4_experts(_randn(gen, 8, 64))
    name = "layers.1.ffn.experts.0.w3"
    files = save_safetensors_shards({f"{name}.weight": packed, f"{name}.scale": s4[:, :1]}, tmp_path / "fp4")
    with pytest.raises(ValueError) as ei:
        load_safetensors_dir(tmp_path / "fp4")
    assert f"{name}.weight" in str(ei.value) and files[0] in str(ei.value)


def test_error_fp8_weight_without_scale(tmp_path, gen):
    """Guards against returning raw fp8 codes as if they were weights when the scale is missing."""
    q, _ = quantize_fp8_block(_randn(gen, 10, 10))
    files = save_safetensors_shards({"layers.0.attn.wq_a.weight": q}, tmp_path)
    with pytest.raises(ValueError) as ei:
        load_safetensors_dir(tmp_path)
    assert "layers.0.attn.wq_a.weight" in str(ei.value) and files[0] in str(ei.value)


def test_error_missing_shard_file(tmp_path, gen):
    """Guards against a missing shard giving an obscure error or a silently partial state dict."""
    files, wm = _three_shards(tmp_path, gen)
    (tmp_path / files[1]).unlink()
    with pytest.raises(FileNotFoundError) as ei:
        load_safetensors_dir(tmp_path)
    names_in_missing = [k for k, v in wm.items() if v == files[1]]
    assert files[1] in str(ei.value) and names_in_missing[0] in str(ei.value)


def test_error_index_names_absent_tensor(tmp_path, gen):
    """Guards against an index entry whose tensor is not in its shard being ignored or raising a bare
    KeyError without the file and tensor names."""
    files, wm = _three_shards(tmp_path, gen)
    index = _index(tmp_path)
    index["weight_map"]["layers.9.attn.ghost.weight"] = files[2]
    _rewrite_index(tmp_path, index)
    with pytest.raises(ValueError) as ei:
        load_safetensors_dir(tmp_path)
    assert "layers.9.attn.ghost.weight" in str(ei.value) and files[2] in str(ei.value)


def test_error_bad_json(tmp_path, gen):
    """Guards against a corrupt index (or config.json) surfacing as a raw JSONDecodeError without a path."""
    _three_shards(tmp_path, gen)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_safetensors_dir(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / hf_io.INDEX_FILE).write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match=hf_io.INDEX_FILE.replace(".", r"\.")):
        load_safetensors_dir(tmp_path)


def test_save_rejects_bad_input(tmp_path):
    """Guards against writing an empty checkpoint or non-tensor values."""
    with pytest.raises(ValueError):
        save_safetensors_shards({}, tmp_path)
    with pytest.raises(TypeError):
        save_safetensors_shards({"a": [1, 2]}, tmp_path)
    assert not (tmp_path / hf_io.INDEX_FILE).exists()


def test_shards_get_the_mode_of_the_other_files(tmp_path):
    """safetensors writes its files 0600: the shards of a checkpoint others read (a shared
    filesystem) were unreadable to them while config.json and the index were 0644. Each shard
    gets the mode any new file gets here."""
    import stat

    from plugins.deepseek_v4.hf_io import write_index, write_shard

    write_shard(tmp_path, "model-00001.safetensors", {"a": torch.arange(6.0)})
    write_index(tmp_path, {"a": "model-00001.safetensors"}, 24)
    (tmp_path / "plain.txt").write_text("x")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert len(set(modes.values())) == 1, {k: oct(v) for k, v in modes.items()}
