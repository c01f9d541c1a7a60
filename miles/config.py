"""The job config: one typed schema, read from a YAML job file plus dotted overrides, validated once.

    name: demo_tiny
    cluster: where the job runs (a Ray address or a local cluster; CPU or GPU workers)
    model:   the architecture (a preset or DeepSeek's config.json, field overrides), dtype, kernels
    data:    the data source
    train:   steps, batch sizes, seed, determinism, the parallel layout, the optimizer and LR schedule
    rollout: generation: engines, router, weight sync; RL's batch shape, sampling, placement, evaluation
    algo:    the loss, by name, and the auxiliary terms' weights; RL's advantages, clipping, rewards, KL
    ckpt:    what is saved
    log:     run directory, wandb, progress display, alignment records, profiling window

`load_job(path, ["train.optim.lr=1e-5", ...])` returns a validated `JobConfig` or raises
`JobConfigError`, whose message names the file and, per problem, the field, the value given
and what is allowed. Unknown keys are errors. Nothing here starts Ray or touches a device:
a bad job fails before any resource is taken.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError, model_validator

from miles.data.chat import ReasoningEffort
from miles.train.losses import LossCoefs
from plugins.deepseek_v4.config import ConfigError, DeepSeekV4Config

# Scalars are strict (a string is not a number, a number not a boolean); floats take ints.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0)]
Unit = Annotated[float, Strict(), Field(ge=0, lt=1)]


class JobConfigError(ValueError):
    """A job file or override is invalid; the message names every bad field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


# --------------------------------------------------------------------------- groups
class ClusterConfig(Section):
    address: Str | None = None  # a Ray cluster ("auto", "ray://host:10001", ...); None: $RAY_ADDRESS or a local one
    num_cpus: PosInt | None = None  # CPUs of the local cluster started for the job (default: the machine's)
    device: Literal["auto", "cpu", "gpu"] = "auto"  # auto: GPU workers when the cluster has a GPU per rank
    cpus_per_worker: PosFloat = 1.0  # Ray CPUs each training rank asks for (GPU jobs: one GPU each too)


PRESETS = {"tiny": DeepSeekV4Config.tiny, "small_50m": DeepSeekV4Config.small_50m}
# model.<name>, not overrides: they change how the model computes, not its weights
KERNEL_SWITCHES = ("kernels", "sm90_kernels", "sm90_kv_gradient", "overlap_chunks", "tf32_projections",
                   "fused_elementwise", "recompute", "cuda_graphs", "kv_quant", "head_keep_logits", "head_grad_terms")


def model_difference(a: dict, b: dict, skip: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """The first field (sorted) where two architectures differ, the kernel switches (which do
    not change the weights) and `skip` aside, and a note of the others (" (and N more: ...)"
    or ""); None where they agree."""
    ignore = set(KERNEL_SWITCHES) | set(skip)
    diff = [k for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)]
    if not diff:
        return None
    return diff[0], (f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else "")


class ModelConfig(Section):
    preset: Literal["tiny", "small_50m"] | None = None  # the tiny preset when neither this nor config is given
    config: Path | None = None  # a directory holding DeepSeek's config.json (or the file itself)
    overrides: dict[str, Any] = {}  # DeepSeekV4Config fields, e.g. {num_hidden_layers: 4}
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameters and activations (bf16: mixed precision)
    kernels: Literal["auto", "torch", "triton"] = "auto"  # GPU kernels; auto: on CUDA when triton is there
    sm90_kernels: Bool = True  # H100: the Gluon attention forward and dq pass (off: portable Triton)
    sm90_kv_gradient: Bool = True  # H100: the fast backward's kv gradient on the Gluon kernel (deterministic: portable)
    overlap_chunks: Bool = False  # CUDA: the attention backward's chunks on two streams
    tf32_projections: Bool = True  # bf16 on CUDA: fp32 projections on tensor cores (TF32 or bf16 GEMMs, fp32 sums)
    fused_elementwise: Bool = True  # GPU kernels on: norms, RoPE, SwiGLU, MoE row moves, head log-softmax fused
    recompute: Bool = False  # keep block inputs only, run each block again in the backward (memory for compute)
    cuda_graphs: Bool = False  # CUDA training: blocks as CUDA graphs (one process per replica: DP only, no recompute)
    kv_quant: Literal["fp8"] | None = None  # KV-QAT: K = V's non-RoPE channels rounded to FP8 (block 64, fp32
    # scales) as DeepSeek's runtime caches them, in training and in the embedded engine (whose key cache holds them
    # in FP8 with their scales)
    head_keep_logits: Bool = False  # the LM/MTP heads' backward reads the forward's fp32 logits instead of computing
    # them again (speed for memory: 4 bytes a token and vocabulary entry per head until the backward)
    head_grad_terms: Literal[1, 2] = 2  # bf16 terms of the heads' logit gradient in the backward GEMMs: 2 gives the
    # fp32 head's gradients (to 2^-17), 1 rounds it to bf16 as a bf16 head would (faster)
    _arch: DeepSeekV4Config = PrivateAttr()

    @model_validator(mode="after")
    def _build(self) -> ModelConfig:
        if self.preset is not None and self.config is not None:
            raise ValueError("model.preset and model.config: give one of them (a preset, or a directory with "
                             "DeepSeek's config.json)")
        for k in KERNEL_SWITCHES:
            if k in self.overrides:
                raise ValueError(f"model.overrides.{k}: set model.{k} instead")
        try:
            if self.config is None:
                arch = PRESETS[self.preset or "tiny"]()
            else:
                path = self.config / "config.json" if self.config.is_dir() else self.config
                if not path.is_file():
                    raise ValueError(f"model.config: no config.json at {self.config}")
                arch = DeepSeekV4Config.from_pretrained(path.parent)
            switches = {k: getattr(self, k) for k in KERNEL_SWITCHES}
            self._arch = DeepSeekV4Config.from_dict({**arch.to_dict(), **self.overrides, **switches}, source="model")
        except ConfigError as e:  # "model: field 'x' must be ..." -> "model.overrides.x: must be ..."
            m = re.match(r"model: (unknown field|missing field|field) '([^']+)'\s*(.*)", str(e))
            if not m:
                raise ValueError(str(e)) from None
            what = {"unknown field": "unknown field", "missing field": "missing"}.get(m[1], "")
            raise ValueError(f"model.overrides.{m[2]}: {' '.join(x for x in (what, m[3]) if x)}") from None
        return self

    @property
    def arch(self) -> DeepSeekV4Config:
        """The validated DeepSeek-V4 architecture (preset or file, overrides and kernels applied)."""
        return self._arch


