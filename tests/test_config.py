"""Tests for plugins.deepseek_v4.config: presets, loading DeepSeek's config.json, validation errors
and the save/load round trip.

The V4-Flash and V4-Pro files are written by the tests from the field values in DSV4.md
section 1 plus the fields the real files carry without model meaning (architectures,
quantization_config, torch_dtype, ...); layer kinds are checked against DSV4.md section 2.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugins.deepseek_v4.config import ConfigError, DeepSeekV4Config, YarnScaling

QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]}

SHARED: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "compress_rope_theta": 160000, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "index_head_dim": 128, "index_n_heads": 64,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 6, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": QUANT, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0,
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280,
}

FLASH: dict[str, Any] = {
    **SHARED, "expert_dtype": "fp4", "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "q_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5, "index_topk": 512, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

PRO: dict[str, Any] = {
    **SHARED, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
    "index_topk": 1024, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}

# Structural fields that must be present in config.json: a silent default for any of them would
# build a different model than the checkpoint's.
REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
            "index_n_heads", "index_head_dim", "index_topk", "compress_ratios", "num_hash_layers", "sliding_window",
            "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "num_nextn_predict_layers", "rope_theta",
            "compress_rope_theta", "rope_scaling", "max_position_embeddings", "swiglu_limit"]


def write_config(directory: Path, raw: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw, indent=2))
    return path


def layer_kind(cfg: DeepSeekV4Config, layer: int) -> str:
    r = cfg.layer_ratio(layer)
    return "SWA" if r == 0 else "CSA" if cfg.is_csa(r) else "HCA"


def expected_kind(variant: str, layer: int, num_hidden_layers: int) -> str:
    """DSV4.md section 2: Flash layers 0-1 SWA, Pro layers 0-1 HCA (ratio 128); from layer 2 even
    layers CSA and odd layers HCA; the MTP block (after the main layers) is SWA."""
    if layer == num_hidden_layers:
        return "SWA"
    if layer < 2:
        return "SWA" if variant == "flash" else "HCA"
    return "CSA" if layer % 2 == 0 else "HCA"


# ----------------------------------------------------------------------------------------------------------
# presets


def test_tiny_preset_has_every_structural_feature() -> None:
    """Guards a tiny preset that silently drops a structural feature, so model tests would never
    exercise it: SWA, CSA and HCA layers (ratio 0, 4, > 4) among the main layers, hash layers,
    an MTP layer (SWA), mHC with 4 streams, a non-rope prefix in the head, YaRN for compressed
    layers, an indexer whose top-k is smaller than the blocks a short sequence produces."""
    cfg = DeepSeekV4Config.tiny()
    cfg.validate("test")
    main = cfg.compress_ratios[: cfg.num_hidden_layers]
    assert 0 in main, f"no SWA layer: {cfg.compress_ratios}"
    assert 4 in main and any(cfg.is_csa(r) for r in main), f"no CSA layer: {cfg.compress_ratios}"
    assert any(r > 4 for r in main), f"no HCA layer: {cfg.compress_ratios}"
    assert cfg.num_hash_layers >= 1
    assert cfg.num_nextn_predict_layers == 1 and len(cfg.compress_ratios) == cfg.num_hidden_layers + 1
    assert cfg.num_layers_total == cfg.num_hidden_layers + 1
    assert layer_kind(cfg, cfg.num_hidden_layers) == "SWA", "the MTP block is SWA"
    assert cfg.hc_mult == 4
    assert cfg.num_key_value_heads == 1
    assert 0 < cfg.qk_rope_head_dim < cfg.head_dim, "rope must cover only the last dims"
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor > 1
    assert cfg.n_shared_experts == 1 and 1 < cfg.num_experts_per_tok < cfg.n_routed_experts
    assert cfg.o_groups > 1 and cfg.index_topk >= 1


def test_small_50m_preset_validates_with_flash_structure() -> None:
    """Guards the benchmark preset drifting from V4-Flash's structure (all three layer kinds,
    hash layers, MTP)."""
    cfg = DeepSeekV4Config.small_50m()
    kinds = {layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)}
    assert kinds == {"SWA", "CSA", "HCA"}, cfg.compress_ratios
    assert cfg.num_hash_layers >= 1 and cfg.num_nextn_predict_layers == 1 and cfg.hc_mult == 4


def test_preset_overrides_are_validated() -> None:
    """Guards presets bypassing validation: an invalid override raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        DeepSeekV4Config.tiny(num_key_value_heads=2)
    with pytest.raises(ConfigError, match="compress_ratios"):
        DeepSeekV4Config.tiny(compress_ratios=[0, 4, 16, 4, 0])


