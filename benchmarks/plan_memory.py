"""Per-rank memory and step FLOPs of DeepSeek-V4 training layouts, from the architecture.

    python3 benchmarks/plan_memory.py [--stages] [--modules]

Rows: the real V4-Flash and V4-Pro configs (DSV4.md section 1) at the layouts of
jobs/*dsv4*.yaml, and the ~1B config of benchmarks/train_gpu.py on one GPU, the calibration
row, printed against its measurements on an H100. Per rank of the pipeline stage with the
largest peak:

- parameters: count and bytes as the model holds them (bf16; mHC fn/base/scale, compressor
  ape and attention sinks fp32), split as plugins/deepseek_v4/parallel.py splits them:
  heads, o groups, expert widths and the vocabulary over TP; contiguous layer ranges over
  PP (the first stage embeds, the last holds the head, the MTP block and its own embedding
  copy); routed experts over EP;
- gradients: Megatron DDP's fp32 buffer (grad_reduce_in_fp32), 4 B per parameter;
- optimizer: the DistributedOptimizer's fp32 main copy (of bf16 parameters; fp32 ones are
  their own) and Adam's two moments (fp32, or bf16 with train.optim.moments), sharded over
  DP x CP (dense parameters) or the expert-data-parallel group (routed experts);
- activations: what one micro-batch's forward keeps for its backward, the sum of a ledger
  of the tensors each module saves (kernel path: bf16 model, config.kernels on CUDA), times
  the micro-batches a 1F1B stage holds in flight (pp - stage); with model.recompute, each
  block's input instead of its tensors, and one block's tensors again in the backward;
- peak = states + activations + what sits beside them at the peak: on the last stage the
  loss head (fp32 logits and the log-probabilities' saved [t, V/tp] per head), else one
  MoE layer's forward temporaries;
- step FLOPs: matmuls from the shapes each rank multiplies (forward x3; on one GPU this is
  6 x active parameters x tokens but for h_proj, which runs once per mHC stream), the
  sparse attention core (4 D per query, head and key: its window plus top-k compressed
  entries (CSA) or all visible ones (HCA); x3.5, the backward recomputes the probabilities),
  the indexer scores of CSA layers (x3: trained by its KL, one product per gradient) and
  the KL target's attention mass (forward only, dense over all compressed entries).

The ledger holds one entry per tensor autograd keeps until the backward, each storage once
(tensors saved and released with their graph before the forward returns, e.g. the
indexer's top-k sort, are not in it). tests/test_plan_memory.py checks it module by module,
to the byte, against the tensors the real model keeps on CPU (Triton's interpreter), one
rank and TP 2; the calibration rows compare it with the ~1B config on an H100. The CP and
EP parts (per-layer RoPE copies, the all-to-all's saved indices and returned rows) follow
the code and are not measured. Assumed: one document per row (every compression block
complete; packing only removes blocks), CP rank 0 (all ranks have the same causal work),
balanced routing (each rank's experts get k/E of its EP group's pairs).

Not estimated: the CUDA context, NCCL and cuBLAS workspaces, the caching allocator's
fragmentation and cached blocks, Megatron's bucket padding, the backward's own temporaries
beyond the loss head (gradients of one layer), imbalanced routing; and layouts the worker
cannot build are flagged, with the same ranks' buildable EP beside them.
"""

from __future__ import annotations

import argparse
import glob
import sys
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plugins.deepseek_v4.config import DeepSeekV4Config, YarnScaling  # noqa: E402

GiB = 2 ** 30
BF16, F32, I64, I32, BOOL = 2, 4, 8, 4, 1
GROUP_ALIGN = 16  # ops.GROUP_ALIGN: rows per expert group padded to this (grouped GEMMs)

# --------------------------------------------------------------------------- configs
# DSV4.md section 1 (the values tests/test_config.py writes as V4-Flash's and V4-Pro's config.json).
_V4_SHARED = dict(
    vocab_size=129280, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, o_lora_rank=1024,
    n_shared_experts=1, num_experts_per_tok=6, index_n_heads=64, index_head_dim=128, num_hash_layers=3,
    sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    num_nextn_predict_layers=1, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0), max_position_embeddings=1048576, swiglu_limit=10.0,
)
V4_FLASH = dict(_V4_SHARED, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
                o_groups=8, n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5,
                index_topk=512, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
V4_PRO = dict(_V4_SHARED, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
              o_groups=16, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
              index_topk=1024, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])


def v4_flash() -> DeepSeekV4Config:
    cfg = DeepSeekV4Config(**V4_FLASH)
    cfg.validate("V4-Flash (DSV4.md)")
    return cfg


def v4_pro() -> DeepSeekV4Config:
    cfg = DeepSeekV4Config(**V4_PRO)
    cfg.validate("V4-Pro (DSV4.md)")
    return cfg


def config_1b(seq: int = 4096) -> DeepSeekV4Config:
    from benchmarks.train_gpu import config_1b as make

    return make(seq)


# --------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """A trainer layout (train.parallel) and what one optimizer step runs on it."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    seq: int = 4096  # positions per row (data.seq_len)
    mbs: int = 1  # rows per micro-batch
    global_batch: int = 2  # rows per optimizer step, all DP ranks
    loss: str = "lm"  # "lm" (SFT) or "policy" (RL)
    mtp_loss: bool = True  # MTP cross-entropy in the loss (else its graph is dropped before the backward)
    # the keys and defaults below are a job's algo.*_loss_coef > 0 (miles.config, losses.LossCoefs)
    indexer_loss: bool = True  # the indexer's KL term (else the indexer's graph is dropped)
    balance_loss: bool = False
    recompute: bool = False  # model.recompute: each block keeps its input only, runs again in the backward
    fused_elementwise: bool = True  # model.fused_elementwise: RMSNorm, RoPE, SwiGLU as the fused kernels
    moments: str = "float32"  # train.optim.moments: AdamW's two moments in fp32 or bf16
    name: str = ""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def n_micro(self) -> int:
        """Micro-batches per step on each DP rank."""
        return max(1, self.global_batch // (self.dp * self.mbs))

    @property
    def dense_dp(self) -> int:
        """DistributedOptimizer shards of dense parameters: Megatron's DP x CP group."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel group: world / (expert TP x EP x PP), expert TP = TP (Megatron's
        default, and what the model's width split over TP needs); 0 when it does not divide."""
        per_stage = self.tp * self.cp * self.dp
        return per_stage // (self.tp * self.ep) if per_stage % (self.tp * self.ep) == 0 else 0

    def problems(self, cfg: DeepSeekV4Config) -> list[str]:
        out = []
        if self.expert_dp == 0:
            out.append(f"ep*tp = {self.ep * self.tp} does not divide the {self.tp * self.cp * self.dp} ranks of a "
                       f"pipeline stage: Megatron's initialize_model_parallel (expert TP = tp) raises, and the "
                       f"model splits expert widths over TP, so EP may only be carved from dp x cp here")
        if cfg.n_routed_experts % self.ep:
            out.append(f"ep={self.ep} does not divide {cfg.n_routed_experts} experts")
        if self.cp > 1 and self.seq % (2 * self.cp):
            out.append(f"2 x cp = {2 * self.cp} pieces do not divide seq {self.seq} (parallel.cp_chunk)")
        return out

    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp} ep{self.ep} cp{self.cp} dp{self.dp}"


