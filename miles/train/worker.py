"""TrainWorker: one training rank. Runs inside a Ray actor (see miles.cluster.train_group).

Sets up torch.distributed (nccl on GPU, gloo on CPU with the Megatron-core CPU bridge),
Megatron-core's parallel state (TP, PP, EP, CP, DP), and the plugin's model built through
MegatronContext. Every forward/backward goes through Megatron's pipeline schedules (1F1B
when PP > 1), so the same code path serves one rank and many.

The worker consumes `MicroBatch`es (miles.train.batching) and trains with a loss function
chosen by name (miles.train.losses): the model returns logits and auxiliary sums, the loss
function turns them into the loss. Every rank of a data-parallel replica (its TP, PP and CP
peers) receives the same micro-batches.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import miles.train.megatron_import  # noqa: F401  # isort: skip (first: megatron.core imports through it)
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from miles.ckpt import sharded
from miles.ckpt.hf_slices import hf_slices
from miles.ckpt.sharded import model_tensors
from miles.cluster.node import node_address
from miles.memory import device_memory, offload, restore, to_device, unique_storages
from miles.observe.alignment import grad_checksums
from miles.observe.profiler import Profile
from miles.rollout.weights import group_store, listening_store
from miles.train import adamw, inspect, losses
from miles.train.batching import MicroBatch
from miles.train.ddp import OverlappedDDP, overlap_wanted
from miles.train.parallel_context import MegatronContext
from miles.train.weight_sender import WeightSender
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.determinism import enable_deterministic
from plugins.deepseek_v4.forward import Trace
from plugins.deepseek_v4.model import Gate, Indexer


def replay_share(modules: list, group) -> torch.Tensor | None:
    """The replay statistics (differing, replayed) the modules (gates, indexers) summed since
    the last call, over `group`, then reset; None without such modules."""
    if not modules:
        return None
    stats = torch.stack([m.replay_stats for m in modules]).sum(0)
    dist.all_reduce(stats, group=group)
    for m in modules:
        m.replay_stats.zero_()
    return stats


def router_balance(gates: list[Gate]) -> torch.Tensor | None:
    """The mean over MoE layers of the busiest expert's load over the mean load, from the loads
    counted since the last step (1: balanced; layers that counted no token left out, 0 if none
    did); None without a learned router."""
    if not gates:
        return None
    loads = torch.stack([g.expert_load.float() for g in gates])  # [layers, experts]
    counted = loads.sum(-1) > 0  # [layers]
    ratio = loads.amax(-1) / loads.mean(-1).clamp_min(1e-12)  # [layers]
    return (ratio * counted).sum() / counted.sum().clamp_min(1)


class _ScheduleView:
    """What Megatron's schedules look up on a model: its TransformerConfig, its model type,
    and (through `.module`) set_input_tensor on the plugin's model."""

    def __init__(self, module, config):
        self.module, self.config, self.model_type = module, config, ModelType.encoder_or_decoder


