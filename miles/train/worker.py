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

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