def job_layout(path: str | Path) -> Layout:
    """The layout and step of a job file (train.parallel, data.seq_len, batch sizes, loss terms)."""
    import yaml

    job = yaml.safe_load(Path(path).read_text())
    par, train, algo = job["train"]["parallel"], job["train"], job.get("algo", {})
    return Layout(tp=par.get("tp", 1), pp=par.get("pp", 1), ep=par.get("ep", 1), cp=par.get("cp", 1),
                  dp=par.get("dp", 1), seq=job["data"]["seq_len"], mbs=train.get("micro_batch_size", 1),
                  global_batch=train["global_batch_size"], loss=algo.get("loss", "lm"),
                  mtp_loss=algo.get("mtp_loss_coef", 0.3) > 0, indexer_loss=algo.get("indexer_loss_coef", 0.01) > 0,
                  balance_loss=algo.get("balance_loss_coef", 0.0) > 0,
                  recompute=bool(job.get("model", {}).get("recompute", False)),
                  moments=train.get("optim", {}).get("moments", "float32"), name=Path(path).stem)


def constructible(lay: Layout, cfg: DeepSeekV4Config) -> Layout:
    """The same ranks with EP carved from DP x CP only (the largest such EP <= lay.ep that
    divides the experts): what the worker can build when lay's EP x TP exceeds a stage."""
    ep = max(e for e in range(1, min(lay.ep, lay.dp * lay.cp) + 1)
             if (lay.dp * lay.cp) % e == 0 and cfg.n_routed_experts % e == 0)
    return replace(lay, ep=ep, name=f"{lay.name}*")


# --------------------------------------------------------------------------- parameters
@dataclass
class Params:
    """Parameter elements of one rank, by Megatron DDP buffer."""

    dense_bf16: int = 0
    dense_f32: int = 0
    expert_bf16: int = 0  # routed experts (reduced over the expert-data-parallel group)

    @property
    def count(self) -> int:
        return self.dense_bf16 + self.dense_f32 + self.expert_bf16

    @property
    def nbytes(self) -> int:
        return BF16 * (self.dense_bf16 + self.expert_bf16) + F32 * self.dense_f32