class DataConfig(Section):
    """synthetic: bundled arithmetic progressions (miles.data.synthetic), evaluated by generation
    after the last step. chat: conversations from JSONL/Parquet for SFT (miles.data.sft), with
    DeepSeek-V4's loss masks (miles.data.chat), packed into rows of seq_len positions.
    prompts: RL prompts with the label their reward is checked against (miles.data.prompts;
    `miles rl`), rendered with the same template and tokenizer keys as chat."""

    source: Literal["synthetic", "chat", "prompts"] = "synthetic"  # see above; chat: SFT, prompts: RL
    seq_len: Annotated[int, Strict(), Field(ge=3)] = 64  # positions per row (chat: the longest conversation;
    # prompts: the packed training rows, at least rollout.max_len)
    eval_size: NonNegInt = 0  # held-out sequences (synthetic) or conversations (chat; 0 with eval_path: all)
    # -- chat and prompts only
    path: Str | None = None  # a .jsonl/.parquet file, a directory of shards or a glob (relative: to the cwd)
    eval_path: Str | None = None  # the held-out split; default: the first eval_size rows of path
    eval_interval: NonNegInt = 0  # evaluate every N steps (and before the first, after the last); 0: ends only
    tokenizer: Str | None = None  # a tokenizer.json; "tiny": the bundled 512-id BPE; default DeepSeek-V4's
    template: Literal["deepseek_v4", "hf"] = "deepseek_v4"  # deepseek-recipe's V4 encoding, or data.tokenizer's
    # own chat template (hf: a local transformers tokenizer directory)
    thinking: Bool = False  # thinking mode for rows that do not say (a row's own `thinking` wins)
    thinking_turns: Literal["last", "expand"] = "last"  # thinking without tools: a sample per last / every turn
    reasoning_effort: ReasoningEffort | None = None  # thinking mode's preamble; None: the recipe's default
    on_bad_row: Literal["skip", "error"] = "skip"  # skip: report, count (data/skipped_rows) and go on
    shuffle_buffer: NonNegInt = 10000  # samples in the streaming shuffle (0: file order)
    eval_name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_.-]+$")] = "heldout"  # prompts: eval/<name>/...

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        chat_keys = ("path", "eval_path", "tokenizer")
        if self.source == "synthetic":
            given = [k for k in chat_keys if getattr(self, k) is not None]
            if given:
                raise ValueError(f"data.{given[0]}: only for data.source: chat or prompts")
            return self
        if self.path is None:
            what = "conversations" if self.source == "chat" else "prompts"
            raise ValueError(f"data.path: missing (data.source: {self.source} reads {what} from a file, directory "
                             "or glob)")
        from miles.data.dataset import dataset_files
        from miles.data.sft import tokenizer_path

        for key in ("path", "eval_path"):
            if getattr(self, key) is not None:
                try:
                    dataset_files(getattr(self, key))
                except (FileNotFoundError, ValueError) as e:
                    raise ValueError(f"data.{key}: {e}") from None
                setattr(self, key, os.path.abspath(getattr(self, key)))
        if self.template == "hf":
            if self.tokenizer is None or not Path(self.tokenizer).is_dir():
                raise ValueError(f"data.tokenizer: data.template hf needs a local tokenizer directory with a chat "
                                 f"template, got {self.tokenizer!r}")
            self.tokenizer = os.path.abspath(self.tokenizer)
            return self
        tok = tokenizer_path(self.tokenizer)
        if tok is not None:
            if not Path(tok).is_file():
                raise ValueError(f"data.tokenizer: {tok}: no such tokenizer.json (or \"tiny\", or leave it out for "
                                 "DeepSeek-V4's)")
            if self.tokenizer != "tiny":
                self.tokenizer = os.path.abspath(tok)
        return self


