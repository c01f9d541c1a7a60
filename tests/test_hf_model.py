"""HF layout of whole models: save_pretrained / from_pretrained, FP8/FP4 checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_close, random_ids, tiny_model
from safetensors.torch import load_file, save_file

from plugins.deepseek_v4 import DeepSeekV4ForCausalLM
from plugins.deepseek_v4.checksum import tensor_md5
from plugins.deepseek_v4.hf_io import (
    INDEX_FILE,
    dequantize_fp4,
    dequantize_fp8_block,
    quantize_fp4_experts,
    quantize_fp8_block,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_byte_identical(tmp_path, seed, dtype):
    """save_pretrained -> from_pretrained gives byte-identical tensors (MD5 per tensor),
    across several shards, and the reloaded model computes identical logits."""
    model = tiny_model(seed, dtype=dtype)
    model.save_pretrained(tmp_path, max_shard_bytes=400_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    back = DeepSeekV4ForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert tensor_md5(a[k]) == tensor_md5(b[k]), k
    ids = random_ids(seed, 2, 40)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, back.eval()(ids).logits)


def _quantize_checkpoint(directory) -> dict[str, torch.Tensor]:
    """Rewrite a saved checkpoint the way DeepSeek ships it: FP8 128x128-block weights
    (block 16 here, so tiny matrices span several blocks) with e8m0 scales, and FP4
    routed experts. Returns the dequantized values the loader must produce."""
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [16, 16]}
    cfg_path.write_text(json.dumps(cfg))
    expect = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        tensors = load_file(shard)
        out = {}
        for name, t in tensors.items():
            if ".experts." in name and name.endswith(".weight"):
                packed, scale = quantize_fp4_experts(t.float())
                out[name], out[name[: -len("weight")] + "scale"] = packed, scale
                expect[name] = dequantize_fp4(packed, scale)
            elif name.endswith(("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                                "shared_experts.w1.weight")) and ".compressor." not in name:
                w8, scale = quantize_fp8_block(t.float(), block=(16, 16))
                out[name], out[name[: -len("weight")] + "scale"] = w8, scale
                expect[name] = dequantize_fp8_block(w8, scale, (16, 16))
            else:
                out[name] = t
        save_file(out, shard)
        index = json.loads((directory / INDEX_FILE).read_text())
        for name in out:
            index["weight_map"][name] = shard.name
        (directory / INDEX_FILE).write_text(json.dumps(index))
    return expect


def test_fp8_and_fp4_checkpoint_loads_dequantized(tmp_path, seed):
    """A checkpoint with FP8 block-quantized linears and FP4 experts loads to exactly the
    dequantized values, and the model runs finite and close to the unquantized one."""
    model = tiny_model(seed)
    model.save_pretrained(tmp_path)
    expect = _quantize_checkpoint(tmp_path)
    assert any(".experts." in k for k in expect) and any("wq_a" in k for k in expect)
    back = DeepSeekV4ForCausalLM.from_pretrained(tmp_path)
    sd = back.state_dict()
    for name, val in expect.items():
        assert torch.equal(sd[name], val.to(sd[name].dtype)), name
    ids = random_ids(seed, 1, 40)
    with torch.no_grad():
        ref, got = model.eval()(ids).logits, back.eval()(ids).logits
    assert_close(got, ref, atol=0.5, what="quantized model drifts beyond FP4/FP8 error")


def test_mismatched_checkpoint_is_a_clear_error(tmp_path, seed):
    """A checkpoint whose tensors do not fit the config fails naming the tensor, not with a
    stack trace from deep inside torch."""
    model = tiny_model(seed)
    model.save_pretrained(tmp_path)
    shard = next(tmp_path.glob("model-*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("attn.wkv.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        DeepSeekV4ForCausalLM.from_pretrained(tmp_path)