def stage_layers(cfg: DeepSeekV4Config, pp: int, stage: int) -> range:
    """ParallelContext.stage_layers: contiguous ranges, earlier stages take the remainder."""
    per, extra = divmod(cfg.num_hidden_layers, pp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


def _block_params(cfg: DeepSeekV4Config, layer: int, tp: int, ep: int) -> Params:
    n, d, D, H = cfg.hc_mult, cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    m, r, rq = n * (n + 2), cfg.layer_ratio(layer), cfg.q_lora_rank
    p = Params()
    p.dense_f32 += 2 * (m * n * d + m + 3)  # hc_{attn,ffn}_{fn [m, n d], base [m], scale [3]}
    p.dense_bf16 += 2 * d  # attn_norm, ffn_norm
    # attention: wq_a [rq, d], q_norm, wq_b [H D / tp, rq], wkv [D, d], kv_norm, wo_a [og R / tp, H D / og],
    # wo_b [d, og R / tp]; attn_sink [H / tp] fp32
    p.dense_bf16 += rq * d + rq + H * D // tp * rq + D * d + D
    p.dense_bf16 += cfg.o_groups * cfg.o_lora_rank // tp * (H * D // cfg.o_groups) + d * (
        cfg.o_groups * cfg.o_lora_rank // tp)
    p.dense_f32 += H // tp
    if r:
        for width in (D, cfg.index_head_dim) if cfg.is_csa(r) else (D,):
            coff = 2 if cfg.is_csa(r) else 1
            p.dense_bf16 += 2 * coff * width * d + width  # wkv, wgate [coff w, d], norm [w]
            p.dense_f32 += r * coff * width  # ape [r, coff w]
        if cfg.is_csa(r):  # indexer: wq_b [Hi Di, rq], weights_proj [Hi, d]
            p.dense_bf16 += cfg.index_n_heads * cfg.index_head_dim * rq + cfg.index_n_heads * d
    inter = cfg.moe_intermediate_size // tp
    p.dense_bf16 += cfg.n_routed_experts * d  # gate weight [E, d]
    p.dense_bf16 += cfg.n_shared_experts * 3 * inter * d  # shared w1, w3 [I/tp, d], w2 [d, I/tp]
    p.expert_bf16 += cfg.n_routed_experts // ep * 3 * inter * d
    return p


def param_counts(cfg: DeepSeekV4Config, tp: int = 1, ep: int = 1, pp: int = 1, stage: int = 0) -> Params:
    """Parameters of one rank of pipeline stage `stage` (every TP and EP rank holds as many)."""
    first, last = stage == 0, stage == pp - 1
    n, d, mtp = cfg.hc_mult, cfg.hidden_size, cfg.num_nextn_predict_layers
    p = Params()
    for i in stage_layers(cfg, pp, stage):
        q = _block_params(cfg, i, tp, ep)
        p.dense_bf16, p.dense_f32, p.expert_bf16 = (p.dense_bf16 + q.dense_bf16, p.dense_f32 + q.dense_f32,
                                                    p.expert_bf16 + q.expert_bf16)
    if first or (last and mtp):
        p.dense_bf16 += cfg.vocab_size // tp * d  # embed [V/tp, d] (the last stage's copy for MTP)
    if last:
        heads = 1 + mtp
        p.dense_f32 += heads * (n * n * d + n + 1)  # hc_head_{fn [n, n d], base [n], scale [1]} per head
        p.dense_bf16 += heads * d + cfg.vocab_size // tp * d  # final norms, LM head [V/tp, d]
        for k in range(mtp):
            q = _block_params(cfg, cfg.num_hidden_layers + k, tp, ep)
            p.dense_bf16 += q.dense_bf16 + 2 * d + 2 * d * d  # + enorm, hnorm, e_proj, h_proj [d, d]
            p.dense_f32 += q.dense_f32
            p.expert_bf16 += q.expert_bf16
    return p


def total_params(cfg: DeepSeekV4Config) -> int:
    return param_counts(cfg).count


def active_params(cfg: DeepSeekV4Config) -> int:
    """benchmarks/train_gpu.active_params: without idle routed experts and the embedding."""
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total_params(cfg) - idle * cfg.num_layers_total - cfg.vocab_size * cfg.hidden_size


@dataclass
class States:
    """Bytes of one rank's training state outside the step."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(p: Params, lay: Layout) -> States:
    """bf16 parameters (fp32 where the model keeps fp32), one fp32 gradient each (the DDP
    buffer), and the DistributedOptimizer's share: 4 B main copy (bf16 parameters only) + 8 B
    Adam moments per element (4 B in bf16), divided by the group the element is sharded over."""
    edp = max(lay.expert_dp, 1)  # an unbuildable layout: nothing to shard the experts over
    m = 2 * (BF16 if lay.moments == "bfloat16" else F32)  # the two moments of an element
    opt = ((F32 + m) * p.dense_bf16 + m * p.dense_f32) / lay.dense_dp
    opt += (F32 + m) * p.expert_bf16 / edp
    return States(p.nbytes, F32 * p.count, int(opt))


# --------------------------------------------------------------------------- activations
@dataclass
class Ledger:
    """Saved tensors of one micro-batch's forward: (module type that saves it, what, bytes)."""

    items: list[tuple[str, str, int]] = field(default_factory=list)

    def add(self, module: str, what: str, nbytes: int) -> None:
        if nbytes:
            self.items.append((module, what, int(nbytes)))

    @property
    def total(self) -> int:
        return sum(b for _, _, b in self.items)

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for mod, _, b in self.items:
            out[mod] = out.get(mod, 0) + b
        return out


def merged(*ledgers: Ledger) -> Ledger:
    return Ledger([it for L in ledgers for it in L.items])


@dataclass(frozen=True)
class Dims:
    """One rank's micro-batch: B rows of S positions, s = S/cp of them this rank's queries."""

    B: int
    S: int
    cp: int
    tp: int
    ep: int

    @property
    def s(self) -> int:
        return self.S // self.cp

    @property
    def t(self) -> int:  # this rank's tokens
        return self.B * self.s


def _rms(L: Ledger, lay: Layout, rows: int, width: int, weight: bool = True, scope: str = "RMSNorm",
         in_bytes: int = 2) -> None:
    """The fused kernel: its input (in_bytes an element) and rstd [rows] fp32. ops.rms_norm:
    x.float() (pow), rsqrt [rows, 1]; with a weight the normalised fp32 x and the weight's fp32
    copy (the product)."""
    if lay.fused_elementwise:
        L.add(scope, f"rms_norm input [{rows}, {width}]", in_bytes * rows * width)
        L.add(scope, f"rms_norm rstd [{rows}] fp32", F32 * rows)
        return
    L.add(scope, f"rms_norm x.float() [{rows}, {width}] fp32", F32 * rows * width)
    L.add(scope, f"rms_norm rsqrt [{rows}, 1] fp32", F32 * rows)
    if weight:
        L.add(scope, f"rms_norm x*rsqrt [{rows}, {width}] fp32", F32 * rows * width)
        L.add(scope, f"rms_norm weight.float() [{width}] fp32", F32 * width)


def _mhc_site(L: Ledger, scope: str, cfg: DeepSeekV4Config, lay: Layout, t: int) -> None:
    """hc_pre + hc_post (fused kernels) of one sublayer: the input streams, the sublayer output,
    and fp32 per token: with the gates kernel (fused_elementwise) |x| (1), the raw mixes (m),
    pre + eps (n), post (n), comb (n^2); without it also the rsqrt (1), the normalised mixes
    (m), the pre/post sigmoids (2n) and Sinkhorn's input (n^2)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    m = n * (n + 2)
    L.add(scope, f"streams X [{t}, {n}, {d}] bf16", BF16 * t * n * d)
    L.add(scope, f"sublayer output f [{t}, {d}] bf16", BF16 * t * d)
    per = 1 + m + 2 * n + n * n if lay.fused_elementwise else 2 + 2 * m + 4 * n + 2 * n * n
    L.add(scope, f"mixes, gates, Sinkhorn in/out [{t}, {per}] fp32", F32 * t * per)


def _compressor(L: Ledger, lay: Layout, B: int, G: int, r: int, width: int, overlap: bool,
                new_has_prev: bool) -> None:
    """Compressor.forward over G complete blocks of r tokens (projections gathered over CP):
    the gather indices of the current (and, CSA, previous) block, the pooled window's C and
    softmax(Z) [B, G, coff r, width] fp32, and the rms_norm of the entries."""
    slots = 2 * r if overlap else r
    L.add("Compressor", f"block token rows [{B} * {G} * {r}] int64", I64 * B * G * r * (2 if overlap else 1))
    if overlap and new_has_prev:
        L.add("Compressor", f"has_prev [{B}, {G}] bool", BOOL * B * G)
    L.add("Compressor", f"pool C and softmax(Z) [{B}, {G}, {slots}, {width}] fp32 x2", 2 * F32 * B * G * slots * width)
    _rms(L, lay, B * G, width, scope="Compressor", in_bytes=F32)


def _rope_tables(L: Ledger, dm: Dims, rd: int, kind: str, seen: set) -> None:
    """cos, sin fp32 that apply_rope saves: one rank (slices of the forward's [B, S, rd/2]
    tables, one pair per kind per forward); CP (this rank's positions, indexed out: a copy
    per layer)."""
    if dm.cp > 1:
        L.add("Attention", f"rope cos, sin [{dm.B}, {dm.s}, {rd // 2}] fp32 (this rank's positions)",
              2 * F32 * dm.t * rd // 2)
    elif ("rope", kind) not in seen:
        seen.add(("rope", kind))
        L.add("Attention", f"rope cos, sin [{dm.B}, {dm.S}, {rd // 2}] fp32 ({kind})", 2 * F32 * dm.B * dm.S * rd // 2)


def _attention(L: Ledger, cfg: DeepSeekV4Config, lay: Layout, dm: Dims, r: int, seen: set) -> None:
    """Attention.forward on the kernel path (sparse_attention kernel; the KL target from
    kernels.indexer.attention_mass, which keeps nothing)."""
    B, S, t, tp = dm.B, dm.S, dm.t, dm.tp
    d, D, H, rq = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads // tp, cfg.q_lora_rank
    rd, Hi, Di, W = cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window
    L.add("Linear", f"wq_a input [{t}, {d}] bf16 (also wkv's, the compressors' and the indexer's)", BF16 * t * d)
    _rms(L, lay, t, rq)  # q_norm
    L.add("_Column", f"wq_b input c_q [{t}, {rq}] bf16 (also the indexer's wq_b's)", BF16 * t * rq)
    # the weightless per-head norm of q and its RoPE (ops.norm_rope) keep the output, the kernel's q
    L.add("Attention", f"q norm rstd [{t * H}] fp32", F32 * t * H)
    _rope_tables(L, dm, rd, "compressed" if r else "swa", seen)
    _rms(L, lay, t, D)  # kv_norm of this rank's tokens (K = V is gathered over CP afterwards)
    G = S // r if r else 0
    K = 0
    if r:
        csa = cfg.is_csa(r)
        _compressor(L, lay, B, G, r, D, csa, new_has_prev=("has_prev", r) not in seen)
        seen.add(("has_prev", r))
        L.add("Attention", f"entry rope cos, sin [{B}, {G}, {rd // 2}] fp32", 2 * F32 * B * G * rd // 2)
        K = min(cfg.index_topk, G) if csa else G
        if csa and lay.indexer_loss:  # without its KL the indexer's graph is dropped after top-k
            if ("hadamard", Di) not in seen:  # one matrix per device (ops._hadamard_matrix's cache)
                seen.add(("hadamard", Di))
                L.add("Attention", f"Hadamard [{Di}, {Di}] fp32", F32 * Di * Di)
            L.add("Attention", f"index entry rope cos, sin [{B}, {G}, {rd // 2}] fp32", 2 * F32 * B * G * rd // 2)
            _compressor(L, lay, B, G, r, Di, True, new_has_prev=False)
            # kernels.indexer.indexer_scores keeps its inputs and the relu gate as bits
            L.add("Attention", f"indexer q [{t}, {Hi}, {Di}] bf16", BF16 * t * Hi * Di)
            L.add("Attention", f"indexer keys [{B}, {G}, {Di}] fp32", F32 * B * G * Di)
            L.add("Attention", f"indexer head weights [{t}, {Hi}] fp32", F32 * t * Hi)
            L.add("Attention", f"indexer relu gate bits [{t}, {Hi}, {-(-G // 32)}] int32", I32 * t * Hi * -(-G // 32))
            L.add("Attention", f"indexer score bounds [{t}] int32", I32 * t)
            L.add("Attention", f"KL: log_softmax, target [{t}, {G}] fp32, two masks bool", (2 * F32 + 2 * BOOL) * t * G)
            L.add("Attention", f"KL: rows [{t}] bool", BOOL * t)
    # the kernel: q, K = V keys of the rows [B, S + G, D], compacted index [t, W + K], o, lse
    L.add("Attention", f"kernel q [{t}, {H}, {D}] bf16", BF16 * t * H * D)
    L.add("Attention", f"kernel keys [{B}, {S + G}, {D}] bf16", BF16 * B * (S + G) * D)
    L.add("Attention", f"kernel index [{t}, {W + K}] int32 + count [{t}]", I32 * t * (W + K + 1))
    L.add("Attention", f"kernel o [{t}, {H}, {D}] bf16", BF16 * t * H * D)
    L.add("Attention", f"kernel lse [{t}, {H}] fp32", F32 * t * H)
    # ops.unrope_out_proj keeps the kernel's o and rotates it again in the backward
    og = cfg.o_groups // tp
    L.add("_Row", f"wo_b input [{t}, {og * cfg.o_lora_rank}] bf16", BF16 * t * og * cfg.o_lora_rank)


def _moe(L: Ledger, cfg: DeepSeekV4Config, lay: Layout, dm: Dims, is_hash: bool) -> None:
    """MoE.forward: gate, the routed experts' grouped path (ops.routed_experts, fused; EP: the
    all-to-all dispatch and combine of parallel_context), the shared expert."""
    B, t, tp, ep = dm.B, dm.t, dm.tp, dm.ep
    d, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    inter, E_l = cfg.moe_intermediate_size // tp, cfg.n_routed_experts // ep
    L.add("Gate", f"x [{t}, {d}] bf16", BF16 * t * d)
    L.add("Gate", f"logits, softplus, sqrt [{t}, {E}] fp32 x3", 3 * F32 * t * E)
    L.add("Gate", f"expert ids [{t}, {k}] int64, weights [{t}, {k}] and sum [{t}, 1] fp32",
          I64 * t * k + F32 * t * (k + 1))
    if lay.balance_loss and not is_hash:
        L.add("MoE", "balance loss terms", F32 * 2 * t + F32 * B * (1 + E) + BOOL * B)
    # (token, slot) pairs computed here: one rank, all t k of them; EP (balanced routing), the
    # t k pairs its EP group sends to its experts, one row each
    P = t * k
    M = P + GROUP_ALIGN * E_l  # rows of the grouped layout
    if ep > 1:
        L.add("MoE", f"dispatch: probs^T [{E}, {t}] fp32 + routing map bool, send order [{t * k}] int64",
              (F32 + BOOL) * E * t + I64 * t * k)
        L.add("MoE", f"combine: returned rows [{t * k}, {d}] bf16, pair order [{t * k}] int64",
              BF16 * t * k * d + I64 * t * k)
    # ops.routed_experts' dispatch and combine keep int maps only: the row of each of the P
    # pairs computed here, the token of each grouped row, the routing weights' gather index
    L.add("MoE", f"row of each pair [{P}] int64, token of each row and weight index [{M}] int64 x2",
          I64 * (P + 2 * M))
    L.add("MoE", f"grouped tokens [{M}, {d}] bf16", BF16 * M * d)
    L.add("MoE", f"group offsets [{E_l}] int32", I32 * E_l)
    if lay.fused_elementwise:
        L.add("MoE", f"SwiGLU g, u [{M}, {inter}] bf16 x2, weights [{M}] fp32", 2 * BF16 * M * inter + F32 * M)
    else:
        L.add("MoE", f"SwiGLU g, u, clamps, silu, product [{M}, {inter}] fp32 x6, weights [{M}]",
              6 * F32 * M * inter + F32 * M)
    L.add("MoE", f"w2 input [{M}, {inter}] bf16", BF16 * M * inter)
    if cfg.n_shared_experts:
        if lay.fused_elementwise:
            L.add("Expert", f"shared SwiGLU g, u [{t}, {inter}] bf16 x2", 2 * BF16 * t * inter)
        else:
            L.add("Expert", f"shared SwiGLU [{t}, {inter}] fp32 x5", 5 * F32 * t * inter)
        L.add("_Row", f"shared w2 input [{t}, {inter}] bf16", BF16 * t * inter)


def block_ledger(cfg: DeepSeekV4Config, lay: Layout, dm: Dims, layer: int, seen: set,
                 scope: str = "Block") -> Ledger:
    """Everything one block keeps for its backward (its mHC sites, norms, attention, MoE)."""
    L = Ledger()
    for _site in ("attn", "ffn"):
        _mhc_site(L, scope, cfg, lay, dm.t)
        _rms(L, lay, dm.t, cfg.hidden_size)  # attn_norm / ffn_norm
    _attention(L, cfg, lay, dm, cfg.layer_ratio(layer), seen)
    _moe(L, cfg, lay, dm, is_hash=layer < cfg.num_hash_layers)
    return L


def _head(L: Ledger, cfg: DeepSeekV4Config, lay: Layout, dm: Dims) -> None:
    """head_collapse (top level: mixes, gates, the streams) + final norm. The head itself runs
    in the loss (chunked), which keeps its input: loss_region_bytes counts it."""
    t, n, d = dm.t, cfg.hc_mult, cfg.hidden_size
    L.add("top-level", f"head streams [{t}, {n}, {d}] bf16", BF16 * t * n * d)
    per = 1 + 2 * n if lay.fused_elementwise else 2 + 4 * n  # |x|, raw mixes, pre (the gates kernel)
    L.add("top-level", f"head mixes, gates [{t}, {per}] fp32", F32 * t * per)
    _rms(L, lay, t, d)


def _embedding(L: Ledger, dm: Dims) -> None:
    """VocabParallelEmbedding: the ids [B, s] int64 (TP ranks: the shard-local copy, and the
    out-of-shard mask)."""
    L.add("VocabParallelEmbedding", f"ids [{dm.B}, {dm.s}] int64" + (" + mask" if dm.tp > 1 else ""),
          (I64 + (BOOL if dm.tp > 1 else 0)) * dm.t)


@dataclass
class StageLedgers:
    """One micro-batch on one stage: what stays outside the blocks, each block's own part (MTP
    apart: kept only when the MTP loss is on), and each block's input (what recompute keeps)."""

    outside: Ledger
    blocks: list[Ledger]
    mtp_outside: Ledger
    mtp_blocks: list[Ledger]
    block_input: int  # bytes of one block's input streams

    def kept(self, recompute: bool, mtp: bool = True) -> int:
        main = self.outside.total + (self.block_input * len(self.blocks) if recompute else
                                     sum(b.total for b in self.blocks))
        extra = self.mtp_outside.total + (self.block_input * len(self.mtp_blocks) if recompute else
                                          sum(b.total for b in self.mtp_blocks))
        return main + (extra if mtp else 0)

    def mtp_total(self, recompute: bool) -> int:
        return self.kept(recompute, True) - self.kept(recompute, False)

    def largest_block(self) -> int:
        return max((b.total for b in self.blocks + self.mtp_blocks), default=0)

    def ledger(self, mtp: bool = True) -> Ledger:
        return merged(self.outside, *self.blocks, *((self.mtp_outside, *self.mtp_blocks) if mtp else ()))


