"""DeepSeek-V4 configuration: HF `config.json` field names, validated once.

`DeepSeekV4Config.from_pretrained(dir)` reads config.json itself (older transformers
releases cannot parse V4 fields through the V3 class) and checks every field: a
missing, unknown or ill-typed field raises `ConfigError` naming the file and field.
Fields after the HF block are miles' own training knobs; they have defaults and are
written back into config.json so a saved checkpoint reloads the same model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json (or preset) field is missing, unknown or invalid."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass
class DeepSeekV4Config:
    # --- HF fields (names as in DeepSeek's config.json) ---
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: list[int]
    num_hash_layers: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    max_position_embeddings: int
    swiglu_limit: float
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # --- miles model knobs (not in DeepSeek's file; defaults documented in the README). The
    # loss coefficients (MTP, indexer KL, balance) are the job's (`algo` in a job file). ---
    router_bias_update_rate: float = 1e-3
    hc_init_std: float = 0.01  # mHC gating init (Megatron's choice; DeepSeek's is not public)
    # GPU kernels (attention core, Sinkhorn, grouped expert GEMMs): "auto" = on CUDA when
    # triton is installed, "torch" = the PyTorch reference everywhere, "triton" = always
    kernels: str = "auto"
    # Switches of the sparse attention kernels (kernels.sparse_attention.AttentionOptions): the
    # H100 Gluon forward and dq pass, the H100 Gluon kv gradient of the fast backward, the
    # backward's chunk overlap on two streams
    sm90_kernels: bool = True
    sm90_kv_gradient: bool = True
    overlap_chunks: bool = False
    # The fp32 projections of a bf16 model (compressor, gate, mHC mixes, LM/MTP heads) on
    # tensor cores: TF32, and a bf16 x bf16 forward as a bf16 GEMM with fp32 output; exact
    # products of bf16 operands, fp32 sums (ops.fp32_linear)
    tf32_projections: bool = True
    # With the GPU kernels: the elementwise glue as fused Triton kernels, one launch each way
    # (RMSNorm, RoPE, q's norm with RoPE, the experts' clamped SwiGLU, the MoE's row moves, the
    # LM/MTP heads' log-softmax, the mHC gates; off: the PyTorch ops, for A/B runs)
    fused_elementwise: bool = True
    # Training: keep each block's input only and run its forward again in the backward
    # (activation memory of one block instead of all, for about a third more compute)
    recompute: bool = False
    # Training on CUDA: each block's forward and backward replayed as one CUDA graph each (the
    # step is host-bound: thousands of small launches a block); one capture per input shape
    cuda_graphs: bool = False
    # KV-QAT: "fp8" rounds K = V's non-RoPE channels (plain, compressed and indexer keys) as
    # DeepSeek's runtime stores them in its cache (ops.fp8_kv_fake_quant), in training and in
    # the engine alike; None: unrounded
    kv_quant: str | None = None
    # The LM/MTP heads' backward (parallel._HeadLogprobs), A/B options for speed: keep each
    # chunk's fp32 logits from the forward instead of computing them again (4 bytes a token
    # and vocabulary entry held until the backward: 2.1 GB for 4,096 tokens of V4's 129,280,
    # per head); the logits' gradient in the backward GEMMs as 2 bf16 terms (exact to 2^-17:
    # the fp32 head's gradients) or 1 (the gradient rounded to bf16, as a bf16 head's is)
    head_keep_logits: bool = False
    head_grad_terms: int = 2
    # Fields of DeepSeek's file that carry no model meaning for us, kept for the round trip.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides: Any) -> DeepSeekV4Config:
        """Every structural feature at toy width: SWA, CSA (ratio 4, indexer), HCA
        (ratio 16 so short test sequences cross several blocks), 2 hash layers, MTP."""
        cfg = cls(**{**_TINY, **overrides})
        cfg.validate("tiny preset")
        return cfg

    @classmethod
    def small_50m(cls, **overrides: Any) -> DeepSeekV4Config:
        """~50M parameters (the CPU benchmark size), same structure as V4-Flash."""
        cfg = cls(**{**_TINY, **_SMALL_50M, **overrides})
        cfg.validate("small_50m preset")
        return cfg

    # ------------------------------------------------------------------ derived
    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def layer_ratio(self, layer: int) -> int:
        """Compression ratio of block `layer` (MTP blocks follow the main layers)."""
        return self.compress_ratios[layer]

    @staticmethod
    def is_csa(ratio: int) -> bool:
        """ratio 4 = compressed sparse attention (overlapping compressor + indexer)."""
        return ratio == 4

    # ------------------------------------------------------------------ validation
    def validate(self, source: str = "config") -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{source}: field '{name}' {msg} (got {getattr(self, name)!r})")

        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            kind = _FIELD_KINDS.get(f.name)
            if kind is int:
                need(isinstance(v, int) and not isinstance(v, bool), f.name, "must be an integer")
            elif kind is float:
                need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                     f.name, "must be a finite number")
            elif kind is bool:
                need(isinstance(v, bool), f.name, "must be true or false")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "hc_mult",
                     "hc_sinkhorn_iters", "max_position_embeddings"):
            need(getattr(self, name) > 0, name, "must be positive")
        for name in ("hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                     "routed_scaling_factor"):
            need(getattr(self, name) > 0, name, "must be positive")
        for name in ("n_shared_experts", "num_hash_layers", "num_nextn_predict_layers",
                     "router_bias_update_rate", "initializer_range", "hc_init_std"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "must be 1 (V4 attention is MQA, K = V)")
        need(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim,
             "qk_rope_head_dim", "must be even and <= head_dim")
        need(self.qk_rope_head_dim <= self.index_head_dim, "qk_rope_head_dim", "must be <= index_head_dim")
        need((self.num_attention_heads * self.head_dim) % self.o_groups == 0, "o_groups",
             "must divide num_attention_heads * head_dim")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             "must be <= n_routed_experts")
        need(self.n_shared_experts <= 1, "n_shared_experts", "must be 0 or 1")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim",
             "must be a power of two (Hadamard rotation)")
        need(self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers", "must be <= num_hidden_layers")
        need(self.hc_mult >= 1, "hc_mult", "must be >= 1")
        need(self.num_nextn_predict_layers <= 1, "num_nextn_predict_layers", "must be 0 or 1 (V4 ships one)")
        need(self.kv_quant in (None, "fp8"), "kv_quant", "must be null or 'fp8'")
        need(self.head_grad_terms in (1, 2), "head_grad_terms", "must be 1 or 2")
        need(self.kernels in ("auto", "torch", "triton"), "kernels",
             "must be 'auto', 'torch' or 'triton'")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func", "must be 'sqrtsoftplus'")
        need(self.topk_method == "noaux_tc", "topk_method", "must be 'noaux_tc'")
        need(self.hidden_act == "silu", "hidden_act", "must be 'silu'")
        need(self.norm_topk_prob is True, "norm_topk_prob", "must be true")
        need(self.tie_word_embeddings is False, "tie_word_embeddings", "must be false (V4 head is untied)")
        need(0 <= self.bos_token_id < self.vocab_size, "bos_token_id", "must be a token id")
        need(0 <= self.eos_token_id < self.vocab_size, "eos_token_id", "must be a token id")
        need(isinstance(self.compress_ratios, list) and len(self.compress_ratios) == self.num_layers_total,
             "compress_ratios", f"must list one ratio per layer incl. MTP ({self.num_layers_total})")
        for i, r in enumerate(self.compress_ratios):
            if not (isinstance(r, int) and not isinstance(r, bool) and (r == 0 or r >= 2)):
                raise ConfigError(f"{source}: field 'compress_ratios[{i}]' must be 0 or an integer >= 2 "
                                  f"(got {r!r})")
        if self.num_nextn_predict_layers and self.compress_ratios[-1] != 0:
            raise ConfigError(f"{source}: field 'compress_ratios[{len(self.compress_ratios) - 1}]' (the MTP block) "
                              f"must be 0: the MTP block is sliding-window attention (got {self.compress_ratios[-1]})")
        need(not (self.cuda_graphs and self.recompute), "cuda_graphs",
             "and recompute cannot both be on (a graphed block keeps its activations)")
        if self.rope_scaling is not None:
            y = self.rope_scaling
            if not (y.factor >= 1 and y.original_max_position_embeddings > 0 and y.beta_fast > y.beta_slow > 0):
                raise ConfigError(f"{source}: field 'rope_scaling' needs factor >= 1, "
                                  f"original_max_position_embeddings > 0, beta_fast > beta_slow > 0 (got {y})")

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        d.update({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"})
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def save_pretrained(self, directory: str | Path) -> None:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> DeepSeekV4Config:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(raw) - known - set(_IGNORED_FIELDS))
        if unknown:
            raise ConfigError(f"{source}: unknown field '{unknown[0]}'"
                              + (f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else ""))
        for name, expected in _IGNORED_FIELDS.items():
            if name in raw and expected is not None and raw[name] != expected:
                raise ConfigError(f"{source}: field '{name}' must be {expected!r} (got {raw[name]!r})")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in raw]
        if missing:
            raise ConfigError(f"{source}: missing field '{missing[0]}'"
                              + (f" (and {missing[1:]})" if len(missing) > 1 else ""))
        kwargs = {k: v for k, v in raw.items() if k in known}
        kwargs["rope_scaling"] = _parse_rope_scaling(raw["rope_scaling"], source)
        quant = raw.get("quantization_config")
        if quant is not None:
            _check_quantization(quant, source)
        cfg = cls(**kwargs, extra={k: v for k, v in raw.items() if k in _IGNORED_FIELDS})
        cfg.validate(source)
        return cfg

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepSeekV4Config:
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in {directory}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))


_TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
    o_groups=2, o_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.5,
    index_n_heads=4, index_head_dim=32, index_topk=4,
    compress_ratios=[0, 4, 16, 4, 0, 0], num_hash_layers=2, sliding_window=16,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    num_nextn_predict_layers=1, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=YarnScaling(16.0, 64, 32.0, 1.0), max_position_embeddings=4096,
    swiglu_limit=10.0,
)
_SMALL_50M: dict[str, Any] = dict(
    vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=8,
    head_dim=128, qk_rope_head_dim=32, q_lora_rank=192, o_groups=4, o_lora_rank=192,
    n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
    index_n_heads=8, index_head_dim=64, index_topk=32,
    compress_ratios=[0, 4, 32, 4, 32, 0, 0], sliding_window=64,
    rope_scaling=YarnScaling(16.0, 1024, 32.0, 1.0), max_position_embeddings=16384,
)

_FIELD_KINDS: dict[str, type] = {}
for _f in dataclasses.fields(DeepSeekV4Config):
    _t = str(_f.type)
    if _t in ("int", "float", "bool"):
        _FIELD_KINDS[_f.name] = {"int": int, "float": float, "bool": bool}[_t]

# Fields of DeepSeek's config.json that carry no meaning for the model (or only one legal
# value, checked when not None).
_IGNORED_FIELDS: dict[str, Any] = {
    "architectures": None, "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "torch_dtype": None, "dtype": None, "transformers_version": None,
    "use_cache": None, "quantization_config": None, "expert_dtype": None,
}


METADATA_FIELDS = frozenset(_IGNORED_FIELDS)  # config.json fields that describe no weight or computation


def _parse_rope_scaling(raw: Any, source: str) -> YarnScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null")
    kind = raw.get("type", raw.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(f"{source}: field 'rope_scaling.type' must be 'yarn' (got {kind!r})")
    allowed = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim"}
    extra = sorted(set(raw) - allowed)
    if extra:
        raise ConfigError(f"{source}: unknown field 'rope_scaling.{extra[0]}'")
    for k in ("mscale", "mscale_all_dim"):  # V4 applies no magnitude scaling
        if raw.get(k, 1.0) != 1.0:
            raise ConfigError(f"{source}: field 'rope_scaling.{k}' must be 1.0 (V4 uses no YaRN mscale)")
    vals = {}
    for k, typ in (("factor", float), ("original_max_position_embeddings", int), ("beta_fast", float),
                   ("beta_slow", float)):
        if k not in raw:
            raise ConfigError(f"{source}: missing field 'rope_scaling.{k}'")
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
            raise ConfigError(f"{source}: field 'rope_scaling.{k}' must be a number (got {v!r})")
        vals[k] = typ(v)
    return YarnScaling(**vals)


def _check_quantization(q: Any, source: str) -> None:
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise ConfigError(f"{source}: field 'quantization_config.quant_method' must be 'fp8'")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{source}: field 'quantization_config.weight_block_size' must be [rows, cols]")