# ----------------------------------------------------------------------------------------------------------
# DeepSeek's files


@pytest.mark.parametrize("variant", ["flash", "pro"])
def test_release_config_loads_with_right_values(tmp_path: Path, variant: str) -> None:
    """Guards misreading DeepSeek's config.json: every DSV4.md section 1 value comes through,
    compress_ratios has one entry per layer incl. MTP (44 Flash, 62 Pro), and the layer kinds
    follow DSV4.md section 2."""
    raw = FLASH if variant == "flash" else PRO
    write_config(tmp_path, raw)
    cfg = DeepSeekV4Config.from_pretrained(tmp_path)
    for name in REQUIRED + ["scoring_func", "topk_method", "norm_topk_prob", "hidden_act", "bos_token_id",
                            "eos_token_id", "tie_word_embeddings", "initializer_range"]:
        if name != "rope_scaling":
            assert getattr(cfg, name) == raw[name], f"{variant}: {name} = {getattr(cfg, name)!r}"
    assert cfg.rope_scaling == YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
                                           beta_slow=1.0)
    layers = 43 if variant == "flash" else 61
    assert cfg.num_hidden_layers == layers and cfg.num_layers_total == layers + 1
    assert len(cfg.compress_ratios) == layers + 1
    kinds = [layer_kind(cfg, i) for i in range(cfg.num_layers_total)]
    assert kinds == [expected_kind(variant, i, layers) for i in range(layers + 1)], kinds
    if variant == "flash":
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.o_groups, cfg.q_lora_rank) == (4096, 64, 8, 1024)
        assert (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.index_topk) == (256, 2048, 512)
        assert cfg.routed_scaling_factor == 1.5
        assert kinds.count("CSA") == 21 and kinds.count("HCA") == 20 and kinds.count("SWA") == 3
    else:
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.o_groups, cfg.q_lora_rank) == (7168, 128, 16, 1536)
        assert (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.index_topk) == (384, 3072, 1024)
        assert cfg.routed_scaling_factor == 2.5
        assert kinds.count("CSA") == 30 and kinds.count("HCA") == 31 and kinds.count("SWA") == 1
    assert cfg.extra.get("quantization_config") == QUANT, "quantization_config kept for the round trip"


# ----------------------------------------------------------------------------------------------------------
# bad input: ConfigError naming the file and the field


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def f(raw: dict) -> None:
        raw[key] = value
    return f


def _set_ratio(i: int, value: Any) -> Callable[[dict], None]:
    def f(raw: dict) -> None:
        raw["compress_ratios"][i] = value
    return f


def _set_rope(key: str, value: Any) -> Callable[[dict], None]:
    def f(raw: dict) -> None:
        raw["rope_scaling"][key] = value
    return f


def _del(key: str, sub: str | None = None) -> Callable[[dict], None]:
    def f(raw: dict) -> None:
        if sub is None:
            del raw[key]
        else:
            del raw[key][sub]
    return f