class ParallelConfig(Section):
    tp: PosInt = 1  # tensor parallel: attention heads, expert FFNs and the vocabulary split
    pp: PosInt = 1  # pipeline stages (layers split, 1F1B schedule)
    ep: PosInt = 1  # expert parallel: routed experts split (carved from dp x cp)
    cp: PosInt = 1  # context parallel: each sequence split along positions
    dp: PosInt = 1  # data parallel replicas (world = tp x pp x cp x dp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths must be multiples of this: 2 x cp pieces under context parallelism
        (each rank takes one piece from each end: equal causal work), else 1."""
        return 2 * self.cp if self.cp > 1 else 1

    @model_validator(mode="after")
    def _ep_divides(self) -> ParallelConfig:
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"train.parallel.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert ranks are "
                             f"carved from the data and context ranks (each TP rank holds a width slice of its "
                             f"experts, so Megatron needs tp x ep x pp to divide the world)")
        return self


class OptimConfig(Section):
    """AdamW (Megatron's DistributedOptimizer) with linear warm-up and a decay to min_lr."""

    lr: PosFloat = 1e-5  # peak learning rate, reached after warmup_steps
    min_lr: NonNegFloat | None = None  # the last step's lr; default lr / 10 (0 would make the last step a no-op)
    warmup_steps: NonNegInt = 0  # optimizer steps of linear warm-up from 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # lr -> min_lr over the run's optimizer steps
    weight_decay: NonNegFloat = 0.0  # AdamW's decoupled decay
    beta1: Unit = 0.9  # Adam's first-moment decay
    beta2: Unit = 0.999  # Adam's second-moment decay
    eps: PosFloat = 1e-8  # Adam's denominator term
    clip_grad: NonNegFloat = 1.0  # max global grad norm; 0 = no clipping
    moments: Literal["float32", "bfloat16"] = "float32"  # AdamW's two moments as kept between steps: bfloat16
    # halves their memory (4 bytes a parameter: 17 GiB a GPU for V4-Flash at the job files' layout), as DeepSeek-V3
    # trained; each step still computes them in fp32 (from the kept values) and updates the fp32 weights from those
    overlap_grad_reduce: Bool = True  # reduce-scatter each bucket of gradients over the data-parallel ranks while the
    # backward of the step's last micro-batch goes on (off: the whole buffer after the backward)

    @model_validator(mode="after")
    def _min_lr(self) -> OptimConfig:
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if self.min_lr > self.lr:
            raise ValueError(f"train.optim.min_lr={self.min_lr} must be <= train.optim.lr={self.lr}")
        return self


class TrainConfig(Section):
    steps: PosInt = 100  # optimizer steps; in RL jobs rollouts (each updates_per_rollout optimizer steps)
    global_batch_size: PosInt = 8  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: PosInt = 1  # sequences per forward/backward
    seed: Int = 0  # weights (seeded per tensor name) and data
    deterministic: Bool = False  # bit-identical reruns: deterministic kernels, no atomics
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()

    @model_validator(mode="after")
    def _batches(self) -> TrainConfig:
        per = self.parallel.dp * self.micro_batch_size
        if self.global_batch_size % per:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                             f"train.parallel.dp x train.micro_batch_size = {per}")
        return self


class RolloutConfig(Section):
    """Generation: engines (ours or SGLang's) behind SGLang's router, and weight sync."""

    engine: Literal["embedded", "sglang"] = "embedded"  # sglang: GPU clusters with SGLang installed
    num_engines: PosInt = 1  # rollout engines behind the router
    cpus_per_engine: PosFloat = 1.0  # Ray CPUs each engine asks for
    gpus_per_engine: NonNegFloat = 0.0  # 0 on CPU clusters; > 0 on GPUs (RL refuses 0 there; colocated: below 1)
    max_running: PosInt = 64  # sequences one engine decodes together
    max_len: PosInt = 4096  # prompt + generated tokens per sequence
    prefill_tokens: PosInt = 8192  # prompt tokens prefilled an iteration (longer prompts: in chunks)
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"  # sglang-router
    router_args: list[Str] = []  # more sglang-router flags, passed through unchanged
    concurrency: PosInt = 256  # requests in flight through the router
    request_timeout: PosFloat = 600.0  # seconds per /generate request; a timed-out sample is re-queued
    max_attempts: PosInt = 5  # tries per sample before the rollout fails
    health_interval: PosFloat = 2.0  # seconds between engine health checks
    health_timeout: PosFloat = 10.0  # a /health answer slower than this counts as a failure
    health_failures: PosInt = 2  # consecutive failures before an engine is replaced
    hang_timeout: PosFloat = 60.0  # an engine with work and no decoding step for this long is unhealthy
    startup_timeout: PosFloat = 1800.0  # seconds an engine may take to start and load its weights (first ones and
    # replacements; a V4-Flash SGLang engine takes minutes)
    sync: Literal["object_store", "broadcast", "disk", "shared"] = "object_store"  # weight-sync path: broadcast (a
    # gloo/nccl group), disk (DeepSeek's HF layout written by the trainer's ranks, loaded by each engine: SGLang's
    # path), shared (colocated engines open the trainer's buffers in place: CUDA IPC on GPUs, no host copy)
    sync_dir: Str | None = None  # sync: disk: where each version is written (default <run_dir>/weights;
    # with several nodes, a filesystem every node shares)
    bucket_mb: PosInt = 256  # weight-sync bucket size
    tokenizer: Str | None = None  # text in and out of the engines (default: data.tokenizer)
    sglang: dict[str, Any] = {}  # engine: sglang: every key becomes --key value of sglang.launch_server
    # -- RL (`miles rl`): a rollout is rollout_batch_size prompts x n_samples_per_prompt responses
    rollout_batch_size: PosInt = 32  # prompts (groups) per rollout, after dynamic sampling
    n_samples_per_prompt: PosInt = 8  # responses per prompt (the group of GRPO's advantages)
    over_sampling: Annotated[float, Strict(), Field(ge=1)] = 1.0  # prompts generated per round / needed
    dynamic_sampling: Bool = True  # DAPO: drop groups whose rewards are all equal, generate more
    max_rounds: PosInt = 4  # generation rounds to fill one rollout before the job fails
    max_new_tokens: PosInt = 512  # tokens generated per response (per turn with generate_fn; longer: truncated)
    generate_fn: Str | None = None  # "module:function": async fn(client, sample) -> Transcript (multi-turn, tools;
    # miles/rollout/multiturn.py); trained on the policy's tokens only. Default: one response per prompt
    tools: list[Str] = []  # "module:function" Python tools the policy may call (DSML tool calls, parsed by
    # deepseek-recipe; miles/rollout/tool_use.py); their schemas go into every prompt. Default generate_fn with tools:
    # miles.rollout.tool_use:generate
    temperature: NonNegFloat = 1.0  # sampling temperature of rollouts (0: greedy)
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0  # nucleus sampling (1: off)
    top_k: Int = -1  # -1: off
    truncated_sampling: Bool = False  # allow top_p < 1 or top_k in an RL job: the engine then samples from a
    # truncated distribution whose log-probs the trainer does not reproduce (the importance ratios are off)
    placement: Literal["disaggregated", "colocated"] = "disaggregated"  # colocated: the trainer sleeps while
    # engines generate, engines release memory while it trains (on GPUs: engine e shares trainer rank e's GPU,
    # gpus_per_engine a share of it such as 0.5; embedded engines)
    off_policy: Bool = False  # one-step-off: generate rollout k+1 while training on k (staleness 1)
    eval_interval: NonNegInt = 0  # evaluate on data's held-out prompts every N rollouts (and first, last)
    eval_samples: PosInt = 4  # responses per held-out prompt (avg@k)
    eval_temperature: NonNegFloat = 1.0  # of held-out evaluation
    eval_top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0  # DAPO evaluates AIME at 0.7


