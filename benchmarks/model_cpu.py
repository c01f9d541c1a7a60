"""CPU forward+backward throughput of the DeepSeek-V4 plugin vs a plain dense-attention
transformer of the same width, measured in one process (ratios are what to compare).

    .venv/bin/python benchmarks/model_cpu.py [--iters 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from miles.train import losses
from miles.train.batching import MicroBatch
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM


class DenseBaseline(nn.Module):
    """Pre-norm transformer, causal SDPA attention (H heads of hidden/H), SwiGLU MLP as wide
    as the V4 model's active experts (top-k routed + shared), same depth and vocabulary."""

    def __init__(self, cfg: DeepSeekV4Config):
        super().__init__()
        d, self.h = cfg.hidden_size, cfg.num_attention_heads
        inter = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            n1=nn.RMSNorm(d), qkv=nn.Linear(d, 3 * d, bias=False), o=nn.Linear(d, d, bias=False),
            n2=nn.RMSNorm(d), up=nn.Linear(d, 2 * inter, bias=False), down=nn.Linear(inter, d, bias=False),
        )) for _ in range(cfg.num_layers_total))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        for L in self.layers:
            q, k, v = L["qkv"](L["n1"](x)).view(b, s, 3, self.h, d // self.h).unbind(2)  # [B, S, H, hd]
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + L["o"](a.transpose(1, 2).reshape(b, s, d))
            g, u = L["up"](L["n2"](x)).chunk(2, -1)
            x = x + L["down"](F.silu(g) * u)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def time_step(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(name: str, cfg: DeepSeekV4Config, batch: int, seq: int, iters: int) -> tuple:
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    v4 = DeepSeekV4ForCausalLM(cfg).train()
    dense = DenseBaseline(cfg).train()

    mb = MicroBatch.lm(ids, ids)

    def v4_step():
        v4.zero_grad(set_to_none=True)
        losses.compute(v4, mb)[1].loss.backward()

    def dense_step():
        dense.zero_grad(set_to_none=True)
        dense(ids, ids).backward()

    t_v4, t_dense = time_step(v4_step, iters), time_step(dense_step, iters)
    n_v4 = sum(p.numel() for p in v4.parameters()) / 1e6
    n_dense = sum(p.numel() for p in dense.parameters()) / 1e6
    tok = batch * seq
    return (name, f"{n_v4:.1f}M / {n_dense:.1f}M", f"{batch}x{seq}", f"{tok / t_v4:,.0f}",
            f"{tok / t_dense:,.0f}", f"{t_dense / t_v4:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench(name, cfg, batch, seq, args.iters)
            for name, cfg, batch, seq in (("tiny", DeepSeekV4Config.tiny(), 4, 128),
                                          ("small_50m", DeepSeekV4Config.small_50m(), 2, 512))]
    head = ("config", "params v4 / dense", "batch", "v4 tok/s", "dense tok/s", "v4 / dense")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    print(f"forward+backward, fp32, {args.threads} threads, median of {args.iters}")
    print(fmt.format(*head))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(fmt.format(*r))


if __name__ == "__main__":
    main()