class _AttachLoss(torch.autograd.Function):
    """Identity on a pipeline stage's output whose backward also starts the backward of the
    stage's auxiliary loss (gradient 1): those terms train the stage's parameters when its
    output gets its gradient from the next stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, torch.ones(ctx.loss_shape, dtype=torch.float32, device=g.device)


class TrainWorker:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.model: DeepSeekV4ForCausalLM | None = None
        self.ddp = self.opt = self.sched = None
        self.loss_fn, self.coef = losses.get("lm"), losses.LossCoefs()
        self.temperature = 1.0
        self._metric_keys: list[str] | None = None
        self._profile = None
        self._trace: Trace | None = None  # start_trace .. stop_trace (log.trace)
        self._asleep: list | None = None
        self._save = None  # an async save being written (miles.ckpt.sharded.BackgroundSave)
        self.weights: WeightSender | None = None  # every path of the weights out (after build_model)
        self._reference: dict[str, torch.Tensor] | None = None  # RL's KL reference weights (host)
        self.freeze_router_bias = False  # set_router
        self._listening = None  # rank 0's rendezvous store, from rendezvous_address until a group takes it

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the others connect: its Ray node's address (other nodes reach
        it there) and the port of a store it already listens on, which the next group it joins
        as rank 0 (init_distributed, open_sync_group) takes."""
        self._listening = listening_store(node_address())
        return self._listening.host, self._listening.port

    def _take_listening(self):
        listening, self._listening = self._listening, None
        return listening

    # ------------------------------------------------------------------ set-up
    def init_distributed(self, host: str, port: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> dict:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)  # Ray gives each actor its own GPU as device 0
            from miles.train import megatron_gpu

            megatron_gpu.apply()
        else:
            from miles.train import megatron_cpu

            megatron_cpu.apply()
        timeout = timedelta(minutes=5)
        store = group_store(host, port, self.rank, self.world_size, timeout.total_seconds(), self._take_listening())
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, context_parallel_size=cp)
        return self.layout()

    def layout(self) -> dict:
        return {"rank": self.rank, "node": node_address(), "tp": ps.get_tensor_model_parallel_world_size(),
                "tp_rank": ps.get_tensor_model_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "ep": ps.get_expert_model_parallel_world_size(), "ep_rank": ps.get_expert_model_parallel_rank(),
                "cp": ps.get_context_parallel_world_size(), "cp_rank": ps.get_context_parallel_rank(),
                "dp": ps.get_data_parallel_world_size(), "dp_rank": ps.get_data_parallel_rank()}

    def build_model(self, config: dict, seed: int, dtype: str = "float32", deterministic: bool = False) -> int:
        """Build this rank's part of the model (seeded per tensor name, so every layout starts
        from the single-process weights). Deterministic mode: fixed seeds, deterministic
        kernels (no atomics), bit-identical reruns."""
        if deterministic:
            enable_deterministic(seed)
        dt = getattr(torch, dtype)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        cfg = DeepSeekV4Config.from_dict(config, source="job config")
        # Built and initialised on the host, then moved: parameters keep their identity (and
        # Megatron's split attributes).
        self.model = DeepSeekV4ForCausalLM(cfg, dtype=dt, ctx=MegatronContext(dt), seed=seed).train()
        if self.device is not None:
            self.model.to(self.device)
        self.weights = WeightSender(self.model, self.rank, self.device)
        if self.model.embed is not None and self.model.ctx.pp_size > 1:
            w = self.model.embed.weight
            w.shared_embedding = True  # own DDP bucket; gradients summed over the embedding group
            w.shared = not self.model.ctx.first_stage  # the copy the grad norm must not count twice
        # The schedules' view of the model: stage outputs are [B, s, n*d] streams of any shape
        # (variable_seq_lengths), losses arrive already divided by their global counts.
        pp = ps.get_pipeline_model_parallel_world_size()
        self.tcfg = TransformerConfig(
            num_layers=pp, hidden_size=cfg.hidden_size * cfg.hc_mult, num_attention_heads=cfg.num_attention_heads,
            use_cpu_initialization=True, calculate_per_token_loss=True, variable_seq_lengths=True,
            add_bias_linear=False,  # the plugin's linears have none (Megatron rejects MoE biases under expert TP)
            moe_token_dispatcher_type="alltoall",  # unused (the plugin dispatches); the default rejects the above
            pipeline_dtype=dt, params_dtype=dt, bf16=dt == torch.bfloat16,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), pipeline_model_parallel_size=pp,
            context_parallel_size=ps.get_context_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            num_moe_experts=cfg.n_routed_experts if ps.get_expert_model_parallel_world_size() > 1 else None)
        return sum(p.numel() for p in self.model.parameters())

    def set_loss(self, name: str, options: dict | None = None, **coefs: float) -> None:
        """The loss function (miles.train.losses, by name; `options`: the policy loss's
        PolicyOptions) and the auxiliary terms' weights (losses.LossCoefs: mtp, indexer,
        balance; its defaults where not given)."""
        coef = losses.LossCoefs(**coefs)
        if coef.balance > 0 and self.model.ctx.cp_size > 1:
            raise ValueError("the sequence balance loss is per whole sequence: it cannot be split over "
                             "context-parallel ranks (use cp=1 or balance weight 0)")
        self.loss_fn, self.coef = losses.get(name, options), coef
        if self.ddp is not None:  # the terms decide which parameters the backward reaches, how often
            self.ddp.relearn_counts()
        self.temperature = losses.temperature(name, options)  # of forward_logprobs too
        self._metric_keys = None

    def set_router(self, freeze_bias: bool, freeze_weights: bool = False) -> None:
        """The MoE router in training: `freeze_bias` keeps the aux-loss-free selection bias as it
        is (the expert loads are still counted and reported); `freeze_weights` takes the gate
        weights out of the optimizer. Before setup_training, which builds DDP and the optimizer
        over the parameters that require gradients."""
        if self.ddp is not None and freeze_weights != self._router_frozen():
            raise RuntimeError("set_router(freeze_weights=...) must come before setup_training")
        self.freeze_router_bias = freeze_bias
        for g in self._gates(learned_only=False):  # hash layers' gates weigh their experts too
            g.weight.requires_grad_(not freeze_weights)

    def _gates(self, learned_only: bool = True) -> list[Gate]:
        """The MoE gates; `learned_only`: those that route (hash layers route by token id: no
        loads to balance, no bias)."""
        return [m for m in self.model.modules() if isinstance(m, Gate) and not (learned_only and m.is_hash)]

    def _router_frozen(self) -> bool:
        return any(not g.weight.requires_grad for g in self._gates(learned_only=False))

    def setup_training(self, lr: float, min_lr: float = 0.0, warmup_steps: int = 0, decay: str = "cosine",
                       weight_decay: float = 0.0, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                       clip_grad: float = 1.0, total_steps: int = 1000, moments: str = "float32",
                       overlap_grad_reduce: bool = True) -> None:
        """Megatron DDP + DistributedOptimizer (AdamW, sharded state) + LR schedule: step k
        (1-indexed) trains at lr(k), rising linearly to `lr` at k = warmup_steps, then decaying
        (cosine, linear or constant) to `min_lr` at k = total_steps. Gradients are summed over
        DP x CP (calculate_per_token_loss): the losses are already divided by global counts;
        with `overlap_grad_reduce` (and more than one such rank) each bucket's reduction starts
        during the backward of the step's last micro-batch (miles/train/ddp.py). The arguments
        are a job's `train.optim` group."""
        bf16 = self.tcfg.bf16
        self.model.zero_grad(set_to_none=True)
        overlap = overlap_wanted(overlap_grad_reduce, ps.get_data_parallel_world_size(with_context_parallel=True))
        self.ddp = OverlappedDDP(self.tcfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), self.model)
        self.tcfg.no_sync_func = self.ddp.no_sync  # the schedules: no reduction before the last micro-batch
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", adam_eps=eps, adam_beta1=beta1, adam_beta2=beta2, lr=lr, min_lr=min_lr,
            weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16, params_dtype=self.tcfg.params_dtype,
            use_distributed_optimizer=True), [self.ddp])
        for o in getattr(self.opt, "chained_optimizers", [self.opt]):
            if isinstance(getattr(o, "optimizer", None), torch.optim.AdamW):
                adamw.set_moments(o.optimizer, moments)
            elif getattr(o, "optimizer", None) is not None and moments != "float32":
                raise ValueError(f"train.optim.moments={moments}: Megatron built a {type(o.optimizer).__name__}, "
                                 f"not torch's AdamW, whose moments miles keeps in bf16")
        self._fuse_adam()
        if warmup_steps >= total_steps:  # Megatron's scheduler asserts it; say it plainly
            raise ValueError(f"warmup_steps={warmup_steps} must be below the run's {total_steps} steps")
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
            lr_decay_steps=total_steps, lr_decay_style=decay,
            start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant",
            # resumed: the job's schedule (train.steps may have grown), the checkpoint's step count
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
        # What exists now lives as long as the worker: the collector need not scan it again.
        # (Megatron's checkpointing calls gc.collect() twice per save: 0.65 s -> 0.01 s.)
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ forward / backward
    def _to_device(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        return [mb.to(self.device) for mb in mbs]

    def _global_counts(self, mbs: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Each loss term's positions in the global batch (losses.counts), summed over the
        data-parallel replicas (the TP/PP/CP peers of a replica hold the same micro-batches);
        at least 1, so an empty term is 0, not NaN. Counted from the host's micro-batches (a few
        small ops each: on a GPU they would be launches it idles through), then one copy."""
        dp = ps.get_data_parallel_group()
        if self.model.ctx.ep_size > 1:  # the expert exchange is a collective per micro-batch
            n = [torch.zeros((), device=self.device) for _ in range(dist.get_world_size(dp))]
            dist.all_gather(n, torch.tensor(float(len(mbs)), device=self.device), group=dp)
            if len({int(c) for c in n}) > 1:
                raise ValueError(f"expert parallelism needs the same number of micro-batches on every "
                                 f"data-parallel rank, got {[int(c) for c in n]}")
        per = [losses.counts(self.model, mb) for mb in mbs]
        keys = sorted(per[0])
        total = to_device(torch.stack([sum(c[k] for c in per).double() for k in keys]), self.device)
        dist.all_reduce(total, group=dp)
        return {k: v.float().clamp_min(1) for k, v in zip(keys, total, strict=True)}

    def _schedule(self, module, mbs: list[MicroBatch], norm: dict | None, forward_only: bool) -> tuple[list, dict]:
        """Megatron's forward-backward over the micro-batches. Returns, on the last pipeline
        stage, per micro-batch {metrics, logprobs [B, s]} (forward-only: logprobs); and this
        stage's summed auxiliary metrics (earlier stages compute some auxiliary terms)."""
        stage_metrics: dict[str, torch.Tensor] = {}
        ctx = self.model.ctx

        def step(data, model):
            mb = next(data)
            out = module(mb.input_ids, doc_ids=mb.doc_ids, aux=() if forward_only else self.coef.aux_terms,
                         routed_experts=mb.routed_experts, indexer_picks=mb.indexer_picks, trace=self._trace)
            if out.head is None:  # an earlier stage: its output goes to the next stage
                if forward_only:
                    return out.hidden, None
                aux, metrics = losses.aux_loss(out.aux, norm, self.coef)
                for k, v in dict(metrics, loss=aux.detach()).items():
                    stage_metrics[k] = stage_metrics.get(k, 0.0) + v
                return (_AttachLoss.apply(out.hidden, aux) if aux.requires_grad else out.hidden), None
            if forward_only:
                lp = losses.label_logprobs(ctx, out.head, mb, self.temperature)
                return lp, lambda t: (t, torch.ones((), dtype=torch.int), {"logprobs": t})
            res = self.loss_fn(out, mb, norm, self.coef, ctx)
            return res.loss, lambda t: (t, torch.ones((), dtype=torch.int),
                                        {"metrics": res.metrics, "logprobs": res.logprobs})

        s, b = mbs[0].shape[1], mbs[0].shape[0]
        res = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(mbs), model=[_ScheduleView(module, self.tcfg)],
            num_microbatches=len(mbs), seq_length=s, micro_batch_size=b, forward_only=forward_only)
        return res, stage_metrics

    def _reported(self, res: list, stage_metrics: dict) -> dict[str, float]:
        """Loss metrics of the global batch: micro-batches summed, then summed over DP x CP (each
        holds its share of the global mean) and over PP (earlier stages' auxiliary shares);
        metrics named *_max are maxima of values >= 0 instead. The same keys on every rank,
        whatever its stage."""
        mine = sorted(set().union(*(r["metrics"] for r in res), stage_metrics))
        if self._metric_keys is None:  # stages report different terms: agree on the union once
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            self._metric_keys = sorted(set().union(*every))
        keys = self._metric_keys
        vals = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        is_max = [k.endswith("_max") for k in keys]  # maxima (of values >= 0)
        maxed = torch.tensor(is_max, device=self.device)
        for metrics in [r["metrics"] for r in res] + [stage_metrics]:
            for k, v in metrics.items():
                i = keys.index(k)
                vals[i] = torch.maximum(vals[i], v.double()) if is_max[i] else vals[i] + v.double()
        sums, maxes = vals.masked_fill(maxed, 0.0), vals.masked_fill(~maxed, 0.0)
        groups = [ps.get_data_parallel_group(with_context_parallel=True)]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            groups.append(ps.get_pipeline_model_parallel_group())
        for g in groups:
            dist.all_reduce(sums, group=g)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=g)
        vals = torch.where(maxed, maxes, sums)
        return {k: float(v) for k, v in zip(keys, vals, strict=True)}

    def _sync_embedding_grads(self, grads: list[torch.Tensor]) -> None:
        """The first and last pipeline stages each hold the embedding (input, and MTP):
        their gradients are summed, as Megatron does for tied embeddings."""
        if self.model.ctx.pp_size > 1 and self.model.embed is not None and ps.is_rank_in_embedding_group():
            for g in grads:
                dist.all_reduce(g, group=ps.get_embedding_group())

    @torch.no_grad()
    def forward_logprobs(self, micro_batches: list[MicroBatch], reference: bool = False) -> list[torch.Tensor] | None:
        """Per-token log p(label) [B, S] of each micro-batch (whole sequence: CP chunks are
        gathered); None on ranks that are not the last pipeline stage. `reference`: under the
        weights keep_reference() stored (swapped in for this forward, then back)."""
        mbs = self._to_device(micro_batches)
        current = self._swap_weights(self._reference) if reference else None
        try:
            res, _ = self._schedule(self.model, mbs, None, forward_only=True)
        finally:
            if current is not None:
                self._swap_weights(current)
        return [self.model.ctx.gather_seq(r["logprobs"]).cpu() for r in res] if self.model.ctx.last_stage else None

    def keep_reference(self, hf: str | None = None) -> int:
        """Store the reference policy (RL's KL term) on the host: this rank's slices of DeepSeek's
        HF checkpoint `hf` (algo.kl_reference; the live weights untouched), else this rank's
        current weights. Returns its bytes."""
        own = model_tensors(self.model)
        if hf is None:
            self._reference = {k: v.detach().cpu().clone() for k, v in own.items()}
        else:
            self._reference = {name: part.to(own[name].dtype).cpu().clone()
                               for name, part in hf_slices(self.model, hf, own, self.rank)}
        return sum(v.numel() * v.element_size() for v in self._reference.values())

    @torch.no_grad()
    def _swap_weights(self, weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Copy `weights` into the model; returns a host copy of what they replaced."""
        if weights is None:
            raise RuntimeError(f"rank {self.rank}: no reference weights (keep_reference() first)")
        own = model_tensors(self.model)
        old = {k: v.detach().cpu().clone() for k, v in own.items()}
        for k, v in own.items():
            v.copy_(weights[k])
        return old

    def reduced_gradients(self, micro_batches: list[MicroBatch]) -> tuple[list, dict]:
        """The training step before its update: forward and backward over the micro-batches,
        then Megatron DDP's reduction into its gradient buffers (each parameter's `main_grad`;
        with the DistributedOptimizer each data-parallel rank holds the reduced values of its
        own shard) and the embedding's sum over first and last stage. Returns what _schedule
        returns."""
        mbs, counts = self._to_device(micro_batches), self._global_counts(micro_batches)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        res, aux = self._schedule(self.ddp, mbs, counts, forward_only=False)
        self.ddp.announce_rest()
        self.ddp.finish_grad_sync()
        if self.model.embed is not None:
            self._sync_embedding_grads([self.model.embed.weight.main_grad])
        return res, aux

    def train_step(self, micro_batches: list[MicroBatch], checksums: bool = False) -> dict:
        """One optimizer step over this rank's micro-batches. Each loss term is normalised by
        its global count of positions, so neither micro-batching nor the layout changes the
        gradient. Returns the global batch's loss metrics, grad norm, lr and, with `checksums`,
        an MD5 per parameter group of this rank's reduced gradients (alignment records; it
        copies every gradient to the host); `step_time`, the seconds the step took in here."""
        from miles.train import megatron_gpu

        start = time.perf_counter()
        res, aux = self.reduced_gradients(micro_batches)
        grad_md5 = (grad_checksums([(n, getattr(p, "main_grad", None)) for n, p in self.model.named_parameters()])
                    if checksums else None)
        self.sched.step(increment=1)  # Megatron's scheduler counts steps done: step k trains at lr(k)
        ok, grad_norm = megatron_gpu.step(self.opt)  # Megatron's step; with fused AdamW, the clip inside it
        if not ok:
            raise FloatingPointError(f"rank {self.rank}: optimizer step skipped (non-finite gradients)")
        dpcp = ps.get_data_parallel_group(with_context_parallel=True)
        gates = self._gates()
        for g in gates:  # aux-loss-free balancing sees the global expert loads
            dist.all_reduce(g.expert_load, group=dpcp)
        balance = router_balance(gates)
        replay = replay_share(gates, dpcp)  # routing replay: of replayed (token, layer) pairs, own routing differed
        # indexer replay: of the replayed entries, those this rank's own indexers would not have picked
        picks = replay_share([m for m in self.model.modules() if isinstance(m, Indexer)], dpcp)
        if self.freeze_router_bias:
            for g in gates:
                g.expert_load.zero_()
        else:
            self.model.update_router_bias()
        out = self._reported(res, aux)
        if balance is not None:
            out["router_load_max_over_mean"] = float(balance)
        if replay is not None and replay[1] > 0:
            out["router_replay_disagreement"] = float(replay[0] / replay[1])
        if picks is not None and picks[1] > 0:
            out["indexer_replay_disagreement"] = float(picks[0] / picks[1])
        if self.device is not None:
            torch.cuda.synchronize()
        out.update(grad_norm=float(grad_norm), lr=self.opt.param_groups[0]["lr"], grad_md5=grad_md5,
                   step_time=time.perf_counter() - start)  # this rank's own time, without the Ray call
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, async_save: bool = False, model_only: bool = False) -> None:
        """Collective: this rank's shards of model, optimizer, LR schedule and RNG (the model
        alone: a conversion) into `directory` (miles.ckpt.sharded; the caller commits the
        directory). With `async_save` the files are written in the background: finish_save()
        reports when."""
        if self._save is not None:
            raise RuntimeError("a checkpoint is still being written: finish_save(blocking=True) first")
        self._save = sharded.save(directory, self.model, None if model_only else self.opt, self.sched,
                                  self.world_size, self.rank, async_save=async_save)

    def finish_save(self, blocking: bool) -> bool:
        """Collective: finalize the background save if every rank has written it (blocking:
        wait for it); True when none is left. A rank's failed write raises here, on all ranks."""
        if self._save is not None and self._save.finish(blocking):
            self._save = None
        return self._save is None

    def load_hf(self, directory: str) -> dict:
        """This rank's slices of DeepSeek's HF checkpoint (FP8/FP4 dequantized), read one tensor
        at a time: only the names this rank holds (its stage's layers, its EP rank's experts),
        each sliced to its TP part. Returns what was read (names, peak bytes in flight)."""
        own = model_tensors(self.model)
        peak = [0]
        with torch.no_grad():
            for name, part in hf_slices(self.model, directory, own, self.rank, peak):
                own[name].copy_(part.to(own[name].dtype))
        if self.opt is not None:  # bf16: the optimizer's fp32 main copies start from these weights
            self.opt.reload_model_params()
        return {"names": sorted(own), "peak_bytes": peak[0],
                "shard_bytes": sum(t.numel() * t.element_size() for t in own.values())}

    def load_checkpoint(self, directory: str, same_layout: bool, with_optimizer: bool = True) -> None:
        """Collective: this rank's slices of a checkpoint saved at any layout (RNG states when
        `same_layout`); without the optimizer, the weights alone (fresh moments and schedule)."""
        sharded.load(directory, self.model, self.opt, self.sched, self.world_size, self.rank, same_layout,
                     with_optimizer)
        self._fuse_adam()

    def _fuse_adam(self) -> None:
        if self.opt is not None and torch.cuda.is_available():
            from miles.train import megatron_gpu

            megatron_gpu.fuse_adam(self.opt)

    # ------------------------------------------------------------------ profiling
    def start_profile(self, trace_dir: str, record_shapes: bool = False, with_stack: bool = False,
                      profile_memory: bool = False) -> None:
        """Profile this rank until stop_profile(), which writes <trace_dir>/rank<N>.json
        (miles.observe.profiler)."""
        if self._profile is not None:
            raise RuntimeError(f"rank {self.rank}: a profile is already running")
        self._profile = Profile(Path(trace_dir) / f"rank{self.rank}.json", record_shapes, with_stack, profile_memory)

    def start_trace(self, layers: list[int], what: list[str]) -> None:
        """Capture the attention internals `what` of `layers` in every forward until stop_trace
        (log.trace; forward.Trace)."""
        self._trace = Trace(frozenset(layers), frozenset(what))

    def stop_trace(self, directory: str) -> list[str]:
        """Write the capture to <directory>/rank<N>/layer<L>.safetensors (tensors "<i>.<name>",
        i counting this rank's forwards in the window) and stop; returns the files."""
        from safetensors.torch import save_file

        trace, self._trace = self._trace, None
        out = Path(directory) / f"rank{self.rank}"
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for layer, forwards in sorted((trace.captured if trace else {}).items()):
            path = out / f"layer{layer}.safetensors"
            save_file({f"{i}.{k}": v for i, f in enumerate(forwards) for k, v in f.items()}, str(path))
            files.append(str(path))
        return files

    def stop_profile(self) -> str:
        """Write the trace (Chrome format); returns its path."""
        if self._profile is None:
            raise RuntimeError(f"rank {self.rank}: stop_profile() without start_profile()")
        path, self._profile = self._profile.stop(), None
        return str(path)

    # ------------------------------------------------------------------ weights out (WeightSender)
    def export_weights(self, bucket_bytes: int = 256 << 20) -> list[dict[str, torch.Tensor]]:
        return self.weights.export(bucket_bytes)

    def save_hf_shards(self, directory: str, bucket_bytes: int = 1 << 30) -> tuple[dict[str, str], int, list[str]]:
        return self.weights.save_hf_shards(directory, bucket_bytes)

    def put_weight_buckets(self, bucket_bytes: int) -> list[tuple]:
        return self.weights.put(bucket_bytes)

    def share_weight_buckets(self, bucket_bytes: int) -> list[tuple]:
        return self.weights.share(bucket_bytes)

    def release_shared(self) -> None:
        self.weights.release()

    def weight_plan(self, bucket_bytes: int) -> list:
        return self.weights.plan(bucket_bytes)

    def open_sync_group(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        self.weights.open_group(host, port, rank, size, backend, self._take_listening())

    def broadcast_weights(self, plan: list[dict], bucket_bytes: int, me: int | None) -> dict[str, str]:
        return self.weights.broadcast(plan, bucket_bytes, me)

    def close_sync_group(self) -> None:
        self.weights.close_group()

    def inspect(self, what: str, *args):
        """Run miles.train.inspect.<what>(this worker, *args): read-only views of the training
        state for parity checks and debugging (reduced gradient shards, optimizer moments,
        parameters), kept out of the training path."""
        fn = getattr(inspect, what, None)
        if what.startswith("_") or not callable(fn):
            raise ValueError(f"miles.train.inspect has no function {what!r}")
        return fn(self, *args)

    # ------------------------------------------------------------------ colocation
    def _storages(self) -> list[torch.Tensor]:
        """Every tensor that holds training state on the device: parameters, buffers, DDP's
        parameter and gradient buffers, the optimizer's main parameters and moments."""
        ts = list(self.model.parameters()) + list(self.model.buffers())
        if self.ddp is not None:
            for buf in self.ddp.buffers + self.ddp.expert_parallel_buffers:
                ts += [buf.param_data, buf.grad_data]
        if self.opt is not None:
            for o in getattr(self.opt, "chained_optimizers", [self.opt]):
                for group in o.optimizer.param_groups:
                    ts += list(group["params"])
                for st in o.optimizer.state.values():
                    ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return unique_storages(ts)

    def memory(self) -> dict[str, float]:
        """miles.memory.device_memory of this rank's GPU (empty on CPUs)."""
        return device_memory(self.device)

    def sleep(self) -> int:
        """Free the device memory of all training state (weights, gradients, optimizer) for a
        colocated rollout engine; the bytes move to host memory. Returns bytes freed."""
        if self._asleep is not None:
            raise RuntimeError(f"rank {self.rank}: sleep() called twice without wake_up()")
        self._asleep, freed = offload(self._storages())
        return freed

    def wake_up(self) -> None:
        """Restore what sleep() moved out, bit for bit, in the same storages (every view,
        DDP buffer and optimizer reference stays valid)."""
        if self._asleep is None:
            raise RuntimeError(f"rank {self.rank}: wake_up() without sleep()")
        restore(self._asleep)
        self._asleep = None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