BAD_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("MTP block not SWA", lambda raw: raw["compress_ratios"].__setitem__(-1, 4), "compress_ratios[43]"),
    ("missing hidden_size", _del("hidden_size"), "hidden_size"),
    ("missing compress_ratios", _del("compress_ratios"), "compress_ratios"),
    ("string for int", _set("hidden_size", "4096"), "hidden_size"),
    ("string for float", _set("rms_norm_eps", "1e-6"), "rms_norm_eps"),
    ("float for int", _set("num_attention_heads", 64.0), "num_attention_heads"),
    ("NaN float", _set("hc_eps", float("nan")), "hc_eps"),
    ("bool for int", _set("num_hidden_layers", True), "num_hidden_layers"),
    ("bool for int equal to 1", _set("num_key_value_heads", True), "num_key_value_heads"),
    ("bool for float", _set("swiglu_limit", True), "swiglu_limit"),
    ("int for bool", _set("norm_topk_prob", 1), "norm_topk_prob"),
    ("string for knob float", _set("router_bias_update_rate", "1e-3"), "router_bias_update_rate"),
    ("unknown kernels backend", _set("kernels", "cuda"), "kernels"),
    ("unknown field", _set("hc_mults", 4), "hc_mults"),
    ("ratio 1", _set_ratio(5, 1), "compress_ratios"),
    ("negative ratio", _set_ratio(2, -4), "compress_ratios"),
    ("bool ratio", _set_ratio(3, True), "compress_ratios"),
    ("string ratio", _set_ratio(4, "4"), "compress_ratios"),
    ("float ratio", _set_ratio(6, 4.0), "compress_ratios"),
    ("ratios one short", lambda raw: raw["compress_ratios"].pop(), "compress_ratios"),
    ("ratios not a list", _set("compress_ratios", "0,0,4,128"), "compress_ratios"),
    ("kv heads 8", _set("num_key_value_heads", 8), "num_key_value_heads"),
    ("rope_scaling type linear", _set_rope("type", "linear"), "rope_scaling"),
    ("rope_scaling a string", _set("rope_scaling", "yarn"), "rope_scaling"),
    ("rope_scaling missing factor", _del("rope_scaling", "factor"), "rope_scaling"),
    ("rope_scaling string factor", _set_rope("factor", "16"), "rope_scaling"),
    ("rope_scaling mscale", _set_rope("mscale", 0.707), "rope_scaling"),
    ("rope_scaling unknown key", _set_rope("low_freq_factor", 1.0), "rope_scaling"),
    ("model_type v3", _set("model_type", "deepseek_v3"), "model_type"),
    ("attention_bias true", _set("attention_bias", True), "attention_bias"),
    ("quant method", _set("quantization_config", {**QUANT, "quant_method": "int4"}), "quantization_config"),
    ("quant block", _set("quantization_config", {**QUANT, "weight_block_size": [128]}), "quantization_config"),
    ("experts per token > experts", _set("num_experts_per_tok", 300), "num_experts_per_tok"),
    ("zero hidden", _set("hidden_size", 0), "hidden_size"),
    ("hash layers > layers", _set("num_hash_layers", 44), "num_hash_layers"),
    ("two MTP layers", _set("num_nextn_predict_layers", 2), "num_nextn_predict_layers"),
    ("tied embeddings", _set("tie_word_embeddings", True), "tie_word_embeddings"),
    ("wrong scoring", _set("scoring_func", "sigmoid"), "scoring_func"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_field_raises_config_error_naming_it(tmp_path: Path, case) -> None:
    """Guards a bad config.json either loading silently (a different model than the checkpoint)
    or failing deep inside torch: each defect raises ConfigError naming the file and field."""
    _, mutate, field = case
    raw = copy.deepcopy(FLASH)
    mutate(raw)
    path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        DeepSeekV4Config.from_pretrained(tmp_path)
    msg = str(err.value)
    assert field in msg, f"message does not name '{field}': {msg}"
    assert str(path) in msg, f"message does not name the file: {msg}"


def test_every_required_field_missing_is_named(tmp_path: Path) -> None:
    """Guards a structural field silently getting a default when absent from config.json."""
    for name in REQUIRED:
        raw = copy.deepcopy(FLASH)
        del raw[name]
        write_config(tmp_path / name, raw)
        with pytest.raises(ConfigError) as err:
            DeepSeekV4Config.from_pretrained(tmp_path / name)
        assert f"'{name}'" in str(err.value) and "missing" in str(err.value), str(err.value)


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    """Guards a JSONDecodeError stack trace instead of a ConfigError naming the file."""
    path = write_config(tmp_path, json.dumps(FLASH)[:-20])
    with pytest.raises(ConfigError) as err:
        DeepSeekV4Config.from_pretrained(tmp_path)
    assert str(path) in str(err.value) and "JSON" in str(err.value), str(err.value)
    write_config(tmp_path / "list", [FLASH])  # valid JSON, not an object
    with pytest.raises(ConfigError, match="JSON object"):
        DeepSeekV4Config.from_pretrained(tmp_path / "list")


def test_missing_config_json_names_the_file(tmp_path: Path) -> None:
    """Guards a FileNotFoundError (or a default config) when the directory has no config.json."""
    with pytest.raises(ConfigError) as err:
        DeepSeekV4Config.from_pretrained(tmp_path)
    assert "config.json" in str(err.value) and str(tmp_path) in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="config.json"):
        DeepSeekV4Config.from_pretrained(tmp_path / "does-not-exist")