class AlgoConfig(Section):
    loss: Literal["lm", "policy"] = "lm"  # miles.train.losses: "lm" = cross-entropy of the labels (pre-training,
    # SFT); "policy" = the clipped policy-gradient loss of RL (`miles rl`)
    mtp_loss_coef: NonNegFloat | None = None  # the multi-token-prediction heads' loss weight; default 0.3 for lm,
    # 0 for policy (RL: MTP's cross-entropy on the policy's own samples, wrong ones too, is supervised training)
    indexer_loss_coef: NonNegFloat = LossCoefs.indexer  # the lightning indexer's KL to the attention (0: untrained)
    balance_loss_coef: NonNegFloat = LossCoefs.balance  # sequence-level expert balance (V4 balances by router bias)
    # -- RL (docs/algorithms.md)
    advantage: Literal["grpo", "dr_grpo"] = "grpo"  # group-normalised (grpo) or mean-centred only (dr_grpo)
    eps_low: NonNegFloat = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: NonNegFloat = 0.28  # clip-higher
    dual_clip: Annotated[float, Strict(), Field(gt=1)] | None = None  # e.g. 3: caps -A * ratio for A < 0
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"  # DAPO's
    norm_len: PosInt | None = None  # Dr. GRPO's constant length (default rollout.max_new_tokens)
    tis_cap: PosFloat | None = None  # truncated importance sampling cap (default 2.0 with rollout.off_policy)
    kl_coef: NonNegFloat = 0.0  # KL to the reference (the starting weights, kept on the host); DAPO: 0
    kl_reference: Path | None = None  # the KL reference's weights (DeepSeek's HF layout) instead of the weights
    # the run started from; a resumed run keeps its reference: name it here if those weights are gone
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k3: the low-variance estimator
    reward: Str = "dapo"  # dapo (the `Answer:` verifier, +1/-1), math (math-verify), or "module:function"
    reward_url: Str | None = None  # instead: POST {"response", "label", "prompt"} -> {"reward": r}
    reward_timeout: PosFloat = 30.0  # seconds per reward call: a remote request (retried 3 times), a local function
    reward_timeout_score: Float = -1.0  # what a local reward call that timed out scores (DAPO's wrong answer)
    reward_concurrency: PosInt = 64  # reward calls in flight (remote, async functions); sync functions and the math
    # verifier run in min(this, CPUs) processes
    overlong_max_len: PosInt | None = None  # DAPO's overlong shaping: L_max (response tokens) ...
    overlong_cache: PosInt | None = None  # ... and the buffer L_cache before it
    # -- the MoE router in training (docs/rl.md)
    freeze_router_bias: Bool | None = None  # keep the aux-loss-free selection bias as loaded (default: frozen for
    # policy-loss jobs, updated for lm jobs). RL's tokens are the policy's own samples, few and correlated: a bias
    # that chases their loads moves the engines' routing away from what pre-training balanced, for no gain in
    # reward. The loads are still counted and logged (train/router_load_max_over_mean).
    freeze_router: Bool = False  # the gate weights out of the optimizer (they get no updates)
    routing_replay: Bool | None = None  # the trainer's forward on rollout tokens takes the experts the engine
    # used (R3; the router still gets its gradient). Default: on for policy-loss jobs with the embedded engine and
    # no generate_fn (the only setup that returns the experts today)
    indexer_replay: Bool = False  # the same for the CSA indexer's top-k compressed entries of every token (off:
    # index_topk block numbers per CSA layer and token is large, ~21 KB a token at V4-Flash's shape; needs the
    # setup routing replay needs)

    @model_validator(mode="after")
    def _rl(self) -> AlgoConfig:
        if (self.overlong_max_len is None) != (self.overlong_cache is None):
            raise ValueError("algo.overlong_max_len and algo.overlong_cache: give both or neither")
        if self.overlong_cache is not None and self.overlong_cache > self.overlong_max_len:
            raise ValueError(f"algo.overlong_cache={self.overlong_cache} exceeds algo.overlong_max_len="
                             f"{self.overlong_max_len}")
        if self.reward not in ("dapo", "math") and ":" not in self.reward:
            raise ValueError(f"algo.reward: {self.reward!r} is not dapo, math or \"module:function\"")
        if self.kl_reference is not None:
            if self.kl_coef == 0:
                raise ValueError("algo.kl_reference is set but algo.kl_coef is 0: no KL term would use it")
            if not (Path(self.kl_reference) / "config.json").is_file():
                raise ValueError(f"algo.kl_reference: {self.kl_reference}: not an HF checkpoint directory "
                                 "(no config.json)")
            self.kl_reference = Path(os.path.abspath(self.kl_reference))
        if self.mtp_loss_coef is None:  # RL trains MTP only when the job asks for it
            self.mtp_loss_coef = 0.0 if self.loss == "policy" else LossCoefs.mtp
        if self.freeze_router_bias is None:
            self.freeze_router_bias = self.loss == "policy"
        return self

    def policy_options(self, rollout: RolloutConfig) -> dict:
        """The trainer's PolicyOptions: truncated IS on by default in the one-step-off mode; the
        log-probs taken at the rollouts' sampling temperature, as the engines report them (greedy
        rollouts: temperature 1)."""
        tis = self.tis_cap if self.tis_cap is not None else (2.0 if rollout.off_policy else None)
        return {"eps_low": self.eps_low, "eps_high": self.eps_high, "dual_clip": self.dual_clip, "tis_cap": tis,
                "kl_coef": self.kl_coef, "kl_estimator": self.kl_estimator,
                "temperature": rollout.temperature or 1.0}


