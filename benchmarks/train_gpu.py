"""Training throughput on one GPU: a ~1B-parameter DeepSeek-V4 config through the trainer
(TrainWorker: Megatron DDP + DistributedOptimizer, bf16) with the GPU kernels on and off
(config.kernels "triton" / "torch": sparse attention, Sinkhorn, grouped expert GEMMs),
against a plain dense-attention transformer of the same width, depth, vocabulary and
active MLP width (causal SDPA / flash attention, torch AdamW), all in the same process.

    python3 benchmarks/train_gpu.py [--config 1b|small_50m] [--seq 4096] [--steps 6] [--peak-tflops 989]
    python3 benchmarks/train_gpu.py --ab        # each speed change undone (same process)
    python3 benchmarks/train_gpu.py --ab --stacking  # and stacked vs per-expert routed weights
    python3 benchmarks/train_gpu.py --ab --mixes     # the mHC mixes kernel vs torch, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --products  # bf16-product vs TF32 projections, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --indexer   # the indexer score kernels vs torch, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --head      # the head's log-softmax kernels vs torch, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --norm-rope # q's norm and RoPE in one kernel vs two, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --moves     # the MoE's row-move kernels vs torch, CUDA graphs on
    python3 benchmarks/train_gpu.py --ab --pre       # mHC's pre kernels as one autograd node vs three, graphs on
    python3 benchmarks/train_gpu.py --ab --accum     # weight gradients into main_grad vs returned and added
    python3 benchmarks/train_gpu.py --ab --head-split  # the heads' backward split-bf16 vs TF32
    python3 benchmarks/train_gpu.py --ab --head-backward  # head logits kept vs recomputed; dz in 1 vs 2 terms
    python3 benchmarks/train_gpu.py --ab --streams   # hc_post's stream gradient added in hc_pre's pass vs by autograd
    python3 benchmarks/train_gpu.py --ab --add-cast  # the MoE's one-pass output sum vs add then cast
    python3 benchmarks/train_gpu.py --ab --wgrad-tiles  # the expert wgrad kernel's pointer vs TMA loads
    python3 benchmarks/train_gpu.py --ab --host-waits  # the host waiting for the GPU mid-step vs not
    python3 benchmarks/train_gpu.py --ab --adamw     # torch's fused AdamW + Megatron's copy vs one kernel
    python3 benchmarks/train_gpu.py --ab --mixes-prec  # the mHC mixes' dots: tf32x3 vs fn in three bf16 pieces
    python3 benchmarks/train_gpu.py --ab --pre-launches  # mHC pre's partial sums, norm factor: torch vs its kernels
    python3 benchmarks/train_gpu.py --ab --rope-inplace  # o's gradient rotated into a copy vs in place
    python3 benchmarks/train_gpu.py --ab --mixes-prefetch  # the mixes' backward: loads in their step vs prefetched
    python3 benchmarks/train_gpu.py --config flash_slice --ab --mixes-dx  # the mixes' dx dot: tf32x3 vs bf16 pieces
    python3 benchmarks/train_gpu.py --config flash_slice --ab --projections  # projection wgrads: hook vs main_grad
    python3 benchmarks/train_gpu.py --config flash_slice --ab --score-prec  # the indexer's dots: split3 vs bf16x3
    python3 benchmarks/train_gpu.py --profile [--graphs] [--shapes] [--rows N]  # time per op, syncs, activations
    python3 benchmarks/train_gpu.py --profile --graphs --options  # with the recipe's speed options on
    python3 benchmarks/train_gpu.py --profile --graphs --gaps [--trace FILE]  # and where the GPU waits for the host
    python3 benchmarks/train_gpu.py --memory [--graphs]  # what sets the peak memory (allocator history)
    python3 benchmarks/train_gpu.py --syncs     # where the step waits for the GPU

MFU = 6 x active non-embedding parameters x tokens/s / peak bf16 FLOP/s (attention
FLOPs are not counted for either model, so the V4 figure is conservative at long context);
"MFU+attn" adds attention's own products (attention_flops: the window, the selected or
visible compressed entries, the indexer's scores; causal dense attention for the baseline).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)

from benchmarks.model_cpu import DenseBaseline  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config  # noqa: E402
from plugins.deepseek_v4.config import YarnScaling  # noqa: E402


def spawned_rendezvous(w, rank: int, box, key, timeout_s: float = 300) -> tuple[str, int]:
    """Where the ranks of one `mp.spawn` meet: rank 0 puts the address of the store it already
    listens on (TrainWorker.rendezvous_address) into `box` (a Manager dict) under `key`, and
    every rank takes it from there. (A port found free in the parent and bound later by rank 0
    can be taken in between.)"""
    if rank == 0:
        box[key] = w.rendezvous_address()
    deadline = time.monotonic() + timeout_s
    while key not in box:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no rendezvous address in {timeout_s:.0f} s")
        time.sleep(0.05)
    return box[key]


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


def config_flash_slice(seq: int) -> DeepSeekV4Config:
    """V4-Flash's widths exactly (DSV4.md section 1) on a slice of its depth: layer 0 SWA and
    hash-routed, then CSA, HCA, CSA, HCA (Flash's alternation), and its SWA MTP block; the
    vocabulary is V4's. Routed experts: 8, the share of one GPU under EP=32 (256 / 32). Each
    token still takes its top 6, so a GPU's expert work per token is what it is at EP=32
    (tokens from all 32 ranks, 6 of 256 experts each, 8 of them here); the all-to-all is not
    in a one-GPU run."""
    return DeepSeekV4Config.tiny(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=5, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2048, routed_scaling_factor=1.5,
        index_n_heads=64, index_head_dim=128, index_topk=512, compress_ratios=[0, 4, 128, 4, 128, 0],
        num_hash_layers=1, sliding_window=128, rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0),
        max_position_embeddings=max(seq, 65536))


CONFIGS = {"1b": config_1b, "small_50m": config_small_50m, "flash_slice": config_flash_slice}


def active_params(cfg: DeepSeekV4Config, total: int) -> int:
    """Parameters a token passes through, without the embedding (routed experts: top-k of E)."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert * cfg.num_layers_total
    return total - idle - cfg.vocab_size * cfg.hidden_size


def attention_flops(cfg: DeepSeekV4Config, seq: int) -> float:
    """Training FLOPs per token of attention's own products (3 x forward), averaged over a
    sequence's positions: q.k and p.v over the keys each query sees (the window, plus the
    indexer's top-k compressed entries in CSA, every visible compressed entry in HCA), 2 x 2 x
    heads x head_dim each; and the indexer's scores of every visible compressed entry in CSA
    (2 x index heads x index_head_dim). Projections are in the parameter count already."""
    pos = torch.arange(1, seq + 1, dtype=torch.float64)  # keys visible to each query, itself included
    window = pos.clamp(max=cfg.sliding_window)
    total = 0.0
    for layer in range(cfg.num_layers_total):
        r = cfg.layer_ratio(layer)
        entries = (pos / r).floor() if r else torch.zeros_like(pos)
        keys = window + (entries.clamp(max=cfg.index_topk) if cfg.is_csa(r) else entries)
        total += 4 * cfg.num_attention_heads * cfg.head_dim * keys.mean().item()
        if cfg.is_csa(r):
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * entries.mean().item()
    return 3 * total


def repo_site(filename: str, line: int, name: str) -> str | None:
    """'path:line function' for a frame of this repository's code (not its .venv, not this
    script), else None: where the memory and sync reports attribute what they count."""
    if filename.startswith(ROOT) and "/.venv/" not in filename and not filename.endswith("train_gpu.py"):
        return f"{filename[len(ROOT) + 1:]}:{line} {name}"
    return None


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


# ---------------------------------------------------------------------------- A/B of the changes
def _set_adam(w, fused: bool) -> None:
    for o in getattr(w.opt, "chained_optimizers", [w.opt]):
        for group in o.optimizer.param_groups:
            group["fused"], group["foreach"] = fused, not fused
            if fused:
                for p in group["params"]:
                    st = o.optimizer.state.get(p)
                    if st and "step" in st:
                        st["step"] = st["step"].to(p.device, torch.float32)


def _set_norms(multi_tensor: bool) -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from miles.train import megatron_gpu

    clip_grads.l2_norm_impl = megatron_gpu._l2_norm if multi_tensor else utils.local_multi_tensor_l2_norm
    scale = megatron_gpu._scale if multi_tensor else utils.local_multi_tensor_scale
    clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = scale


class _UnfusedGates:
    """ops.hc_pre / ops.hc_head with the mHC gates kernel off (the A/B's earlier rows)."""

    def __init__(self):
        from plugins.deepseek_v4 import ops

        self.ops, self.pre, self.head = ops, ops.hc_pre, ops.hc_head

    def set(self, on: bool) -> None:
        pre, head = self.pre, self.head
        self.ops.hc_pre = pre if on else (lambda *a, **k: pre(*a, **{**k, "gates": False}))
        self.ops.hc_head = head if on else (lambda *a, **k: head(*a, **{**k, "gates": False}))


def ab_table(w, mbs, steps: int, tokens: int, cfg, peak_tflops: float) -> None:
    """Median step with the changes switched on one by one (same model, same process)."""
    keys = ("tf32", "norms", "adam", "elementwise", "gates", "graphs", "recompute")
    variants = [  # (name, tf32 projections, multi-tensor norm/scale, fused AdamW, fused elementwise, mHC gates,
        # CUDA graphs, recompute)
        ("kernels on, none of the changes", False, False, False, False, False, False, False),
        ("+ multi-tensor grad norm and scale", False, True, False, False, False, False, False),
        ("+ fused AdamW", False, True, True, False, False, False, False),
        ("+ TF32 fp32 projections", True, True, True, False, False, False, False),
        ("+ fused elementwise (norms, RoPE, SwiGLU, moves, head)", True, True, True, True, False, False, False),
        ("+ fused mHC gates (defaults)", True, True, True, True, True, False, False),
        ("+ CUDA graphs", True, True, True, True, True, True, False),
        ("defaults + recompute (memory)", True, True, True, True, True, False, True),
    ]
    gates = _UnfusedGates()
    rows = []
    try:
        for name, *flags in variants + variants[::-1][1:]:  # there and back
            on = dict(zip(keys, flags, strict=True))
            c = w.model.config
            c.tf32_projections, c.fused_elementwise, c.recompute = on["tf32"], on["elementwise"], on["recompute"]
            c.cuda_graphs = on["graphs"]
            gates.set(on["gates"])
            _set_norms(on["norms"])
            _set_adam(w, on["adam"])
            torch.cuda.reset_peak_memory_stats()
            ts = timed(lambda: w.train_step(mbs), steps)
            rows.append((name, statistics.median(ts), min(ts), max(ts), torch.cuda.max_memory_allocated() / 2**30))
    finally:
        gates.set(True)
    act = active_params(cfg, sum(p.numel() for p in w.model.parameters()))
    print(f"\n{torch.cuda.get_device_name()}  A/B, {steps} steps each (median, min, max); forward then back")
    print(f"{'variant':40s} {'step ms':>8s} {'min':>7s} {'max':>7s} {'tok/s':>8s} {'MFU':>6s} {'peak GiB':>8s} "
          f"{'vs first':>8s}")
    for name, med, lo, hi, mem in rows:
        tps = tokens / med
        print(f"{name:40s} {med * 1e3:8.1f} {lo * 1e3:7.1f} {hi * 1e3:7.1f} {tps:8,.0f} "
              f"{6 * act * tps / (peak_tflops * 1e12):6.1%} {mem:8.1f} {rows[0][1] / med:7.2f}x")


class PerExpertWeights(torch.nn.Module):
    """The routed experts as they were before stacking (for the A/B only): one Parameter per
    expert and weight kind, stacked on every read, so the backward splits the gradient into
    one tensor per expert, each accumulated and reduced on its own."""

    def __init__(self, stacked: torch.nn.Module):
        super().__init__()
        self.first = stacked.first
        for leaf in ("w1", "w3", "w2"):
            ps = torch.nn.ParameterList(torch.nn.Parameter(t.clone()) for t in getattr(stacked, leaf).detach())
            for p in ps:
                p.allreduce = False
            self.add_module(f"{leaf}_each", ps)

    w1 = property(lambda self: torch.stack(list(self.w1_each)))
    w3 = property(lambda self: torch.stack(list(self.w3_each)))
    w2 = property(lambda self: torch.stack(list(self.w2_each)))


def per_expert_weights(model: torch.nn.Module) -> None:
    from plugins.deepseek_v4.model import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.experts = PerExpertWeights(m.experts)


def stacking_ab(w, build, release, mbs, steps: int, tokens: int) -> None:
    """Stacked routed-expert weights against one Parameter per expert, alternating; each arm
    a fresh model and optimizer (the parameters differ) in this process."""
    rows = []
    for per_expert in (True, False) * 3:
        build("triton", per_expert_weights if per_expert else None)
        n = sum(1 for _ in w.model.parameters())
        ts = timed(lambda: w.train_step(mbs), steps)
        rows.append(("one parameter per expert" if per_expert else "stacked experts (default)", n,
                     statistics.median(ts), torch.cuda.max_memory_allocated() / 2**30))
        release()
    print(f"\n{torch.cuda.get_device_name()}  routed-expert weights A/B, {steps} steps each (median)")
    print(f"{'variant':30s} {'params':>7s} {'step ms':>8s} {'tok/s':>8s} {'peak GiB':>8s}")
    for name, n, med, mem in rows:
        print(f"{name:30s} {n:7d} {med * 1e3:8.1f} {tokens / med:8,.0f} {mem:8.1f}")


def _torch_mixes_pre(x, fn, base, scale, norm_eps, hc_eps, iters):
    """hc_pre's kernels path as it was before `mhc.stream_mixes`: a TF32 projection of an fp32
    copy of the streams and torch's norm (its backward an autograd chain over [R, n d]), then
    the gates and the stream sum kernels."""
    from plugins.deepseek_v4 import ops
    from plugins.deepseek_v4.kernels.mhc import hc_gates, weighted_sum

    flat = x.flatten(-2)
    nrm = torch.linalg.vector_norm(flat, dim=-1, dtype=torch.float32)
    pre, post, comb = hc_gates(ops.fp32_linear(flat, fn, True), nrm, base, scale, x.shape[-2], iters, hc_eps,
                               norm_eps, flat.shape[-1])
    return weighted_sum(pre, x), post, comb, x


def _three_node_pre(x, fn, base, scale, norm_eps, hc_eps, iters):
    """hc_pre's kernels as three autograd nodes (the mixes, the gates, the stream sum), as they
    were before `mhc.pre_streams`: autograd adds the two gradients of the streams."""
    from plugins.deepseek_v4.kernels.mhc import hc_gates, stream_mixes, weighted_sum

    flat = x.flatten(-2)
    mm, nrm = stream_mixes(flat, fn)
    pre, post, comb = hc_gates(mm, nrm, base, scale, x.shape[-2], iters, hc_eps, norm_eps, flat.shape[-1])
    return weighted_sum(pre, x), post, comb, x


def graphed_ab(w, mbs, steps: int, tokens: int, title: str, arms) -> None:
    """Arms [(name, switch(on: bool))] under CUDA graphs, alternating in one model, 3 rounds:
    each arm keeps its own captured graphs (a graph replays the code path it was captured
    with; a fresh model per arm ran out of memory: the released graphed models stayed alive)."""
    model, sets, rows = w.model, {}, []
    try:
        for name, switch in arms * 3:
            for _other, off in arms:
                off(False)
            switch(True)  # code outside the graphs (the heads, hc_head) follows the switch too
            model._graphs = sets.get(name)  # None: this arm's first step captures its graphs
            ts = timed(lambda: w.train_step(mbs), steps)
            sets[name] = model._graphs
            rows.append((name, statistics.median(ts), min(ts), max(ts)))
    finally:
        for _name, switch in arms:
            switch(False)
    print(f"\n{torch.cuda.get_device_name()}  {title} A/B, {steps} steps each (median, min, max); "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB with every arm's graphs")
    print(f"{'variant':46s} {'step ms':>8s} {'min':>7s} {'max':>7s} {'tok/s':>8s}")
    for name, med, lo, hi in rows:
        print(f"{name:46s} {med * 1e3:8.1f} {lo * 1e3:7.1f} {hi * 1e3:7.1f} {tokens / med:8,.0f}")


def _patch(module, attr: str, value):
    """switch(on): module.attr = value while on, the original otherwise."""
    original = getattr(module, attr)
    return lambda on: setattr(module, attr, value if on else original)


def _together(*switches):
    """One switch(on) that turns all of `switches` on or off, in order."""
    def switch(on: bool) -> None:
        for sw in switches:
            sw(on)
    return switch


def mixes_arms():
    """mHC's gate inputs through torch's projection and norm against the mixes kernel, both
    as separate autograd nodes (the one-node pre is `--pre`'s change)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, mixes through torch", _patch(ops, "_hc_pre_kernels", _torch_mixes_pre)),
            ("CUDA graphs, one-pass mixes kernel", _patch(ops, "_hc_pre_kernels", _three_node_pre))]


def products_arms():
    """The bf16 x bf16 fp32 projections' forward (heads, gate, compressor) as TF32 GEMMs of
    fp32 copies against bf16 GEMMs with fp32 output (`ops.bf16_products`)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, TF32 projections", _patch(ops, "bf16_products", lambda x, w: None)),
            ("CUDA graphs, bf16 products (default)", lambda on: None)]


def split_arms():
    """The bf16 fp32 projections' backward (compressor, gate) as TF32 GEMMs of fp32 copies of
    x and w against bf16 GEMMs of the gradient split in two bf16 terms (`ops.split_products`)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, TF32 projection backward", _patch(ops, "split_products", lambda *a: None)),
            ("CUDA graphs, split-bf16 projection backward (default)", lambda on: None)]


def clip_arms():
    """The gradient clip as Megatron's pass scaling every gradient before AdamW against the
    factor folded into fused AdamW (`megatron_gpu.step`)."""
    from miles.train import megatron_gpu

    return [("CUDA graphs, clip as its own pass", _patch(megatron_gpu, "step", lambda opt: opt.step()[:2])),
            ("CUDA graphs, clip inside the AdamW kernel (default)", lambda on: None)]


def host_wait_arms():
    """The step with the host waiting for the GPU where it used to (the gradient norm read to
    the host before the optimizer, the batches' copies pageable and checked again on the
    device) against none before the step's end (`megatron_gpu.grad_norm`, `MicroBatch.to`);
    and the loss terms' counts taken on the device's copies (small launches the GPU idles
    through before the forward) against the host's (`TrainWorker._global_counts`)."""
    from dataclasses import fields, replace

    from miles.train import megatron_gpu
    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker

    def read_norm(opt):
        return torch.tensor(opt.get_grad_norm(), dtype=torch.float64, device="cuda")

    def checked_to(mb, device):
        return replace(mb, **{f.name: getattr(mb, f.name).to(device) for f in fields(mb)
                              if getattr(mb, f.name) is not None})

    # as before: the counts of the batches reduced_gradients has just moved (it moves them first)
    move, count, moved = TrainWorker._to_device, TrainWorker._global_counts, {}

    def remember(w, micro_batches):
        moved["mbs"] = move(w, micro_batches)
        return moved["mbs"]

    norm, batches = _patch(megatron_gpu, "grad_norm", read_norm), _patch(MicroBatch, "to", checked_to)
    to_dev = _patch(TrainWorker, "_to_device", remember)
    on_dev = _patch(TrainWorker, "_global_counts", lambda w, _host: count(w, moved["mbs"]))

    def counts(on: bool) -> None:
        to_dev(on)
        on_dev(on)

    return [("CUDA graphs, host waits, device counts", lambda on: (norm(on), batches(on), counts(on))),
            ("CUDA graphs, no wait, device counts", counts),
            ("CUDA graphs, no wait, host counts (default)", lambda on: None)]


def adamw_arms():
    """AdamW as torch's fused kernel (the clip's divisor as its grad_scale, which stores the
    gradients back) followed by Megatron's copy of every main shard into the bf16 parameter
    buffer, against one kernel that updates and writes the bf16 weights (`miles.train.adamw`).
    (The first arm still maps the copies' destinations, host work the old step did not do.)"""
    import contextlib

    from miles.train import megatron_gpu

    @contextlib.contextmanager
    def torch_fused(subs, _copies, scale):  # the step as it was: the inner step is torch's
        for o in subs:
            o.optimizer.grad_scale = scale
        try:
            yield
        finally:
            for o in subs:
                o.optimizer.grad_scale = None

    return [("CUDA graphs, torch's fused AdamW + Megatron's copy",
             _patch(megatron_gpu, "_update_writes_weights", torch_fused)),
            ("CUDA graphs, one AdamW kernel writing bf16 (default)", lambda on: None)]


def mixes_prec_arms():
    """mHC's gate inputs (`mhc.stream_mixes`) with three TF32 products of both operands on the
    old tiles, against fn split into three exact bf16 pieces on the bf16 streams, with the
    stream sum's gradient loaded per element as before or as one column and a contiguous run
    per stream (the default)."""
    from plugins.deepseek_v4.kernels import mhc

    new = (mhc.MIX_PREC, mhc.MIX_FWD, mhc.MIX_BWD)
    old = ("tf32x3", dict(BS=16, BK=64, SPLIT=1, warps=4), dict(BS=16, BK=64, GROUPS=8, warps=4))

    def use(values):
        mhc.MIX_PREC, mhc.MIX_FWD, mhc.MIX_BWD = values

    gathered = _patch(mhc, "_in_stream", lambda d, bk: False)  # the stream sum's gradient per element

    def as_before(on):
        use(old if on else new)
        gathered(on)

    return [("CUDA graphs, mixes tf32x3 (old tiles)", as_before),
            ("CUDA graphs, mixes bf16x3, gathered loads", gathered),
            ("CUDA graphs, mixes bf16x3 (default)", lambda on: None)]


def out_proj_arms():
    """The attention's grouped output projection (forward, and its input gradient) as einsum,
    which permutes both operands into copies, against one bmm over strided group views."""
    from plugins.deepseek_v4 import ops

    def einsum_groups(a, b):
        return torch.einsum("tgk,gkn->tgn", a, b)

    return [("CUDA graphs, grouped out-projection by einsum", _patch(ops, "_group_mm", einsum_groups)),
            ("CUDA graphs, grouped out-projection by strided bmm (default)", lambda on: None)]


def wgrad_arms():
    """The grouped expert GEMMs' weight gradient as torch's grouped GEMM (bf16, then added into
    main_grad by the backward graph) against the kernel adding it into main_grad itself."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, expert weight gradient then an add", _patch(ops, "wgrad_into_main_grad",
                                                                     lambda *a: False)),
            ("CUDA graphs, expert weight gradient into main_grad (default)", lambda on: None)]


def wgrad_tiles_arms():
    """The expert weight-gradient kernel's loads: pointer tiles in 32-row steps (what it had)
    against TMA descriptors made per group in 64-row steps (`kernels.moe.WGRAD_ROWS_TMA`, the
    default on sm_90)."""
    from plugins.deepseek_v4.kernels import moe

    return [("CUDA graphs, expert wgrad by pointer tiles", _patch(moe, "wgrad_takes_tma", lambda dy, a: False)),
            ("CUDA graphs, expert wgrad by TMA (default)", lambda on: None)]


def accum_arms(model):
    """The linears' and heads' weight gradients returned in bf16 and added into main_grad by
    the backward graph (DDP's hook, eagerly) against each GEMM adding its fp32 sums into
    main_grad itself (Megatron's gradient_accumulation_fusion; the heads' `main_grad_of`)."""
    from megatron.core import tensor_parallel as tp

    from plugins.deepseek_v4 import parallel

    configs = {id(m.config): m.config for m in model.modules()
               if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear))}
    no_main = _patch(parallel, "main_grad_of", lambda w: None)

    def returned(on: bool) -> None:
        no_main(on)
        for c in configs.values():
            c.gradient_accumulation_fusion = not on

    return [("CUDA graphs, weight gradients returned, then added", returned),
            ("CUDA graphs, weight gradients into main_grad (default)", lambda on: None)]


def projections_arms(w):
    """The replicated projections' (wq_a, wkv, the indexer's, MTP's e/h_proj), the fp32 ones'
    (compressors, the router's gate) and wo_a's weight gradients returned in bf16 and added
    into main_grad by the backward graph (DDP's hook, eagerly) against added into main_grad by
    their GEMMs in fp32 (`ops.projection_main_grad`); and the mHC mixes' backward on a wider
    column tile (BS 32, BK 128, 3 stages: `benchmarks/mixes_gpu.py --width 16384`'s fastest).
    Each with the head's options + bf16 moments (moments_arms' last), the recipe's 31.4% row."""
    from plugins.deepseek_v4 import ops
    from plugins.deepseek_v4.kernels import mhc

    options = moments_arms(w)[-1][1]
    returned = _patch(ops, "projection_main_grad", lambda _w: None)
    wide = _patch(mhc, "MIX_BWD", dict(BS=32, BK=128, GROUPS=8, warps=4, stages=3, prefetch=False, dx_pieces=True))

    def with_options(*switches):
        def on_off(on: bool) -> None:
            options(on)
            for s in switches:
                s(on)
        return on_off

    return [("CUDA graphs, options, projection wgrads returned", with_options(returned)),
            ("CUDA graphs, options, projection wgrads into main_grad", with_options()),
            ("CUDA graphs, options, into main_grad, mixes bwd BK 128", with_options(wide))]


def head_split_arms():
    """The heads' backward GEMMs on TF32 (fp32 copies of y and w, dz rounded to TF32) against
    dz as two bf16 terms in bf16 GEMMs (`parallel.head_split`)."""
    from plugins.deepseek_v4 import parallel

    return [("CUDA graphs, head backward on TF32", _patch(parallel, "head_split", lambda y, w: False)),
            ("CUDA graphs, head backward split-bf16 (default)", lambda on: None)]


def head_backward_arms(model):
    """The heads' backward: logits computed again from y and w (default) against kept from the
    forward (config.head_keep_logits), and dz entering the GEMMs as two bf16 terms (default,
    the fp32 head's gradients) against one (head_grad_terms = 1, a bf16 head's rounding)."""
    c = model.config

    def keep(on: bool) -> None:
        c.head_keep_logits = on

    def one_term(on: bool) -> None:
        c.head_grad_terms = 1 if on else 2

    return [("CUDA graphs, head recomputes, dz in 2 terms (default)", lambda on: None),
            ("CUDA graphs, head logits kept", keep), ("CUDA graphs, head dz in 1 bf16 term", one_term),
            ("CUDA graphs, head logits kept, dz in 1 term", _together(keep, one_term))]


def moments_arms(w):
    """AdamW's moments kept in fp32 (default) against bf16 (train.optim.moments), alone and with
    both head options (head_backward_arms' last): the recipe's speed options together. A switch
    converts the moments at its arm's first step (in its timing: one step of 4 in the median's
    reach); the arms share one run's moments, so this measures time, not training."""
    from miles.train import adamw

    def bf16(on: bool) -> None:
        for o in getattr(w.opt, "chained_optimizers", [w.opt]):
            adamw.set_moments(o.optimizer, "bfloat16" if on else "float32")  # converted at the next step

    head_both = head_backward_arms(w.model)[-1][1]
    return [("CUDA graphs, fp32 moments (default)", lambda on: None), ("CUDA graphs, bf16 moments", bf16),
            ("CUDA graphs, head options + bf16 moments", _together(bf16, head_both))]


def indexer_arms():
    """The lightning indexer's scores through torch (chunked fp32 bmm's) against the kernels."""
    from plugins.deepseek_v4 import ops
    from plugins.deepseek_v4.kernels import indexer

    return [("CUDA graphs, indexer scores through torch", _patch(indexer, "indexer_scores", ops.indexer_scores)),
            ("CUDA graphs, indexer score kernels (default)", lambda on: None)]


def score_prec_arms(w):
    """The indexer's forward dots and dk as "split3" (three TF32 products of split fp32
    operands, q's zero low half among them) against "bf16x3" (bf16 dots of q with the fp32
    operand in three bf16 pieces; default), both with the head's options + bf16 moments."""
    from plugins.deepseek_v4.kernels import indexer

    options, split3 = moments_arms(w)[-1][1], _patch(indexer, "SCORE_PREC", "split3")
    return [("CUDA graphs, options, indexer dots split3", _together(split3, options)),
            ("CUDA graphs, options, indexer dots bf16x3 (default)", options)]


def head_arms():
    """The LM/MTP heads' chunk log-softmax and its gradient through torch against
    `kernels.cross_entropy` (one read forward, one pass backward)."""
    from plugins.deepseek_v4 import model
    from plugins.deepseek_v4.parallel import VocabHead

    def torch_head(y, w, ctx, tf32, fused):
        return VocabHead(y, w, ctx, tf32, False)

    return [("CUDA graphs, head log-softmax through torch", _patch(model, "VocabHead", torch_head)),
            ("CUDA graphs, head log-softmax kernels (default)", lambda on: None)]


def norm_rope_arms():
    """q's weightless norm then RoPE as two kernels each way (RMSNorm keeping its input, then
    the rotation) against `ops.norm_rope`'s one kernel each way. (The code it replaced ran
    the same two forward and three backward: both rotations back, then the norm's backward
    from its output.)"""
    from plugins.deepseek_v4 import ops
    from plugins.deepseek_v4.kernels import elementwise as ew

    def two_kernels(x, cos, sin, eps, fused=False):
        return ew.apply_rope(ew.rms_norm(x, None, eps), cos, sin)

    return [("CUDA graphs, q norm then RoPE (two kernels)", _patch(ops, "norm_rope", two_kernels)),
            ("CUDA graphs, q norm with RoPE (one kernel, default)", lambda on: None)]


def moves_arms():
    """The MoE's token <-> expert-row moves through torch (take_rows: a zero row appended by a
    copy, index_select, a [N, k, d] sum, casts) against `kernels.moe` (one pass each). The
    torch arm takes the experts' way in as three nodes (ops._ExpertsIn calls the kernels)."""
    from plugins.deepseek_v4 import ops

    rows_of, sum_slots = ops._rows_of, ops._sum_slots

    def torch_rows(on: bool) -> None:
        ops._rows_of = (lambda x, idx, dtype, fused: rows_of(x, idx, dtype, False)) if on else rows_of
        ops._sum_slots = (lambda y, rop, k, dtype, fused: sum_slots(y, rop, k, dtype, False)) if on else sum_slots

    return [("CUDA graphs, MoE row moves through torch",
             _together(torch_rows, _patch(ops, "experts_in", ops.experts_in_nodes))),
            ("CUDA graphs, MoE row-move kernels (default)", lambda on: None)]


def _one_node_pre(x, fn, base, scale, norm_eps, hc_eps, iters):
    """`mhc.pre_streams` with the streams handed to hc_post outside its node (as before
    `--streams`' change): autograd adds hc_post's gradient of them to the node's."""
    from plugins.deepseek_v4.kernels.mhc import pre_streams

    return (*pre_streams(x, fn, base, scale, iters, hc_eps, norm_eps)[:3], x)


def pre_arms():
    """mHC's pre-sublayer kernels as three autograd nodes against one (`mhc.pre_streams`: the
    streams' gradient written once); both hand the streams to hc_post outside the node, so the
    A/B is this change alone (`--streams` is the next one)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, mHC pre as three autograd nodes", _patch(ops, "_hc_pre_kernels", _three_node_pre)),
            ("CUDA graphs, mHC pre as one node", _patch(ops, "_hc_pre_kernels", _one_node_pre))]


def streams_arms():
    """hc_post's gradient of the streams added by autograd to hc_pre's (one more [R, n, d]
    pass a sublayer) against added inside hc_pre's backward (the streams through its node)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, streams' gradients added by autograd", _patch(ops, "_hc_pre_kernels", _one_node_pre)),
            ("CUDA graphs, added in hc_pre's backward (default)", lambda on: None)]


def embedding_arms():
    """The embedding's weight gradient by Megatron's lookup (torch's dense [V, d] gradient, then
    DDP's add into main_grad) against ops.embedding's rows added into main_grad (default)."""
    from megatron.core import tensor_parallel as tp

    from miles.train import parallel_context

    return [("CUDA graphs, embedding gradient dense [V, d] + add",
             _patch(parallel_context._VocabEmbedding, "forward", tp.VocabParallelEmbedding.forward)),
            ("CUDA graphs, embedding rows into main_grad (default)", lambda on: None)]


def head_wgrad_arms(w):
    """The heads' weight-gradient GEMM a chunk at a time (each reads and writes the whole fp32
    main_grad [V, d]) against over chunks gathered into a buffer of parallel.HEAD_WGRAD_BYTES
    (default 1 GiB) and of half and twice that, with the head's options + bf16 moments
    (moments_arms' last, the recipe's speed path)."""
    from plugins.deepseek_v4 import parallel

    options = moments_arms(w)[-1][1]
    size = lambda n: _together(_patch(parallel, "HEAD_WGRAD_BYTES", n), options)  # noqa: E731
    return [("CUDA graphs, options, head wgrad a chunk a GEMM", size(0)),
            ("CUDA graphs, options, head wgrad over 512 MiB", size(1 << 29)),
            ("CUDA graphs, options, head wgrad over 1 GiB (default)", options),
            ("CUDA graphs, options, head wgrad over 2 GiB", size(1 << 31))]


def unrope_arms(w):
    """o's inverse RoPE into a rotated copy of the whole of o for each of the out-projection's
    two passes against its RoPE columns rotated in place and put back (ops._unroped), with the
    head's options + bf16 moments."""
    from contextlib import contextmanager

    from plugins.deepseek_v4 import ops

    @contextmanager
    def copied(o, cos, sin, fused):
        yield ops.apply_rope(o, cos, sin, inverse=True, fused=fused)

    options = moments_arms(w)[-1][1]
    return [("CUDA graphs, options, o rotated into a copy", _together(_patch(ops, "_unroped", copied), options)),
            ("CUDA graphs, options, o rotated in place (default)", options)]


def experts_in_arms(w):
    """The routed experts' gather and both up-projections as three autograd nodes (autograd adds
    the two GEMMs' [M, d] input gradients, then the gather's backward sums each token's rows)
    against one node summing both in the gather's backward (ops._ExpertsIn), with the head's
    options + bf16 moments."""
    from plugins.deepseek_v4 import ops

    options = moments_arms(w)[-1][1]
    three = _patch(ops, "experts_in", ops.experts_in_nodes)
    return [("CUDA graphs, options, experts' way in: 3 nodes", _together(three, options)),
            ("CUDA graphs, options, one node (default)", options)]


def add_cast_arms():
    """The MoE's fp32 routed sum plus the shared expert, then a cast (two passes each way)
    against `ops.add_cast` (one forward pass, one backward cast)."""
    from plugins.deepseek_v4 import ops

    return [("CUDA graphs, MoE sum: add then cast", _patch(ops, "add_cast", lambda a, b, dt: (a + b).to(dt))),
            ("CUDA graphs, MoE sum: add_cast (default)", lambda on: None)]


def pre_launches_arms():
    """mHC pre's small launches: the mixes' K-split partials summed by torch and the norm's
    factor dnrm / nrm by torch (a sum each for mm and |x|^2 forward; a div, a compare and a
    where backward: ~5 launches a site, 40 sites) against both inside the gates kernels."""
    from plugins.deepseek_v4.kernels import mhc

    partials, gates_backward = mhc._mixes_partials, mhc._gates_backward

    def summed(x, fn):
        mm, sq, x2, fn32 = partials(x, fn)
        return mm.sum(0, keepdim=True), sq.sum(0, keepdim=True), x2, fn32

    def c_by_torch(kept, args, dpre, dpost, dcomb, as_c=False):
        dmm, dnrm, dbase, dscale = gates_backward(kept, args, dpre, dpost, dcomb)
        nrm = kept[1].view(dnrm.shape)
        return dmm, torch.where(nrm > 0, dnrm / nrm, 0.0), dbase, dscale

    as_before = [_patch(mhc, "_mixes_partials", summed), _patch(mhc, "_gates_backward", c_by_torch)]
    return [("CUDA graphs, mHC pre: parts and c by torch", lambda on: [f(on) for f in as_before]),
            ("CUDA graphs, mHC pre: in the gates kernels (default)", lambda on: None)]


def mixes_prefetch_arms():
    """The mHC mixes' backward on last session's tile (64-row steps, 2 stages, each step's
    loads waited for in the step) against the next step's loads issued first (32-row steps)."""
    from plugins.deepseek_v4.kernels import mhc

    old = dict(BS=64, BK=64, GROUPS=8, warps=4, stages=2, prefetch=False, dx_pieces=True)
    return [("CUDA graphs, mixes backward: loads in their step", _patch(mhc, "MIX_BWD", old)),
            ("CUDA graphs, mixes backward: prefetched (default)", lambda on: None)]


def mixes_dx_arms(w):
    """The mHC mixes' backward with dx's dot as tf32x3 on the tile before (32-row steps, 64
    columns) against the bf16 pieces on its tile now (`mhc.MIX_BWD`), with the head's options
    + bf16 moments."""
    from plugins.deepseek_v4.kernels import mhc

    options = moments_arms(w)[-1][1]
    old = _patch(mhc, "MIX_BWD", dict(BS=32, BK=64, GROUPS=8, warps=4, stages=1, prefetch=True, dx_pieces=False))
    return [("CUDA graphs, options, mixes dx tf32x3", _together(old, options)),
            ("CUDA graphs, options, mixes dx pieces (default)", options)]


def rope_inplace_arms():
    """The out-projection's backward rotating the gradient of o into a copy (all D columns
    read and written) against in place (its 2 x 32 rotated columns only)."""
    from plugins.deepseek_v4 import ops

    def copy(x, cos, sin, inverse=False, fused=False):
        return ops.apply_rope(x, cos, sin, inverse, fused)

    return [("CUDA graphs, o's gradient rotated into a copy", _patch(ops, "apply_rope_", copy)),
            ("CUDA graphs, rotated in place (default)", lambda on: None)]


def compile_experiment(w, mbs, mode: str, steps: int, tokens: int) -> None:
    from plugins.deepseek_v4 import ops

    torch._dynamo.config.cache_size_limit = 64
    base = timed(lambda: w.train_step(mbs), steps)
    if mode == "blocks":
        from plugins.deepseek_v4.kernels import indexer, mhc, sparse_attention

        # the Triton kernels stay eager: graph breaks around them, the code between compiles
        for mod, names in ((sparse_attention, ["sparse_attention"]), (indexer, ["attention_mass"]),
                           (mhc, ["sinkhorn", "weighted_sum", "hc_post"])):
            for n in names:
                setattr(mod, n, torch.compiler.disable(getattr(mod, n)))
        for layer in [*w.model.layers, *w.model.mtp]:
            layer.forward = torch.compile(layer.forward)
    else:
        for name in ("rms_norm", "apply_rope", "clamped_swiglu", "compress_pool", "sqrtsoftplus", "hc_mixes",
                     "indexer_scores", "hadamard"):
            setattr(ops, name, torch.compile(getattr(ops, name)))
    t = time.perf_counter()
    w.train_step(mbs)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    ts = timed(lambda: w.train_step(mbs), steps)
    b, c = statistics.median(base), statistics.median(ts)
    print(f"compile={mode}: eager {b * 1e3:.1f} ms ({tokens / b:,.0f} tok/s), compiled {c * 1e3:.1f} ms "
          f"({tokens / c:,.0f} tok/s, min {min(ts) * 1e3:.1f} max {max(ts) * 1e3:.1f}), {b / c:.2f}x; "
          f"first compiled step {first:.1f} s; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


# ---------------------------------------------------------------------------- diagnostics
def profile_step(w, mbs, shapes: bool = False, gaps: bool = False, trace: str | None = None, rows: int = 45) -> None:
    """Where one step's time goes (CUDA time per op, host syncs, GPU idle) and what the
    first micro-batch's forward keeps for the backward (saved tensors by module). With
    `shapes`, also the CUDA time per (op, input shapes): the shapes name the projection or
    the elementwise chain (eager only; inside CUDA graphs the profiler sees kernels, not ops).
    With `gaps`, where the GPU waits for the host (`idle_gaps`; the stacks slow the host, so the
    gaps read longer than in an unprofiled step). `trace`: a Chrome trace of the step to that file.
    `rows`: how many of the ops and kernels to list (the longest first)."""
    w.train_step(mbs)
    w.train_step(mbs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=shapes, with_stack=gaps or bool(trace)) as prof:
        t = time.perf_counter()
        w.train_step(mbs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    ev = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                      "cudaMemcpyAsync", "cudaEventSynchronize", "aten::item",
                                                      "aten::_local_scalar_dense", "cudaLaunchKernel", "cuLaunchKernel",
                                                      "cuLaunchKernelEx", "cudaLaunchKernelExC")}
    print(f"\nstep wall {wall * 1e3:.1f} ms, GPU kernels {kernel_us / 1e3:.1f} ms "
          f"({kernel_us / 1e6 / wall:.0%}); {syncs}")
    print(ev.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    if shapes:
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_device_time_total", row_limit=max(rows, 110), max_name_column_width=40,
            max_shapes_column_width=90))
    if gaps:
        idle_gaps(prof)
    if trace:
        prof.export_chrome_trace(trace)

    # saved tensors of one micro-batch's forward, by the innermost module that saved them
    stack, saved = ["(top)"], {}
    names = {m: n for n, m in w.model.named_modules()}

    def pre(mod, _args):
        stack.append(type(mod).__name__)

    def post(mod, _args, _out):
        stack.pop()

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if t.is_cuda and key not in saved:
            saved[key] = stack[-1]
        return t

    hooks = [m.register_forward_pre_hook(pre) for m in names] + [m.register_forward_hook(post) for m in names]
    base = torch.cuda.memory_allocated()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = w.model(mbs[0].input_ids.cuda(), aux=("indexer", "balance"))
            fwd_bytes = torch.cuda.memory_allocated() - base
    finally:
        for h in hooks:
            h.remove()
    by_mod: dict[str, int] = {}
    for (_ptr, nbytes), mod in saved.items():
        by_mod[mod] = by_mod.get(mod, 0) + nbytes
    print(f"forward of one micro-batch keeps {fwd_bytes / 2**30:.2f} GiB (allocated after it); saved tensors "
          f"{sum(by_mod.values()) / 2**30:.2f} GiB by module:")
    for mod, nbytes in sorted(by_mod.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {mod:28s} {nbytes / 2**30:7.3f} GiB")
    del out
    states = {"parameters": sum(p.numel() * p.element_size() for p in w.model.parameters())}
    print(f"model parameters {states['parameters'] / 2**30:.2f} GiB; allocated outside the step "
          f"{base / 2**30:.2f} GiB; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


def memory_sites(w, mbs, graphs: bool) -> None:
    """What sets the step's peak: the allocator's history (python stacks) from the build on,
    then the live blocks between steps and at the steady step's peak, summed by the innermost
    frame of this repository; with graphs, also the graph pool's segments and each graphed
    block's static buffers (inputs, outputs and their gradients, each buffer once)."""

    def site(frames) -> str:  # the allocator's frames, innermost first
        return next((s for f in frames if (s := repo_site(f["filename"], f["line"], f["name"]))),
                    "(outside the repository)")

    def table(title: str, sizes: dict[str, int], total: int) -> None:
        print(f"\n{title}: {total / 2**30:.2f} GiB")
        for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:18]:
            print(f"  {v / 2**30:7.3f} GiB  {k}")

    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    w.train_step(mbs)  # captures (graphs) or warms up
    first_peak = torch.cuda.max_memory_allocated()
    w.train_step(mbs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dev = torch.cuda.current_device()
    n0 = len(torch.cuda.memory._snapshot()["device_traces"][dev])
    assert n0 < 3_000_000, "the history's ring buffer would wrap during the step: raise max_entries"
    w.train_step(mbs)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    steady_peak = torch.cuda.max_memory_allocated()
    print(f"\npeak of the first step {first_peak / 2**30:.2f} GiB, of a later step {steady_peak / 2**30:.2f} GiB; "
          f"allocated between steps {base / 2**30:.2f} GiB; reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB, "
          f"its peak {torch.cuda.max_memory_reserved() / 2**30:.2f}")
    pools: dict[str, list[int]] = {}
    for seg in snap["segments"]:
        key = "graph pool" if seg.get("segment_pool_id", (0, 0)) != (0, 0) else "default pool"
        a = pools.setdefault(key, [0, 0])
        a[0] += seg["total_size"]
        a[1] += seg["allocated_size"]
    for k, (tot, alloc) in pools.items():
        print(f"{k}: segments {tot / 2**30:.2f} GiB, allocated in them {alloc / 2**30:.2f} GiB")
    # replay the step's events from the between-steps state to its peak
    trace = snap["device_traces"][dev][n0:]
    cur, peak, peak_i = base, base, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, peak_i = cur, i
    at_peak: dict[str, int] = {}
    alive = {}
    for e in trace[:peak_i + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    for e in alive.values():
        k = site(e["frames"])
        at_peak[k] = at_peak.get(k, 0) + e["size"]
    table("allocated within the step at its peak (event " + str(peak_i) + ")", at_peak, sum(at_peak.values()))
    between: dict[str, int] = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                pool = "[graph pool] " if seg.get("segment_pool_id", (0, 0)) != (0, 0) else ""
                k = pool + site(b.get("frames", []))
                between[k] = between.get(k, 0) + b["size"]
    table("live after the step, by where it was allocated", between, sum(between.values()))
    gs = getattr(w.model, "_graphs", None)
    if graphs and gs is not None:
        n, seen = {"inputs": 0, "outputs": 0, "output gradients": 0, "input gradients": 0}, set()
        for steps in gs._sets.values():
            for g in steps.values():
                for kind, ts in (("inputs", g.inputs), ("outputs", g.out), ("output gradients", g.grad_out),
                                 ("input gradients", g.grad_in)):
                    for t in ts:
                        if t is not None and t.data_ptr() not in seen:  # chained layers share buffers
                            seen.add(t.data_ptr())
                            n[kind] += t.numel() * t.element_size()
        print("graphed blocks' static buffers (each once): " +
              ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in n.items()))


def idle_gaps(prof, top: int = 15, least_us: float = 20.0) -> None:
    """Where the profiled step's GPU waits for its host: the gaps between GPU activity (kernels,
    copies, memsets) from the step's first host op to its last GPU op, the longest first, each
    with the innermost host op spanning it (a sync, a long host op) or, when none does (a
    launch-bound stretch), the ops most often started inside it. The Python frames around a
    gap are in the Chrome trace (--trace; the profiler's own buffer requests read as gaps too)."""
    evs = list(prof.events())
    gpu = sorted((e.time_range.start, e.time_range.end) for e in evs  # GPU work, not annotated ranges
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                 and not getattr(e, "is_user_annotation", False))
    cpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CPU]
    if not gpu or not cpu:
        print("no GPU or host events profiled")
        return
    start = min(e.time_range.start for e in cpu)
    gaps, t = [], start
    for a, b in gpu:
        if a - t > least_us:
            gaps.append((t, a))
        t = max(t, b)
    print(f"\nGPU idle in the step: {sum(b - a for a, b in gaps) / 1e3:.1f} ms of {(t - start) / 1e3:.1f} ms in "
          f"{len(gaps)} gaps over {least_us:.0f} us; the longest (ms, at ms into the step), with what the host "
          f"ran through each:")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        spanning = [e for e in cpu if e.time_range.start <= a and e.time_range.end >= b]
        if spanning:
            what = "inside " + max(spanning, key=lambda e: e.time_range.start).name
        else:
            inside: dict[str, int] = {}
            for e in cpu:
                if a <= e.time_range.start < b:
                    inside[e.name] = inside.get(e.name, 0) + 1
            what = ", ".join(f"{n} {k[:40]}" for k, n in sorted(inside.items(), key=lambda kv: -kv[1])[:4])
        print(f"  {(b - a) / 1e3:7.3f} at {(a - start) / 1e3:6.1f}  {what}")


def sync_sites(w, mbs) -> None:
    """Where one step makes the host wait for the GPU (torch's sync debug mode: .item(),
    pageable host-to-device copies, nonzero, ...), counted by the innermost frame of this
    repository. A host-bound step loses its run-ahead at each one."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # other warnings of the step (Megatron's deprecations)
            return
        stack = traceback.extract_stack()[:-1]  # outermost first
        mine = next((s for f in reversed(stack) if (s := repo_site(f.filename, f.lineno, f.name))), "?")
        inner = [f for f in stack if not f.filename.endswith("warnings.py")][-1]
        where = f"{mine}  (in {inner.filename.rsplit('/', 2)[-1]}:{inner.lineno} {inner.name})"
        sites[where] = sites.get(where, 0) + 1

    w.train_step(mbs)
    torch.cuda.synchronize()
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            w.train_step(mbs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    print(f"\nsynchronizing calls in one step: {sum(sites.values())}")
    for where, n in sorted(sites.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {n:5d}  {where}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (micro-batches of 1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--profile", action="store_true", help="print where one V4 step's time and memory go")
    ap.add_argument("--memory", action="store_true", help="what sets the step's peak memory (allocator history)")
    ap.add_argument("--syncs", action="store_true", help="print where one step synchronizes with the GPU")
    ap.add_argument("--ab", action="store_true", help="the step with each speed change undone, in one process")
    ap.add_argument("--graphs", action="store_true", help="with --profile or --syncs: CUDA graphs on")
    ap.add_argument("--shapes", action="store_true", help="with --profile: CUDA time per op and input shapes")
    ap.add_argument("--gaps", action="store_true", help="with --profile: where the GPU waits for the host")
    ap.add_argument("--trace", help="with --profile: write the step's Chrome trace to this file")
    ap.add_argument("--rows", type=int, default=45, help="with --profile: how many ops and kernels to list")
    ap.add_argument("--options", action="store_true",
                    help="with --profile: the recipe's speed options on (head logits kept, dz in 1 term, bf16 moments)")
    ap.add_argument("--host-waits", action="store_true", help="with --ab: only the step's host waits vs none")
    ap.add_argument("--adamw", action="store_true", help="with --ab: only torch's AdamW + copy vs one kernel")
    ap.add_argument("--stacking", action="store_true", help="with --ab: also stacked vs per-expert weights")
    ap.add_argument("--mixes", action="store_true", help="with --ab: only the mHC mixes kernel vs torch (graphs)")
    ap.add_argument("--pre-launches", action="store_true",
                    help="with --ab: only mHC pre's partial sums and norm factor by torch vs in its kernels")
    ap.add_argument("--mixes-prefetch", action="store_true",
                    help="with --ab: only the mixes' backward with its loads in their step vs prefetched")
    ap.add_argument("--mixes-dx", action="store_true",
                    help="with --ab: only the mixes' backward with dx's dot as tf32x3 vs bf16 pieces")
    ap.add_argument("--rope-inplace", action="store_true",
                    help="with --ab: only o's gradient rotated into a copy vs in place")
    ap.add_argument("--projections", action="store_true",
                    help="with --ab: the projections' weight gradients returned vs into main_grad; a wider mixes tile")
    ap.add_argument("--mixes-prec", action="store_true",
                    help="with --ab: the mHC mixes' tf32x3 dots vs bf16x3 (graphs)")
    ap.add_argument("--products", action="store_true", help="with --ab: only bf16 vs TF32 projections (graphs)")
    ap.add_argument("--split", action="store_true", help="with --ab: only split-bf16 vs TF32 projection backward")
    ap.add_argument("--wgrad", action="store_true", help="with --ab: only the expert wgrad into main_grad vs an add")
    ap.add_argument("--wgrad-tiles", action="store_true", help="with --ab: the expert wgrad's pointer vs TMA loads")
    ap.add_argument("--out-proj", action="store_true", help="with --ab: only the out-projection's bmm vs einsum")
    ap.add_argument("--clip", action="store_true", help="with --ab: only the clip inside fused AdamW vs its own pass")
    ap.add_argument("--accum", action="store_true", help="with --ab: only weight gradients into main_grad vs returned")
    ap.add_argument("--head-split", action="store_true", help="with --ab: only the head backward split-bf16 vs TF32")
    ap.add_argument("--head-backward", action="store_true",
                    help="with --ab: the head's logits kept vs recomputed, dz in one bf16 term vs two")
    ap.add_argument("--moments", action="store_true",
                    help="with --ab: AdamW's moments in bf16 vs fp32, and with the head's options")
    ap.add_argument("--indexer", action="store_true", help="with --ab: only the indexer score kernels vs torch")
    ap.add_argument("--head", action="store_true", help="with --ab: only the head's log-softmax kernels vs torch")
    ap.add_argument("--score-prec", action="store_true",
                    help="with --ab: the indexer's dots split3 vs bf16x3 (with the options)")
    ap.add_argument("--norm-rope", action="store_true", help="with --ab: only q's norm+RoPE kernel vs two kernels")
    ap.add_argument("--moves", action="store_true", help="with --ab: only the MoE's row-move kernels vs torch")
    ap.add_argument("--pre", action="store_true", help="with --ab: only mHC's pre as one autograd node vs three")
    ap.add_argument("--streams", action="store_true",
                    help="with --ab: only hc_post's stream gradient added in hc_pre's backward vs by autograd")
    ap.add_argument("--add-cast", action="store_true", help="with --ab: only the MoE's one-pass sum vs add then cast")
    ap.add_argument("--embedding", action="store_true", help="with --ab: the embedding's gradient dense vs by rows")
    ap.add_argument("--head-wgrad", action="store_true",
                    help="with --ab: the heads' weight gradient a chunk a GEMM vs over buffers of 0.5, 1, 2 GiB")
    ap.add_argument("--experts-in", action="store_true",
                    help="with --ab: the experts' gather and w1/w3 GEMMs as three nodes vs one (with the options)")
    ap.add_argument("--unrope", action="store_true",
                    help="with --ab: o's inverse RoPE into a copy vs in place and put back (with the options)")
    ap.add_argument("--compile", choices=["none", "blocks", "ops"], default="none",
                    help="experiment: torch.compile each block's forward, or the elementwise ops")
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

    def build(kernels: str, edit=None, graphs: bool = False) -> int:
        total = w.build_model({**cfg.to_dict(), "kernels": kernels, "cuda_graphs": graphs}, seed=0,
                              dtype="bfloat16")
        if edit is not None:  # a variant of the model's modules, before DDP and the optimizer see them
            edit(w.model)
        w.setup_training(lr=1e-4, warmup_steps=0, total_steps=1000)
        return total

    def release() -> None:
        if w.ddp is not None:  # its grad hooks hold it, the model and buffers in a cycle through C++
            w.ddp.grad_accs.clear()
        w.model = w.ddp = w.opt = w.sched = None  # the scheduler holds the optimizer
        gc.collect()  # a step that ran out of memory leaves its graph in reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    if a.memory:
        build("triton", graphs=a.graphs)
        memory_sites(w, mbs, a.graphs)
        return
    if a.profile or a.syncs:
        build("triton", graphs=a.graphs)
        if a.options:
            moments_arms(w)[-1][1](True)
        sync_sites(w, mbs) if a.syncs else profile_step(w, mbs, a.shapes, a.gaps, a.trace, a.rows)
        return
    if a.compile != "none":
        build("triton")
        compile_experiment(w, mbs, a.compile, a.steps, tokens)
        return
    graphed = {"mixes": ("mHC mixes", mixes_arms), "products": ("fp32 projections", products_arms),
               "split": ("fp32 projection backward", split_arms), "clip": ("gradient clip", clip_arms),
               "out_proj": ("grouped out-projection", out_proj_arms), "wgrad": ("expert weight gradient", wgrad_arms),
               "wgrad_tiles": ("expert weight-gradient tiles", wgrad_tiles_arms),
               "indexer": ("indexer scores", indexer_arms), "head": ("head log-softmax", head_arms),
               "score_prec": ("indexer dots", score_prec_arms),
               "norm_rope": ("q norm and RoPE", norm_rope_arms), "moves": ("MoE row moves", moves_arms),
               "pre": ("mHC pre", pre_arms), "accum": ("weight gradient accumulation", accum_arms),
               "head_split": ("head backward", head_split_arms), "streams": ("mHC stream gradients", streams_arms),
               "head_backward": ("head backward options", head_backward_arms),
               "moments": ("AdamW moments", moments_arms),
               "add_cast": ("MoE output sum", add_cast_arms),
               "embedding": ("embedding gradient", embedding_arms),
               "head_wgrad": ("head weight gradient", head_wgrad_arms),
               "unrope": ("o's inverse RoPE", unrope_arms),
               "experts_in": ("experts' way in", experts_in_arms),
               "host_waits": ("host waits", host_wait_arms),
               "adamw": ("AdamW", adamw_arms),
               "mixes_prec": ("mHC mixes' dots", mixes_prec_arms),
               "pre_launches": ("mHC pre's small launches", pre_launches_arms),
               "rope_inplace": ("o's gradient rotation", rope_inplace_arms),
               "mixes_prefetch": ("mHC mixes' backward loads", mixes_prefetch_arms),
               "mixes_dx": ("mHC mixes' dot pieces", mixes_dx_arms),
               "projections": ("projection weight gradients", projections_arms)}  # --ab --FLAG: its arms, graphs on
    chosen = [flag for flag in graphed if getattr(a, flag)]
    if a.ab and chosen:
        build("triton", graphs=True)
        for flag in chosen:
            title, arms = graphed[flag]
            takes = {"moments": w, "head_wgrad": w, "unrope": w, "experts_in": w, "projections": w, "score_prec": w,
                     "mixes_dx": w, "accum": w.model, "head_backward": w.model}
            made = arms(takes[flag]) if flag in takes else arms()
            graphed_ab(w, mbs, a.steps, tokens, title, made)
        return
    if a.ab:
        build("triton")
        ab_table(w, mbs, a.steps, tokens, cfg, a.peak_tflops)
        release()
        if a.stacking:
            stacking_ab(w, build, release, mbs, a.steps, tokens)
        return
    runs = []  # (name, total params, active params, step times or None (OOM), peak GiB, peak reserved GiB)
    # kernels off first: its dense-masked attention is the one near the memory limit
    arms = (("torch", False, "DeepSeek-V4, kernels off"), ("triton", False, "DeepSeek-V4, kernels on"),
            ("triton", True, "DeepSeek-V4, kernels on, CUDA graphs"))
    # at V4's 64 heads the dense-masked attention of kernels off does not fit (its OOM surfaced inside NCCL)
    for kernels, graphs, name in arms[1:] if a.config == "flash_slice" else arms:
        total = build(kernels, graphs=graphs)
        try:
            ts = timed(lambda: w.train_step(mbs), a.steps)
        except torch.OutOfMemoryError:
            ts = None
        runs.append((name, total, active_params(cfg, total), ts, torch.cuda.max_memory_allocated() / 2**30,
                     torch.cuda.max_memory_reserved() / 2**30))
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
                 torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30))

    peak = a.peak_tflops * 1e12
    print(f"\n{torch.cuda.get_device_name()}  seq={a.seq}  batch={a.batch}  steps={a.steps} (median)")
    # peak: the allocator's most allocated; reserved: its most held, which with CUDA graphs is the
    # figure to read (a graph pool's activations replay in its free blocks, counted as reserved only)
    print(f"{'model':38s} {'params':>8s} {'active':>8s} {'step ms':>9s} {'tok/s':>9s} {'MFU':>6s} {'MFU+attn':>8s} "
          f"{'peak GiB':>9s} {'reserved':>9s}")
    v4_attn = attention_flops(cfg, a.seq)
    dense_attn = 3 * 4 * cfg.hidden_size * (a.seq + 1) / 2 * cfg.num_layers_total  # H heads of hidden / H
    for name, tot, act, ts, mem, res in runs:
        if ts is None:
            print(f"{name:38s} {tot / 1e9:7.2f}B {act / 1e9:7.2f}B {'OOM':>9s}")
            continue
        med = statistics.median(ts)
        tps = tokens / med
        attn = dense_attn if name.startswith("dense") else v4_attn
        print(f"{name:38s} {tot / 1e9:7.2f}B {act / 1e9:7.2f}B {med * 1e3:9.1f} {tps:9,.0f} "
              f"{6 * act * tps / peak:6.1%} {(6 * act + attn) * tps / peak:8.1%} {mem:9.1f} {res:9.1f}")
    off = runs[0][3] if runs[0][0].endswith("off") else None
    on = runs[-2][3] or runs[-3][3]
    if on and off:
        print(f"V4 kernels on / off tokens/s: {statistics.median(off) / statistics.median(on):.2f}x")
    if on:
        print(f"dense / V4 (kernels on) tokens/s: {statistics.median(on) / statistics.median(dn):.2f}x")


if __name__ == "__main__":
    main()