def stage_ledgers(cfg: DeepSeekV4Config, lay: Layout, stage: int = 0) -> StageLedgers:
    """Saved tensors of one micro-batch on pipeline stage `stage` (no recompute)."""
    dm = Dims(lay.mbs, lay.seq, lay.cp, lay.tp, lay.ep)
    t, n, d = dm.t, cfg.hc_mult, cfg.hidden_size
    out, mtp_out = Ledger(), Ledger()
    seen: set = set()
    first, last = stage == 0, stage == lay.pp - 1
    if first:
        _embedding(out, dm)
    blocks = [block_ledger(cfg, lay, dm, i, seen) for i in stage_layers(cfg, lay.pp, stage)]
    mtp_blocks = []
    if not last:
        # the stage output the 1F1B schedule keeps until its backward (deallocate_pipeline_outputs off)
        out.add("pipeline", f"stage output [{t}, {n * d}] bf16", BF16 * t * n * d)
    else:
        _head(out, cfg, lay, dm)
        if cfg.num_nextn_predict_layers:
            if not first or dm.tp > 1:  # one TP rank: the ids the first embedding kept
                _embedding(mtp_out, dm)
            _rms(mtp_out, lay, t, d)  # enorm
            mtp_out.add("Linear", f"e_proj input [{t}, {d}] bf16", BF16 * t * d)
            _rms(mtp_out, lay, t * n, d)  # hnorm over the streams
            mtp_out.add("Linear", f"h_proj input [{t}, {n}, {d}] bf16", BF16 * t * n * d)
            mtp_blocks.append(block_ledger(cfg, lay, dm, cfg.num_hidden_layers, set(), scope="MTPBlock"))
            _head(mtp_out, cfg, lay, dm)
    return StageLedgers(out, blocks, mtp_out, mtp_blocks, BF16 * t * n * d)