# ----------------------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("variant", ["tiny", "tiny_knobs_no_yarn", "flash", "pro"])
def test_save_load_round_trip_is_exact(tmp_path: Path, variant: str) -> None:
    """Guards a saved checkpoint reloading a different model: save_pretrained -> from_pretrained
    gives equal to_dict() and field values, a second save is byte-identical, and every field of
    DeepSeek's original file survives with its value."""
    raw = None
    if variant == "tiny":
        cfg = DeepSeekV4Config.tiny()
    elif variant == "tiny_knobs_no_yarn":
        cfg = DeepSeekV4Config.tiny(rope_scaling=None, router_bias_update_rate=2e-3, hc_init_std=0.02,
                                    kernels="torch")
    else:
        raw = FLASH if variant == "flash" else PRO
        write_config(tmp_path / "orig", raw)
        cfg = DeepSeekV4Config.from_pretrained(tmp_path / "orig")
    cfg.save_pretrained(tmp_path / "a")
    loaded = DeepSeekV4Config.from_pretrained(tmp_path / "a")
    assert loaded.to_dict() == cfg.to_dict()
    for name in cfg.__dataclass_fields__:
        if name != "extra":
            assert getattr(loaded, name) == getattr(cfg, name), name
            assert type(getattr(loaded, name)) is type(getattr(cfg, name)), name
    loaded.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["architectures"] == ["DeepseekV4ForCausalLM"] and saved["model_type"] == "deepseek_v4"
    if raw is not None:
        for key, value in raw.items():
            assert key in saved and saved[key] == value, f"{key}: {saved.get(key)!r} != {value!r}"


def test_a_short_trial_of_a_job_clamps_the_job_files_warm_up_and_says_so() -> None:
    """train.steps lowered on the command line below the job file's warmup_steps (10) clamps
    the warm-up to the run's optimizer steps less one, with a note naming both; a warm-up the
    user gives on the command line too is still refused (they asked for it)."""
    from miles.config import JobConfigError, load_job

    job = load_job("jobs/sft_tiny.yaml", ["train.steps=4"])
    assert job.train.optim.warmup_steps == 3
    assert job.notes == ["train.optim.warmup_steps=10 (jobs/sft_tiny.yaml) is not below this run's 4 optimizer "
                         "steps (train.steps from the command line): the warm-up is clamped to 3"]
    assert load_job("jobs/sft_tiny.yaml", ["train.steps=40"]).train.optim.warmup_steps == 10
    assert load_job("jobs/sft_tiny.yaml", ["train.steps=40"]).notes == []
    with pytest.raises(JobConfigError, match="warmup_steps=6 must be below the run's 4 optimizer steps"):
        load_job("jobs/sft_tiny.yaml", ["train.steps=4", "train.optim.warmup_steps=6"])
    rl = load_job("jobs/dapo_tiny.yaml", ["train.steps=1"])  # RL: rollouts x updates per rollout
    assert rl.train.optim.warmup_steps == rl.optimizer_steps - 1 and rl.notes


def test_user_code_beside_the_job_file_is_imported_when_the_job_loads(tmp_path: Path, monkeypatch) -> None:
    """algo.reward: my_reward:add_reward with my_reward.py beside the job file loads from any
    working directory (it worked through miles submit only, and failed after Ray, the engines
    and the first evaluation had started); a typo, a missing module or a module that fails
    to import is a JobConfigError naming the field and the job file."""
    import sys

    from miles.config import JobConfigError, load_job

    (tmp_path / "my_reward.py").write_text("def add_reward(response, label, prompt):\n    return 1.0\n")
    (tmp_path / "broken_reward.py").write_text("def f(:\n")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(Path("jobs/dapo_tiny.yaml").absolute().read_text()
                         .replace("path: miles/", f"path: {Path.cwd() / 'miles'}/"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    job = load_job(job_file, ["algo.reward=my_reward:add_reward", f"log.run_dir={tmp_path / 'run'}"])
    assert job.algo.reward == "my_reward:add_reward"
    from miles.algo.rewards import load_reward

    assert load_reward("my_reward:add_reward")("r", "l", "p") == 1.0
    for spec, why in (("my_reward:ad_reward", "has no attribute 'ad_reward'"),
                      ("no_such_reward_mod:f", "No module named 'no_such_reward_mod'"),
                      ("broken_reward:f", "importing broken_reward failed: SyntaxError")):
        with pytest.raises(JobConfigError, match=rf"{job_file}: algo.reward '{spec}': .*{why}.*beside the job file"):
            load_job(job_file, [f"algo.reward={spec}", f"log.run_dir={tmp_path / 'run'}"])
