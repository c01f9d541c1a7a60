"""Training throughput on one GPU: a ~1B-parameter DeepSeek-V4 config through the trainer
(TrainWorker: Megatron DDP + DistributedOptimizer, bf16) with the GPU kernels on and off
(config.kernels "triton" / "torch": sparse attention, Sinkhorn, grouped expert GEMMs),
against a plain dense-attention transformer of the same width, depth, vocabulary and
active MLP width (causal SDPA / flash attention, torch AdamW), all in the same process.

    python3 benchmarks/train_gpu.py [--config 1b|small_50m] [--seq 4096] [--steps 6] [--peak-tflops 989]

MFU = 6 x active non-embedding parameters x tokens/s / peak bf16 FLOP/s (attention
FLOPs are not counted for either model, so the V4 figure is conservative at long context).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_cpu import DenseBaseline  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config  # noqa: E402
from plugins.deepseek_v4.config import YarnScaling  # noqa: E402


def config_1b(seq: int) -> DeepSeekV4Config:
    return DeepSeekV4Config.tiny(
        vocab_size=32768, hidden_size=1536, num_hidden_layers=8, num_attention_heads=16, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=768, o_groups=8, o_lora_rank=512, n_routed_experts=32,
        n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=768, index_n_heads=16,
        index_head_dim=128, index_topk=512, compress_ratios=[0, 4, 128, 4, 128, 4, 128, 0, 0],
        num_hash_layers=2, sliding_window=128, rope_scaling=YarnScaling(16.0, 4096, 32.0, 1.0),
        max_position_embeddings=max(seq, 16384))


def config_small_50m(seq: int) -> DeepSeekV4Config:
    """The ~50M CPU-benchmark preset (the SFT data path's yardstick)."""
    return DeepSeekV4Config.small_50m(max_position_embeddings=max(seq, 16384))


CONFIGS = {"1b": config_1b, "small_50m": config_small_50m}


def active_params(cfg: DeepSeekV4Config, total: int) -> int:
    """Parameters a token passes through, without the embedding (routed experts: top-k of E)."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert * cfg.num_layers_total
    return total - idle - cfg.vocab_size * cfg.hidden_size


def timed(fn, steps: int) -> list[float]:
    fn()
    fn()  # warm-up: autotuning, allocator
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (micro-batches of 1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--profile", action="store_true", help="print where one V4 step's time goes")
    a = ap.parse_args()
    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker

    cfg = CONFIGS[a.config](a.seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g)
    mbs = [MicroBatch.lm(ids[i:i + 1, :-1], ids[i:i + 1, 1:].contiguous()) for i in range(a.batch)]
    tokens = a.batch * a.seq

    w = TrainWorker(0, 1)
    host, port = w.rendezvous_address()
    w.init_distributed(host, port)

    def build(kernels: str) -> int:
        total = w.build_model({**cfg.to_dict(), "kernels": kernels}, seed=0, dtype="bfloat16")
        w.setup_training(lr=1e-4, warmup_steps=0, total_steps=1000)
        return total

    def release() -> None:
        w.model = w.ddp = w.opt = None
        gc.collect()  # a step that ran out of memory leaves its graph in reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    if a.profile:
        build("triton")
        w.train_step(mbs)
        w.train_step(mbs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            w.train_step(mbs)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        return
    runs = []  # (name, total params, active params, step times or None (OOM), peak GiB)
    # kernels off first: its dense-masked attention is the one near the memory limit
    for kernels, name in (("torch", "DeepSeek-V4, kernels off"), ("triton", "DeepSeek-V4, kernels on")):
        total = build(kernels)
        try:
            ts = timed(lambda: w.train_step(mbs), a.steps)
        except torch.OutOfMemoryError:
            ts = None
        runs.append((name, total, active_params(cfg, total), ts, torch.cuda.max_memory_allocated() / 2**30))
        release()

    dense = DenseBaseline(cfg).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-4, fused=True)
    dev = [(mb.input_ids.cuda(), mb.labels.cuda()) for mb in mbs]

    def dense_step():
        opt.zero_grad(set_to_none=True)
        for i, lab in dev:
            (dense(i, lab) / len(dev)).backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
        opt.step()

    dn = timed(dense_step, a.steps)
    n_dense = sum(p.numel() for p in dense.parameters()) - cfg.vocab_size * cfg.hidden_size
    runs.append(("dense attention (SDPA, AdamW)", n_dense + cfg.vocab_size * cfg.hidden_size, n_dense, dn,
                 torch.cuda.max_memory_allocated() / 2**30))

    peak = a.peak_tflops * 1e12
    print(f"\n{torch.cuda.get_device_name()}  seq={a.seq}  batch={a.batch}  steps={a.steps} (median)")
    print(f"{'model':34s} {'params':>8s} {'active':>8s} {'step ms':>9s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s}")
    for name, tot, act, ts, mem in runs:
        if ts is None:
            print(f"{name:34s} {tot / 1e9:7.2f}B {act / 1e9:7.2f}B {'OOM':>9s}")
            continue
        med = statistics.median(ts)
        tps = tokens / med
        print(f"{name:34s} {tot / 1e9:7.2f}B {act / 1e9:7.2f}B {med * 1e3:9.1f} {tps:9,.0f} "
              f"{6 * act * tps / peak:6.1%} {mem:9.1f}")
    off, on = runs[0][3], runs[1][3]
    if on and off:
        print(f"V4 kernels on / off tokens/s: {statistics.median(off) / statistics.median(on):.2f}x")
    if on:
        print(f"dense / V4 (kernels on) tokens/s: {statistics.median(on) / statistics.median(dn):.2f}x")


if __name__ == "__main__":
    main()