class CkptConfig(Section):
    """Checkpoints (miles.ckpt): iter_NNNNNNN/ holds the state after N steps of train.steps
    (optimizer steps; in RL jobs rollouts, each updates_per_rollout optimizer steps); resuming
    from it runs step N+1. Intervals count the same steps. Retained: the newest, multiples of
    keep_every, the keep_last newest."""

    save_dir: Path | None = None  # default <run_dir>/checkpoints; a shared filesystem on multi-node clusters
    save_interval: NonNegInt = 0  # save every N steps (0: only after the last step)
    keep_every: PosInt | None = None  # keep iterations that are multiples of this for good
    keep_last: PosInt | None = None  # keep the N newest (None: all)
    warmup_save: Bool = True  # a save right after step 1 (a broken save path fails in minute one), and after the
    # first step of a resumed process that saves asynchronously (its writer is new); reaped later
    async_save: Bool = False  # write in the background while training goes on
    save_hf: Bool = False  # write the final weights in DeepSeek's HF layout to <run_dir>/hf
    load: Str | None = None  # a checkpoint (iter_ directory or a save_dir), or auto: save_dir's newest if any
    hf: Path | None = None  # start from DeepSeek's HF checkpoint (a directory of safetensors shards)

    @model_validator(mode="after")
    def _paths(self) -> CkptConfig:
        if self.load is not None and self.load != "auto":
            if not Path(self.load).exists():
                raise ValueError(f"ckpt.load: {self.load}: no such checkpoint (a directory, or auto)")
            self.load = os.path.abspath(self.load)
        if self.hf is not None:
            if not (Path(self.hf) / "config.json").is_file():
                raise ValueError(f"ckpt.hf: {self.hf}: not an HF checkpoint directory (no config.json)")
            self.hf = Path(os.path.abspath(self.hf))
        if self.save_dir is not None:
            self.save_dir = Path(os.path.abspath(self.save_dir))
        return self


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = "offline"  # online needs WANDB_API_KEY in the environment
    project: Str = "miles"  # wandb project, entity, group, name and tags of the run
    entity: Str | None = None
    group: Str | None = None
    name: Str | None = None  # default: the run directory's name
    tags: list[Str] = []


class ProfileConfig(Section):
    """torch.profiler over steps [start_step, start_step + num_steps) on the listed ranks;
    traces go to <run_dir>/profile/. Shapes, stacks and memory are off by default (stack
    capture is known to stall NCCL at scale)."""

    enabled: Bool = False
    start_step: PosInt = 2
    num_steps: PosInt = 1
    ranks: list[NonNegInt] | None = None  # default: the first rank of the pipeline's first, middle and last stage
    record_shapes: Bool = False
    with_stack: Bool = False
    profile_memory: Bool = False


class TraceConfig(Section):
    """Attention internals of chosen layers captured during chosen steps on chosen ranks, for
    replay and debugging: <run_dir>/trace/step<k>/rank<r>/layer<l>.safetensors, one set of
    tensors per forward of the step (plugins/deepseek_v4/forward.py Trace says which). Off:
    nothing is captured and nothing is checked per layer but one None."""

    enabled: Bool = False
    steps: list[PosInt] = [1]
    layers: list[NonNegInt] = [0]  # block indices (MTP blocks follow the main layers)
    ranks: list[NonNegInt] = [0]
    what: list[Literal["input", "q", "kv", "entries", "chosen", "lse", "output"]] = [
        "input", "q", "kv", "entries", "chosen", "lse", "output"]