def stage_activations(cfg: DeepSeekV4Config, lay: Layout, stage: int = 0) -> tuple[Ledger, Ledger]:
    """(main, MTP) saved tensors of one micro-batch, no recompute (tests compare them with the model)."""
    sl = stage_ledgers(cfg, lay, stage)
    return merged(sl.outside, *sl.blocks), merged(sl.mtp_outside, *sl.mtp_blocks)


def logits_bytes(cfg: DeepSeekV4Config, lay: Layout) -> int:
    """One head's fp32 logits [t, V/tp] on the last stage."""
    return F32 * lay.mbs * (lay.seq // lay.cp) * (cfg.vocab_size // lay.tp)


def loss_region_bytes(cfg: DeepSeekV4Config, lay: Layout) -> int:
    """The loss head at its largest, beside the kept activations. The trainer's heads work in
    chunks of rows (ParallelContext.head_logprobs): at most HEAD_CHUNK_ELEMENTS fp32 logits at
    a time; the forward holds them (and, one TP rank without the fused kernels, cross-entropy's
    log-softmax; kernels.cross_entropy reads the logits for [c] row statistics), the backward
    one buffer (the logits turned into their gradient in place) and, on one TP rank, the
    weight-gradient GEMM's gathered bf16 operand (HEAD_WGRAD_BYTES at most) beside the weight's fp32 copy and gradient
    [V/tp, d] and the input's fp32 gradient [t, d]; and what the chunked head
    keeps per head: its input
    [t, d] (bf16; TP ranks: the fp32 copy copy_to_tp makes) and the rows' log-sum-exp, label
    ids and shard mask."""
    from plugins.deepseek_v4.parallel import HEAD_CHUNK_ELEMENTS, HEAD_WGRAD_BYTES

    t = lay.mbs * (lay.seq // lay.cp)
    heads = 1 + (cfg.num_nextn_predict_layers if lay.mtp_loss else 0)
    kept = heads * t * ((BF16 if lay.tp == 1 else F32) * cfg.hidden_size + F32 + I64 + BOOL)
    chunk = F32 * min(logits_bytes(cfg, lay) // F32, HEAD_CHUNK_ELEMENTS)
    # the gathered bf16 operand ([2t, V] at most), one TP rank only (TP ranks' fp32 head input: no gathering)
    operand = min(HEAD_WGRAD_BYTES, 2 * BF16 * logits_bytes(cfg, lay) // F32) if lay.tp == 1 else 0
    backward = chunk + operand + F32 * (2 * cfg.vocab_size // lay.tp + t) * cfg.hidden_size
    return max((2 if lay.tp == 1 and not lay.fused_elementwise else 1) * chunk, backward) + kept


def moe_transient_bytes(cfg: DeepSeekV4Config, lay: Layout) -> int:
    """One MoE layer's forward temporaries beside what it keeps: the rows entering the experts
    in fp32 and bf16 (to_tp_region's copies, TP > 1 only), the grouped output [M, d] bf16, the
    per-pair outputs (the torch path's take_rows; kernels.moe sums the slots in registers) and
    their fp32 sum."""
    t = lay.mbs * (lay.seq // lay.cp)
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    rows = t * k if lay.ep > 1 else t
    M = t * k + GROUP_ALIGN * cfg.n_routed_experts // lay.ep
    pairs = 0 if lay.fused_elementwise else BF16 * t * k * d
    copies = (F32 + BF16) * rows * d if lay.tp > 1 else 0
    return copies + BF16 * M * d + pairs + F32 * t * d


@dataclass
class StagePlan:
    stage: int
    params: Params
    states: States
    act_one: int  # one micro-batch's kept activations
    in_flight: int
    act: int  # in_flight x act_one (+ an MTP graph outside the loss)
    extra: int  # beside them at the peak: the loss head, one MoE layer's temporaries, a recomputed block
    flops: dict[str, float]

    @property
    def peak(self) -> int:
        return self.states.total + self.act + self.extra


def plan_stage(cfg: DeepSeekV4Config, lay: Layout, stage: int) -> StagePlan:
    p = param_counts(cfg, lay.tp, lay.ep, lay.pp, stage)
    sl = stage_ledgers(cfg, lay, stage)
    one = sl.kept(lay.recompute, lay.mtp_loss)
    in_flight = min(lay.pp - stage, lay.n_micro)  # 1F1B: warm-up forwards + the steady state's one
    # an MTP graph outside the loss still exists until the step function returns
    act = in_flight * one + (0 if lay.mtp_loss else sl.mtp_total(lay.recompute))
    # beside the kept activations at the peak, one of: the loss head (last stage), one MoE layer's
    # temporaries, or (recompute) a block's tensors, back while the backward runs it again; the loss
    # head is freed by the time the backward reaches the blocks
    extra = max(loss_region_bytes(cfg, lay) if stage == lay.pp - 1 else 0, moe_transient_bytes(cfg, lay),
                sl.largest_block() if lay.recompute else 0)
    return StagePlan(stage, p, state_bytes(p, lay), one, in_flight, act, extra, step_flops(cfg, lay, stage))


# --------------------------------------------------------------------------- FLOPs
@cache
def _keys_per_query(lo: int, hi: int, W: int, r: int, topk: int | None) -> int:
    """Sum over query positions p in [lo, hi) of the keys each attends: its window min(W, p+1)
    plus its compressed entries: min(topk, floor((p+1)/r)) (CSA) or floor((p+1)/r) (HCA)."""
    total = 0
    for p in range(lo, hi):
        g = (p + 1) // r if r else 0
        total += min(W, p + 1) + (min(topk, g) if topk is not None else g)
    return total


def rank_positions(S: int, cp: int, rank: int = 0) -> list[tuple[int, int]]:
    """parallel.cp_chunk: CP rank `rank` holds pieces rank and 2cp-1-rank of 2cp equal pieces."""
    if cp == 1:
        return [(0, S)]
    n = S // (2 * cp)
    return [(rank * n, (rank + 1) * n), ((2 * cp - 1 - rank) * n, (2 * cp - rank) * n)]


def _floor_sum(n: int, r: int) -> int:
    """sum of floor(m / r) for m = 1..n: the entries visible to queries at positions 0..n-1
    (floor((p + 1) / r) each), in closed form."""
    q, rem = divmod(n, r)
    return r * q * (q - 1) // 2 + q * (rem + 1)


def forward_flops(cfg: DeepSeekV4Config, lay: Layout, stage: int) -> dict[str, float]:
    """Forward FLOPs of one micro-batch on one rank of `stage` (CP rank 0; all CP ranks do the
    same causal work): 'matmul' (trained weights), 'attention' (sparse core), 'indexer' (CSA
    scores and their Hadamard rotations), 'kl_mass' (the KL target); the last two over each
    query's visible entries (the kernels skip the tiles past them; one document a row)."""
    B, S, s, tp = lay.mbs, lay.seq, lay.seq // lay.cp, lay.tp
    t = B * s
    n, d, D, H = cfg.hc_mult, cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads // tp
    m, rq, R, og = n * (n + 2), cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups // tp
    Hi, Di, E, k = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts, cfg.num_experts_per_tok
    inter = cfg.moe_intermediate_size // tp
    f = {"matmul": 0.0, "attention": 0.0, "indexer": 0.0, "kl_mass": 0.0}
    layers = list(stage_layers(cfg, lay.pp, stage))
    last = stage == lay.pp - 1
    if last:
        layers += [cfg.num_hidden_layers + j for j in range(cfg.num_nextn_predict_layers)]
    for i in layers:
        r = cfg.layer_ratio(i)
        mm = 2 * 2 * t * n * d * m  # mHC mixes of both sites
        mm += 2 * t * d * rq + 2 * t * rq * H * D + 2 * t * d * D  # wq_a, wq_b, wkv
        mm += 2 * t * H * D * R + 2 * t * og * R * d  # wo_a (grouped), wo_b
        mm += 2 * t * d * E + 3 * 2 * t * k * d * inter + cfg.n_shared_experts * 3 * 2 * t * d * inter
        G = S // r if r else 0
        csa = bool(r) and cfg.is_csa(r)
        if r:
            mm += 2 * 2 * t * d * (2 if csa else 1) * D  # compressor wkv, wgate (this rank's tokens)
        if csa:
            mm += 2 * t * rq * Hi * Di + 2 * t * d * Hi + 2 * 2 * t * d * 2 * Di  # indexer q, weights, compressor
            seen = B * sum(_floor_sum(hi, r) - _floor_sum(lo, r) for lo, hi in rank_positions(S, lay.cp))
            f["indexer"] += 2 * seen * Hi * Di + 2 * (t * Hi + B * G) * Di * Di  # scores + Hadamard rotations
            if lay.indexer_loss:
                f["kl_mass"] += 2 * seen * H * D
        f["matmul"] += mm
        f["attention"] += B * 4 * D * H * sum(_keys_per_query(lo, hi, cfg.sliding_window, r,
                                                              cfg.index_topk if csa else None)
                                              for lo, hi in rank_positions(S, lay.cp))
    if last:
        heads = 1 + cfg.num_nextn_predict_layers
        f["matmul"] += heads * (2 * t * d * cfg.vocab_size // tp + 2 * t * n * d * n)  # LM head, head collapse
        f["matmul"] += cfg.num_nextn_predict_layers * (2 * t * d * d + 2 * t * n * d * d)  # e_proj, h_proj (per stream)
    return f


# training FLOPs per forward FLOP: matmuls 1 + 2 (input and weight gradients); the attention
# kernels' backward recomputes the probabilities from lse (QK again, then dP, dQ, dK, dV: 2.5x);
# the indexer scores' backward takes one product per gradient of q and k through the gate the
# forward kept (1 + 2); recompute runs each block's forward twice
TRAIN_FACTOR = {"matmul": 3.0, "attention": 3.5, "indexer": 3.0, "kl_mass": 1.0}


def step_flops(cfg: DeepSeekV4Config, lay: Layout, stage: int) -> dict[str, float]:
    """One optimizer step on one rank: every micro-batch's forward and backward."""
    f = forward_flops(cfg, lay, stage)
    out = {k: lay.n_micro * (TRAIN_FACTOR[k] + (1 if lay.recompute and k != "kl_mass" else 0)) * v
           for k, v in f.items()}
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- calibration
# Measured on one H100 (`plan_memory.py --measure`): the ~1B config (train_gpu.config_1b) in the
# trainer (TrainWorker: Megatron DDP + DistributedOptimizer, bf16, kernels on), 2 micro-batches of
# 1 per step, LM loss with the indexer KL, one process per row. 'states': memory allocated after
# three steps; 'peak': torch.cuda.max_memory_allocated over the third step; 'kept': the saved
# tensors autograd still holds when one more forward (aux indexer + balance) returns, each storage
# once, parameters left out (the walk of tests/test_plan_memory.py; with recompute it sees the
# blocks' inputs, which the checkpoint saves), by the type of the innermost module that saved it
# first in 'modules'. All GiB. Some 'kept' entries were derived from an earlier walk by the
# ledger's exact difference after a change that drops saved tensors rather than walked again:
# which, by how much, and the peaks before each change are in kernels/NOTES.md ("plan_memory's
# calibration rows").
_UNFUSED_1B = [  # RMSNorm, RoPE and SwiGLU as PyTorch ops (model.fused_elementwise off)
    {"seq": 2048, "recompute": False, "params": 2.52, "states": 22.724, "kept": 4.3849, "peak": 28.149,
     "modules": {"MoE": 1.6826, "Attention": 0.6664, "RMSNorm": 0.7616, "Block": 0.4784, "Expert": 0.2655,
                 "_Row": 0.1665, "Compressor": 0.0894, "Linear": 0.0824, "Gate": 0.0594, "MTPBlock": 0.0598,
                 "top-level": 0.0468, "_Column": 0.0261}},
    {"seq": 4096, "recompute": False, "params": 2.52, "states": 22.717, "kept": 8.7503, "peak": 32.511,
     "modules": {"MoE": 3.2671, "Attention": 1.4046, "RMSNorm": 1.5243, "Block": 0.9614, "Expert": 0.5273,
                 "_Row": 0.334, "Compressor": 0.1796, "Linear": 0.1641, "Gate": 0.1204, "MTPBlock": 0.1202,
                 "top-level": 0.0943, "_Column": 0.0527}},
    {"seq": 8192, "recompute": False, "params": 2.52, "states": 22.714, "kept": 17.6730, "peak": 41.497,
     "modules": {"MoE": 6.4318, "Attention": 3.0933, "RMSNorm": 3.0469, "Block": 1.9192, "Expert": 1.053,
                 "_Row": 0.6678, "Compressor": 0.3595, "Linear": 0.3278, "Gate": 0.2403, "MTPBlock": 0.2399,
                 "top-level": 0.1882, "_Column": 0.1053}},
    {"seq": 4096, "recompute": True, "params": 2.52, "states": 22.711, "kept": 0.880, "peak": 24.654},
    {"seq": 8192, "recompute": True, "params": 2.52, "states": 22.709, "kept": 1.759, "peak": 26.316},
]
MEASURED_1B = [{**p, "fused_elementwise": False} for p in _UNFUSED_1B] + [
    # fused RMSNorm/RoPE/SwiGLU (the default); the forward's kept tensors and modules not walked
    # on the fused path. Measured before the row-move and log-softmax kernels, which drop
    # transients off this peak (the head's backward)
    {"seq": 4096, "recompute": False, "params": 2.52, "states": 22.724, "peak": 28.744, "fused_elementwise": True},
    {"seq": 4096, "recompute": True, "params": 2.52, "states": 22.711, "peak": 24.407, "fused_elementwise": True},
]
CALIBRATION = Layout(seq=4096, mbs=1, global_batch=2, loss="lm", name="train_gpu.py")
# accepted band of estimate / measured for the calibration rows (tests/test_plan_memory.py)
BAND = (0.95, 1.05)


def calibration(point: dict | None = None) -> dict:
    """The ~1B config on one GPU at a measured point: estimates and measurements (GiB)."""
    meas = point or MEASURED_1B[1]
    cfg = config_1b(meas["seq"])
    lay = replace(CALIBRATION, seq=meas["seq"], recompute=meas["recompute"],
                  fused_elementwise=meas.get("fused_elementwise", True))
    st = plan_stage(cfg, lay, 0)
    # the measured forward asked for both auxiliary losses (train_step, the peak: the indexer's only)
    sl = stage_ledgers(cfg, replace(lay, balance_loss=True), 0)
    est = {"params": st.states.params / GiB, "states": st.states.total / GiB, "kept": sl.kept(lay.recompute) / GiB,
           "peak": st.peak / GiB}
    mods = {k: v / GiB for k, v in sl.ledger().by_module().items()} if not lay.recompute else {}
    return {"cfg": cfg, "layout": lay, "plan": st, "estimate": est, "measured": meas, "modules": mods}


# --------------------------------------------------------------------------- report
def plan(cfg: DeepSeekV4Config, lay: Layout) -> list[StagePlan]:
    return [plan_stage(cfg, lay, st) for st in range(lay.pp)]


def job_files() -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(ROOT / "jobs" / "*dsv4*.yaml")))


def rows(include_constructible: bool = True, moments: str | None = None) -> list[tuple[str, DeepSeekV4Config, Layout]]:
    """The calibration point, then V4-Flash and V4-Pro at each job file's layout (moments: in
    place of the job files' train.optim.moments)."""
    out = [("~1B (calibration)", config_1b(CALIBRATION.seq), CALIBRATION)]
    for name, make in (("V4-Flash", v4_flash), ("V4-Pro", v4_pro)):
        cfg = make()
        for path in job_files():
            lay = job_layout(path)
            lay = replace(lay, moments=moments) if moments else lay
            out.append((name, cfg, lay))
            if include_constructible and lay.problems(cfg):
                out.append((name, cfg, constructible(lay, cfg)))
    return out


def _g(b: float) -> str:
    return f"{b / GiB:7.2f}"


def format_table(entries: list[tuple[str, DeepSeekV4Config, Layout]], all_stages: bool = False) -> str:
    hdr = (f"{'config':17s} {'job':16s} {'layout':22s} {'seq':>6s} {'st':>2s} {'params':>7s} {'param':>6s} "
           f"{'grad':>6s} {'optim':>6s} {'act x n':>11s} {'extra':>6s} {'peak':>7s} {'rc peak':>7s} {'TFLOP':>7s} "
           f"{'attn':>5s}")
    units = (f"{'':17s} {'':16s} {'':22s} {'':>6s} {'':>2s} {'count':>7s} {'GiB':>6s} {'GiB':>6s} {'GiB':>6s} "
             f"{'GiB':>11s} {'GiB':>6s} {'GiB':>7s} {'GiB':>7s} {'/step':>7s} {'':>5s}")
    lines, notes = [hdr, units, "-" * len(hdr)], {}
    for cname, cfg, lay in entries:
        stages = plan(cfg, lay)
        worst = max(stages, key=lambda p: p.peak)
        rc = max(p.peak for p in plan(cfg, replace(lay, recompute=True)))
        probs = lay.problems(cfg)
        if probs:
            who = notes.setdefault((lay.label(), "; ".join(probs)), [])
            who += [lay.name] if lay.name not in who else []
        for sp in stages if all_stages else [worst]:
            f = sp.flops
            lines.append(
                f"{cname:17s} {lay.name:16s} {lay.label() + (' !' if probs else ''):22s} "
                f"{lay.seq:6d} {sp.stage:2d} {sp.params.count / 1e9:6.2f}B {sp.states.params / GiB:6.2f} "
                f"{sp.states.grads / GiB:6.2f} {sp.states.optimizer / GiB:6.2f} "
                f"{sp.act / GiB:7.2f} x{sp.in_flight:<2d} "
                f"{sp.extra / GiB:6.2f} {_g(sp.peak)} {_g(rc)} {f['total'] / 1e12:7.0f} "
                f"{(f['attention'] + f['indexer']) / f['total']:5.0%}")
        ranks = lay.world // lay.pp
        tokens = lay.global_batch * lay.seq
        lines.append(f"{'':17s}   totals: {total_params(cfg) / 1e9:.1f}B params ({active_params(cfg) / 1e9:.1f}B "
                     f"active); {lay.world} ranks; {tokens:,} tokens a step ({lay.n_micro} micro-batches per DP "
                     f"rank); peaks summed {sum(p.peak for p in stages) * ranks / GiB:,.0f} GiB;")
        lines.append(f"{'':17s}   {sum(p.flops['total'] for p in stages) * ranks / 1e15:,.4g} PFLOP a step over all "
                     f"ranks (6 x active x tokens: {6 * active_params(cfg) * tokens / 1e15:,.4g}); slowest stage "
                     f"{max(p.flops['total'] for p in stages) / 1e12:,.0f} TFLOP")
    return "\n".join(lines + [""] + [f"! {lab} ({', '.join(who)}): {why}" for (lab, why), who in notes.items()])


def format_markdown(entries: list[tuple[str, DeepSeekV4Config, Layout]]) -> str:
    """The worst stage of each row as a markdown table (README)."""
    out = ["| config | job | layout | seq | stage | params | param / grad / optim GiB | act GiB x in flight "
           "| extra GiB | peak GiB | peak, recompute | TFLOP/step |", "|" + "---|" * 12]
    for cname, cfg, lay in entries:
        sp = max(plan(cfg, lay), key=lambda p: p.peak)
        rc = max(p.peak for p in plan(cfg, replace(lay, recompute=True)))
        st = sp.states
        out.append(f"| {cname} | {lay.name} | {lay.label()}{' !' if lay.problems(cfg) else ''} | {lay.seq} | "
                   f"{sp.stage} | {sp.params.count / 1e9:.2f}B | {st.params / GiB:.2f} / {st.grads / GiB:.2f} / "
                   f"{st.optimizer / GiB:.2f} | {sp.act / GiB:.1f} x {sp.in_flight} | {sp.extra / GiB:.2f} | "
                   f"{sp.peak / GiB:.1f} | {rc / GiB:.1f} | {sp.flops['total'] / 1e12:,.0f} |")
    return "\n".join(out)


def format_calibration() -> str:
    out = ["Calibration: the ~1B config (train_gpu.config_1b) on one H100, bf16, kernels on, 2 micro-batches of 1 "
           "(GiB, estimate / measured, ratio):"]
    for point in MEASURED_1B:
        cal = calibration(point)
        e, m = cal["estimate"], cal["measured"]
        out.append(f"  seq {m['seq']:5d}{' recompute' if m['recompute'] else '':10s}"
                   f"{' fused' if m['fused_elementwise'] else ' unfused':8s} " + "  ".join(
                       f"{key} {e[key]:.2f} / {m[key]:.2f} ({e[key] / m[key]:.3f})"
                       for key in ("params", "states", "kept", "peak") if key in m))
    point = next(p for p in MEASURED_1B if p["seq"] == CALIBRATION.seq and not p["recompute"] and "modules" in p)
    cal = calibration(point)
    out.append(f"  seq {point['seq']}, the forward's saved tensors by module:")
    for mod, meas in sorted(point["modules"].items(), key=lambda kv: -kv[1]):
        est = cal["modules"].get(mod, 0.0)
        out.append(f"    {mod:12s} {est:7.4f} / {meas:7.4f}  ({est / meas:.3f})")
    out.append("  No calibration factor is applied: every estimate is the shape ledger as is.")
    return "\n".join(out)


def measure() -> None:
    """GPU: the calibration points of MEASURED_1B measured again, each in a fresh process
    (states: allocated outside the step after two steps; peak: max allocated over the third
    step). Paste into MEASURED_1B."""
    import subprocess

    for i in range(len(MEASURED_1B)):
        subprocess.run([sys.executable, __file__, "--measure-point", str(i)], check=True)


def measure_point(i: int) -> None:
    import torch

    from benchmarks.train_gpu import config_1b
    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker

    w = TrainWorker(0, 1)
    w.init_distributed(*w.rendezvous_address())
    for point in MEASURED_1B[i:i + 1]:
        cfg = config_1b(point["seq"])
        w.build_model({**cfg.to_dict(), "kernels": "triton", "recompute": point["recompute"],
                       "fused_elementwise": point.get("fused_elementwise", True)}, seed=0, dtype="bfloat16")
        w.setup_training(lr=1e-4, warmup_steps=0, total_steps=1000)
        ids = torch.randint(0, cfg.vocab_size, (2, point["seq"] + 1), generator=torch.Generator().manual_seed(0))
        mbs = [MicroBatch.lm(ids[i:i + 1, :-1], ids[i:i + 1, 1:].contiguous()) for i in range(2)]
        w.train_step(mbs)
        w.train_step(mbs)
        torch.cuda.synchronize()
        states = torch.cuda.memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
        w.train_step(mbs)
        print(f"seq {point['seq']} recompute {point['recompute']}: states {states:.3f} GiB, "
              f"peak {torch.cuda.max_memory_allocated() / GiB:.3f} GiB (recorded: {point['peak']:.3f})", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="GPU: measure the ~1B calibration points again")
    ap.add_argument("--measure-point", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stages", action="store_true", help="print every pipeline stage, not only the worst")
    ap.add_argument("--modules", action="store_true", help="print the worst stage's saved tensors by module")
    ap.add_argument("--markdown", action="store_true", help="print the worst stages as a markdown table only")
    ap.add_argument("--moments", choices=["float32", "bfloat16"],
                    help="AdamW's moments for every job file (default: each file's train.optim.moments)")
    a = ap.parse_args(argv)
    if a.measure:
        measure()
        return
    if a.measure_point is not None:
        measure_point(a.measure_point)
        return
    entries = rows(moments=a.moments)
    if a.markdown:
        print(format_markdown(entries))
        return
    print("Per rank, on the pipeline stage with the largest peak ('st'): parameters, fp32 gradients, optimizer "
          "shard,\nkept activations x micro-batches in flight, 'extra' beside them at the peak (loss head on the last "
          "stage, else one MoE\nlayer's temporaries or a recomputed block), peak, the peak with model.recompute "
          "('rc'), TFLOP per optimizer step on that\nrank and the share of attention + indexer in it. '!': a layout "
          "the worker cannot build (below); '*': the same ranks with EP\nfrom DP x CP only.\n")
    print(format_table(entries, a.stages))
    print()
    print(format_calibration())
    if a.modules:
        for cname, cfg, lay in entries:
            sp = max(plan(cfg, lay), key=lambda p: p.peak)
            mods = stage_ledgers(cfg, lay, sp.stage).ledger(lay.mtp_loss).by_module()
            print(f"\n{cname} {lay.name or lay.label()} stage {sp.stage}, one micro-batch: " + ", ".join(
                f"{k} {v / GiB:.2f}" for k, v in sorted(mods.items(), key=lambda kv: -kv[1])) + " GiB")


if __name__ == "__main__":
    main()
