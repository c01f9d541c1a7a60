"""TrainWorker: one training rank. Runs inside a Ray actor (see miles.cluster.train_group).

Sets up torch.distributed (nccl on GPU, gloo on CPU with the Megatron-core CPU bridge),
Megatron-core's parallel state, and the plugin's model built through MegatronContext.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.model import IGNORE_INDEX, Gate


class TrainWorker:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.model: DeepSeekV4ForCausalLM | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the others connect: this node's address and a free port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def init_distributed(self, host: str, port: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> dict:
        cuda = torch.cuda.is_available()
        if not cuda:
            from miles.train import megatron_cpu

            megatron_cpu.apply()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(minutes=5))
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, context_parallel_size=cp)
        return {"rank": self.rank, "tp": ps.get_tensor_model_parallel_world_size(),
                "tp_rank": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_world_size()}

    def build_model(self, config: dict, seed: int, dtype: str = "float32") -> int:
        from miles.train.parallel_context import MegatronContext

        dt = getattr(torch, dtype)
        self.model = DeepSeekV4ForCausalLM(DeepSeekV4Config.from_dict(config, source="job config"), dtype=dt,
                                           ctx=MegatronContext(dt), seed=seed).train()
        return sum(p.numel() for p in self.model.parameters())

    def loss_and_grads(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        """One forward+backward; returns losses, logits and this rank's gradients (with the
        split dim of each TP-split tensor) for parity checks against one process."""
        self.model.zero_grad(set_to_none=True)
        out = self.model(input_ids, labels=labels)
        out.losses["total"].backward()
        grads, dims = {}, {}
        for k, p in self.model.named_parameters():
            if p.grad is not None:
                grads[k] = p.grad.detach().cpu()
                dims[k] = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        return {"logits": out.logits.detach().cpu(), "mtp": out.mtp_logits.detach().cpu(),
                "losses": {k: v.detach().cpu() for k, v in out.losses.items()}, "grads": grads, "dims": dims}

    def setup_training(self, lr: float, weight_decay: float = 0.0, clip_grad: float = 1.0, warmup_steps: int = 0,
                       total_steps: int = 1000, min_lr: float = 0.0, adam_eps: float = 1e-8) -> None:
        """Megatron DDP + DistributedOptimizer (AdamW, sharded state) + warm-up/cosine schedule.
        Gradients are summed over DP (calculate_per_token_loss): the loss is already divided
        by the global batch's token count."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer import TransformerConfig

        c = self.model.config
        tcfg = TransformerConfig(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                                 num_attention_heads=c.num_attention_heads, use_cpu_initialization=True,
                                 calculate_per_token_loss=True,
                                 tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
        self.ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True), self.model)
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", adam_eps=adam_eps, lr=lr, min_lr=min_lr, weight_decay=weight_decay, clip_grad=clip_grad,
            use_distributed_optimizer=True), [self.ddp])
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
            lr_decay_steps=total_steps, lr_decay_style="cosine" if total_steps > warmup_steps else "constant",
            start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant")

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """One optimizer step over this rank's micro-batches [(input_ids, labels), ...]. Token
        losses (lm, MTP, indexer) are normalised by the global batch's supervised-token count,
        so neither micro-batching nor DP size changes the gradient."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_group()
        n = torch.tensor(float(sum(int((lab != IGNORE_INDEX).sum()) for _, lab in micro_batches)))
        dist.all_reduce(n, group=dp)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        sums = {}
        for ids, lab in micro_batches:
            losses = self.ddp(ids, labels=lab, loss_normalizer=n).losses
            losses["total"].backward()
            for k, v in losses.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
        self.ddp.finish_grad_sync()
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise FloatingPointError(f"rank {self.rank}: optimizer step skipped (non-finite gradients)")
        self.sched.step(increment=1)
        for mod in self.model.modules():  # aux-loss-free balancing sees the global expert loads
            if isinstance(mod, Gate) and not mod.is_hash:
                dist.all_reduce(mod.expert_load, group=dp)
        self.model.update_router_bias()
        stats = torch.stack([sums[k] for k in sorted(sums)])
        dist.all_reduce(stats, group=dp)  # each rank holds its share of the global mean
        out = {k: float(v) for k, v in zip(sorted(sums), stats, strict=True)}
        out.update(grad_norm=float(grad_norm), lr=self.opt.param_groups[0]["lr"])
        return out

    def state(self) -> dict:
        """Parameters and router biases (for parity checks); Megatron's linears add `None`
        entries for absent biases and `_extra_state`, which are not model tensors."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