class LogConfig(Section):
    run_dir: Path | None = None  # default runs/<name>-<time>, resolved when the job is validated
    interval: PosInt = 1  # a log line every N steps (metrics.jsonl and wandb get every step)
    progress: Literal["auto", "bar", "lines"] = "auto"  # auto: a bar on a terminal, lines otherwise
    alignment: Bool = False  # per-step loss and gradient checksums for `miles check-alignment`
    rollouts: Literal["all", "none"] | PosInt = 64  # RL's rollouts.jsonl, per rollout: every response's text
    # (all: GBs a day at scale), N responses chosen at random (seeded by the step), or none; the prompt
    # ids drawn and kept are always written
    wandb: WandbConfig = WandbConfig()
    profile: ProfileConfig = ProfileConfig()
    trace: TraceConfig = TraceConfig()


JobName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)]


class JobConfig(Section):
    name: JobName = "job"  # names the run directory and the wandb run
    _notes: list[str] = PrivateAttr(default_factory=list)  # what loading changed, for the user (load_job)
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    ckpt: CkptConfig = CkptConfig()
    log: LogConfig = LogConfig()

    @model_validator(mode="after")
    def _across_groups(self) -> JobConfig:
        able = (self.algo.loss == "policy" and self.rollout.engine == "embedded" and self.rollout.generate_fn is None
                and not self.rollout.tools)
        if self.algo.routing_replay is None:
            self.algo.routing_replay = able
        elif self.algo.routing_replay and not able:
            raise ValueError("algo.routing_replay needs algo.loss: policy, rollout.engine: embedded and no "
                             "rollout.generate_fn (SGLang's experts and multi-turn transcripts are not carried yet)")
        if self.algo.indexer_replay and not able:
            raise ValueError("algo.indexer_replay needs algo.loss: policy, rollout.engine: embedded and no "
                             "rollout.generate_fn (only the embedded engine returns the indexer's choices)")
        cp, multiple = self.train.parallel.cp, self.train.parallel.seq_multiple
        if self.data.seq_len % multiple:
            raise ValueError(f"data.seq_len={self.data.seq_len} must be a multiple of {multiple} (2 x "
                             f"train.parallel.cp={cp}: each context-parallel rank takes two pieces)")
        if self.algo.balance_loss_coef > 0 and cp > 1:
            raise ValueError("algo.balance_loss_coef > 0 needs train.parallel.cp = 1 (the balance term is per "
                             "whole sequence)")
        if self.model.arch.num_hidden_layers < self.train.parallel.pp:
            raise ValueError(f"train.parallel.pp={self.train.parallel.pp} exceeds the model's "
                             f"{self.model.arch.num_hidden_layers} layers")
        if self.model.arch.n_routed_experts % self.train.parallel.ep:
            raise ValueError(f"train.parallel.ep={self.train.parallel.ep} must divide the model's "
                             f"{self.model.arch.n_routed_experts} routed experts")
        tp, arch = self.train.parallel.tp, self.model.arch
        for field in ("num_attention_heads", "o_groups", "moe_intermediate_size", "vocab_size"):  # split over TP
            if getattr(arch, field) % tp:
                raise ValueError(f"train.parallel.tp={tp} must divide the model's {field} ({getattr(arch, field)})")
        if self.data.source == "prompts" or self.algo.loss == "policy":
            self._check_rl()
        if self.train.optim.warmup_steps >= self.optimizer_steps:
            of = f"train.steps={self.train.steps}" + (
                f" rollouts x {self.updates_per_rollout} updates" if self.algo.loss == "policy" else "")
            raise ValueError(f"train.optim.warmup_steps={self.train.optim.warmup_steps} must be below the run's "
                             f"{self.optimizer_steps} optimizer steps ({of})")
        if self.data.source in ("chat", "prompts"):
            from miles.data.sft import tokenizer_path, vocab_size

            ids = vocab_size(tokenizer_path(self.data.tokenizer), self.data.template)
            if ids > arch.vocab_size:
                raise ValueError(f"data.tokenizer has {ids} ids but the model's vocab_size is {arch.vocab_size} "
                                 f"(a model with at least {ids}, or a smaller tokenizer: data.tokenizer: tiny)")
        t = self.log.trace
        if t.enabled and [r for r in t.ranks if r >= self.train.parallel.world]:
            raise ValueError(f"log.trace.ranks {[r for r in t.ranks if r >= self.train.parallel.world]} are not ranks "
                             f"of this job (0..{self.train.parallel.world - 1})")
        layers = self.model.arch.num_hidden_layers + self.model.arch.num_nextn_predict_layers
        if t.enabled and [x for x in t.layers if x >= layers]:
            raise ValueError(f"log.trace.layers {[x for x in t.layers if x >= layers]} are not layers of this model "
                             f"(0..{layers - 1}, MTP blocks after the main ones)")
        bad = [r for r in self.log.profile.ranks or () if r >= self.train.parallel.world]
        if self.log.profile.enabled and bad:
            raise ValueError(f"log.profile.ranks {bad} are not ranks of this job (0..{self.train.parallel.world - 1})")
        if self.log.run_dir is None:
            self.log.run_dir = Path("runs") / f"{self.name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        if self.ckpt.save_dir is None:
            self.ckpt.save_dir = Path(os.path.abspath(self.log.run_dir)) / "checkpoints"
        if self.ckpt.load not in (None, "auto") and self.ckpt.hf is not None:
            raise ValueError("ckpt.load and ckpt.hf: give one (a checkpoint resumes training; an HF checkpoint "
                             "starts it; with ckpt.load: auto, ckpt.hf is where a run without checkpoints starts)")
        if self.ckpt.hf is not None:
            self._check_hf_model()
        return self

    def _check_hf_model(self) -> None:
        """ckpt.hf's weights must fit the job's model: its config.json's architecture, with the
        job's model.overrides applied, equal to model's (the kernel switches and metadata such
        as quantization_config aside), or the workers fail reading them (or, without
        model.config, the job trains the tiny preset)."""
        from plugins.deepseek_v4.config import METADATA_FIELDS

        try:
            theirs = {**DeepSeekV4Config.from_pretrained(self.ckpt.hf).to_dict(), **self.model.overrides}
        except ConfigError as e:
            raise ValueError(f"ckpt.hf: {e}") from None
        ours = self.model.arch.to_dict()
        found = model_difference(theirs, ours, METADATA_FIELDS)
        if found:
            k, more = found
            m = self.model
            source = f"model.config {m.config}" if m.config else f"model.preset {m.preset or 'tiny'}"
            raise ValueError(f"ckpt.hf: {self.ckpt.hf} has {k} {theirs.get(k)!r}, the job's model ({source}) "
                             f"{ours.get(k)!r}{more}: point model.config at {self.ckpt.hf}")

    def _check_rl(self) -> None:
        r, t = self.rollout, self.train
        if self.data.source != "prompts" or self.algo.loss != "policy":
            raise ValueError(f"an RL job has data.source: prompts and algo.loss: policy (got {self.data.source} and "
                             f"{self.algo.loss})")
        responses = r.rollout_batch_size * r.n_samples_per_prompt
        if responses % t.global_batch_size:
            raise ValueError(f"rollout.rollout_batch_size x rollout.n_samples_per_prompt = {responses} responses must "
                             f"be a multiple of train.global_batch_size={t.global_batch_size} (optimizer steps "
                             "per rollout)")
        if r.generate_fn is not None and ":" not in r.generate_fn:
            raise ValueError(f"rollout.generate_fn: {r.generate_fn!r} is not \"module:function\"")
        bad = [t for t in r.tools if ":" not in t]
        if bad:
            raise ValueError(f"rollout.tools: {bad[0]!r} is not \"module:function\"")
        if r.tools and r.generate_fn is None:
            r.generate_fn = "miles.rollout.tool_use:generate"
        if self.model.kv_quant and r.engine == "sglang":
            raise ValueError("model.kv_quant: SGLang's engines do not round K = V as the trainer would "
                             "(rollout.engine: embedded)")
        if r.tools and self.data.template != "deepseek_v4":
            raise ValueError("rollout.tools: tool calls are parsed in DeepSeek-V4's DSML; data.template must be "
                             "deepseek_v4")
        if r.engine == "sglang" and r.sync != "disk":
            raise ValueError(f"rollout.engine: sglang takes the trainer's weights from files: set rollout.sync: disk "
                             f"(rollout.sync: {r.sync} serves the embedded engine)")
        if (r.top_p < 1 or r.top_k > 0) and not r.truncated_sampling:
            raise ValueError(f"rollout.top_p={r.top_p:g} / rollout.top_k={r.top_k}: the engines would sample from a "
                             "truncated distribution whose log-probs the trainer does not reproduce (the importance "
                             "ratios and TIS would compare different distributions); use rollout.temperature alone, "
                             "or set rollout.truncated_sampling: true to accept the mismatch")
        if r.sync == "shared" and (r.placement != "colocated" or r.engine != "embedded"):
            raise ValueError("rollout.sync: shared opens the trainer's buffers in the engines' processes: it needs "
                             "rollout.placement: colocated and the embedded engine")
        if r.off_policy and r.placement == "colocated":
            raise ValueError("rollout.off_policy generates while the trainer trains: it needs rollout.placement: "
                             "disaggregated (colocated engines and trainer take turns)")
        if self.data.seq_len < r.max_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} (positions per packed training row) must hold a "
                             f"whole sequence of rollout.max_len={r.max_len}")
        if r.max_new_tokens >= r.max_len:
            raise ValueError(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in "
                             f"rollout.max_len={r.max_len}")
        if self.data.eval_interval:
            raise ValueError(f"data.eval_interval={self.data.eval_interval} is SFT's: an RL job evaluates every "
                             "rollout.eval_interval rollouts")

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per rollout (RL): its responses over train.global_batch_size."""
        r = self.rollout
        return max(1, r.rollout_batch_size * r.n_samples_per_prompt // self.train.global_batch_size)

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps, which the LR schedule spans: train.steps, times
        updates_per_rollout in RL jobs."""
        return self.train.steps * (self.updates_per_rollout if self.algo.loss == "policy" else 1)

    def resolved(self) -> dict:
        """Plain data (paths as strings), as written to <run_dir>/config.yaml; loads back to this job."""
        return self.model_dump(mode="json")

    def shown(self) -> dict:
        """resolved() less what this kind of job never reads (an SFT or pre-training job: the
        rollout section and the RL keys of algo), for `--check`."""
        out = self.resolved()
        if self.algo.loss != "policy":
            out.pop("rollout", None)
            rl = list(AlgoConfig.model_fields)
            rl = rl[rl.index("advantage"):]  # the fields after "# -- RL" in AlgoConfig
            out["algo"] = {k: v for k, v in out["algo"].items() if k not in rl}
        return out

    @property
    def notes(self) -> list[str]:
        """What load_job adjusted on the user's behalf, one line each (the CLI prints them)."""
        return list(self._notes)


# --------------------------------------------------------------------------- loading
class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-5` as a string; job files mean a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_value(text: str) -> Any:
    """An override's value, read as YAML: 3 -> int, 1e-5 -> float, true -> bool, [1, 2] -> list."""
    try:
        return yaml.load(text, Loader=_Loader) if text.strip() else ""
    except yaml.YAMLError as e:
        raise JobConfigError(f"value '{text}' is not valid YAML ({str(e).splitlines()[0]})") from None


def apply_override(raw: dict, override: str) -> None:
    """`a.b.c=value` into nested dicts (created as needed; unknown keys fail validation)."""
    key, sep, value = override.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key.strip()):
        raise JobConfigError(f"override '{override}': expected KEY=VALUE with a dotted key, e.g. train.optim.lr=1e-5")
    *parents, leaf = key.strip().split(".")
    node = raw
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise JobConfigError(f"override '{override}': {'.'.join(parents[:i + 1])} is a value, not a group")
    try:
        node[leaf] = parse_value(value)
    except JobConfigError as e:
        raise JobConfigError(f"override '{override}': {e}") from None


def _describe(err: dict, model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, err["loc"][:-1])
        text = f"{loc}: unknown key" + (f" (allowed here: {', '.join(allowed)})" if allowed else "")
        if re.search(r"key|token|secret|password|credential", str(err["loc"][-1]), re.I):
            text += ("; secrets never go in a job file: wandb reads WANDB_API_KEY and Ray its token "
                     "(RAY_AUTH_TOKEN_PATH) from the environment")
        return text
    if err["type"] == "value_error":  # our own checks: the message names its fields
        return err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"{loc}: missing"
    given = err.get("input")
    return f"{loc or 'job'}: {err['msg']}" + ("" if isinstance(given, dict) else f" (got {given!r})")


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def validate_job(raw: Any, source: str = "job") -> JobConfig:
    if not isinstance(raw, dict):
        raise JobConfigError(f"{source}: a job file is a mapping of groups (name, cluster, model, data, train, ...), "
                             f"got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_describe(err, JobConfig) for err in e.errors()]
        head = f"{source}: {len(lines)} error{'s' if len(lines) > 1 else ''}"
        raise JobConfigError("\n  ".join([head, *lines])) from None


def load_job(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """A job file (None: all defaults) plus dotted overrides -> a validated JobConfig (its run
    directory resolved: runs/<name>-<time> unless log.run_dir is given)."""
    raw: Any = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise JobConfigError(f"{path}: no such job file")
        try:
            raw = yaml.load(path.read_text(), Loader=_Loader)
        except yaml.YAMLError as e:
            raise JobConfigError(f"{path}: not valid YAML ({e})") from None
        raw = {} if raw is None else raw
    if overrides and not isinstance(raw, dict):
        raise JobConfigError(f"{source}: a job file is a mapping of groups")
    for o in overrides:
        apply_override(raw, o)
    given = {o.split("=", 1)[0].strip() for o in overrides}
    note = _clamp_warmup(raw, source) if "train.steps" in given and "train.optim.warmup_steps" not in given else ""
    job = validate_job(raw, source)
    if note:
        job._notes.append(note)
    _import_user_code(job, source, ([path.parent.absolute()] if path is not None else []) + [Path.cwd()])
    return job


def _import_user_code(job: JobConfig, source: str, dirs: list[Path]) -> None:
    """The user's functions ("module:function" in algo.reward, rollout.generate_fn) imported
    now, so a missing module or a typo fails before anything starts (it failed after Ray, the
    engines and the first evaluation). Modules beside the job file or in the working directory
    are found: both join the import path, after what is on it (the rewards' worker processes
    inherit it)."""
    from miles.user_code import load_function

    specs = [(f, v) for f, v in (("algo.reward", job.algo.reward if job.algo.reward_url is None else None),
                                 ("rollout.generate_fn", job.rollout.generate_fn)) if v and ":" in v]
    for d in dirs if specs else ():
        if str(d) not in sys.path:
            sys.path.append(str(d))
    for field, spec in specs:
        try:
            load_function(spec, field)
        except ValueError as e:
            raise JobConfigError(f"{source}: {e} (modules are looked up beside the job file, in the working "
                                 f"directory and on PYTHONPATH)") from None


def _clamp_warmup(raw: dict, source: str) -> str:
    """train.steps lowered on the command line below the job file's warm-up (a short trial of
    a long job): the warm-up clamped to the run's optimizer steps less one, and said."""
    optim = raw.get("train", {}).get("optim", {}) if isinstance(raw.get("train"), dict) else {}
    warmup = optim.get("warmup_steps") if isinstance(optim, dict) else None
    if not isinstance(warmup, int) or warmup <= 0:
        return ""
    probe = copy.deepcopy(raw)
    probe["train"]["optim"]["warmup_steps"] = 0
    try:
        n = validate_job(probe, source).optimizer_steps
    except JobConfigError:
        return ""  # the job has other problems: validation names them
    if warmup < n:
        return ""
    optim["warmup_steps"] = max(0, n - 1)
    return (f"train.optim.warmup_steps={warmup} ({source}) is not below this run's {n} optimizer steps "
            f"(train.steps from the command line): the warm-up is clamped to {n - 1}")


def save_resolved(job: JobConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(job.resolved(), sort_keys=False))
