"""The Megatron-core CPU bridge (miles/train/megatron_cpu.py): version pin, CUDA guard, and
TP=2, DP=2 (DDP + DistributedOptimizer) and PP=2 (1F1B) over gloo in 2 real processes,
each compared with the same computation in one process; and the linears' weight gradients
added into DDP's main_grad by megatron_gpu's GEMM (gradient_accumulation_fusion)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_close, assert_finite

megatron_core = pytest.importorskip("megatron.core")

from miles.cluster.node import free_port  # noqa: E402
from miles.train import megatron_cpu  # noqa: E402


def _init(rank: int, port: int, **parallel) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    assert megatron_cpu.apply()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(**parallel)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(8, 12, generator=g)


def _tp_worker(rank: int, port: int, seed: int, out: str) -> None:
    _init(rank, port, tensor_model_parallel_size=2)
    from megatron.core import tensor_parallel as tp
    from megatron.core.model_parallel_config import ModelParallelConfig

    tp.model_parallel_cuda_manual_seed(seed)  # the RNG tracker works on CPU
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                              params_dtype=torch.float32)
    x, w1, w2 = _inputs(seed)
    col = tp.ColumnParallelLinear(8, 12, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                  gather_output=False)
    row = tp.RowParallelLinear(12, 8, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                               input_is_parallel=True, skip_bias_add=True)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(2, 0)[rank])
        row.weight.copy_(w2.chunk(2, 1)[rank])
    x = x.requires_grad_()
    y, _ = row(col(x)[0])
    (y * torch.arange(8.0)).sum().backward()
    torch.save({"y": y.detach(), "dx": x.grad, "dw1": col.weight.grad, "dw2": row.weight.grad}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _fusion_worker(rank: int, port: int, seed: int, out: str, fused: bool) -> None:
    """MegatronContext's TP=2 column -> row linears under Megatron DDP, two micro-batches
    accumulated: with gradient_accumulation_fusion (megatron_gpu's wgrad GEMM) or without."""
    _init(rank, port, tensor_model_parallel_size=2)
    from megatron.core import tensor_parallel as tp
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from miles.train.parallel_context import MegatronContext

    tp.model_parallel_cuda_manual_seed(seed)
    ctx = MegatronContext(torch.float32)
    ctx.mp.gradient_accumulation_fusion = fused
    model = torch.nn.Sequential(ctx.column_linear(8, 12, torch.float32), ctx.row_linear(12, 8, torch.float32))
    x, w1, w2 = _inputs(seed)
    with torch.no_grad():
        model[0].weight.copy_(w1.chunk(2, 0)[rank])
        model[1].weight.copy_(w2.chunk(2, 1)[rank])
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                            tensor_model_parallel_size=2)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.zero_grad_buffer()
    from miles.train import megatron_gpu

    gemm, calls = megatron_gpu._WgradAccumulation.wgrad_gemm_accum_fp32, []

    def counted(*args):
        calls.append(1)
        gemm(*args)

    megatron_gpu._WgradAccumulation.wgrad_gemm_accum_fp32 = staticmethod(counted)
    for mb in range(2):
        (ddp(x * (mb + 1)) * torch.arange(8.0)).sum().backward()
    ddp.finish_grad_sync()
    torch.save({"main": [p.main_grad.clone() for p in model.parameters()], "gemms": len(calls)}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _dp_worker(rank: int, port: int, seed: int, out: str, clip_in_adam: bool = False, clip: float = 1.0,
               overflow: bool = False) -> None:
    _init(rank, port)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0,
                                                 clip_grad=clip,
                                                 use_distributed_optimizer=True), [ddp])
    if clip_in_adam:  # megatron_gpu.step's path: the AdamW kernel (Triton's interpreter), the clip inside it
        from miles.train import megatron_gpu

        for o in getattr(opt, "chained_optimizers", [opt]):
            for group in o.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
        assert megatron_gpu._fused_adams(opt)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    norms = []
    for step in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        # a target off 0: with mean(y^2) the gradient shrinks toward 0 and fell under the clip (~1 in 1,700)
        (ddp(data[step, rank * 4:(rank + 1) * 4]) - 1).pow(2).mean().backward()
        ddp.finish_grad_sync()
        if overflow and step == 1:  # the norm's sum of squares overflows fp32: inf
            model[2].weight.main_grad.mul_(1e30)
        ok, gn = megatron_gpu.step(opt) if clip_in_adam else opt.step()[:2]
        assert ok
        norms.append(float(gn))
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "norms": norms}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _bf16_dp_model(seed: int):
    """A two-layer bf16 model (weights with biases: two parameter groups) under Megatron DDP and
    its DistributedOptimizer (fp32 main shards, weight decay, a clip below every norm here)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(torch.bfloat16)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            bf16=True, params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=CLIP_IN_ADAM,
                                                 bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def _bf16_worker(rank: int, port: int, seed: int, out: str, mine: bool) -> None:
    """DP=2 with bf16 weights (fp32 main shards), weight decay on the weights and not on the
    biases (two parameter groups), a clip below every norm, 3 steps: megatron_gpu.step (the
    AdamW kernel writes the bf16 weights) when `mine`, else Megatron's own step. After each of
    mine, Megatron's own copy of the main shards into the parameter buffer and its all-gather
    run again: what they change is what the kernel failed to write."""
    _init(rank, port)
    from miles.train import megatron_gpu

    model, ddp, opt = _bf16_dp_model(seed)
    subs = getattr(opt, "chained_optimizers", [opt])
    if mine:
        for o in subs:
            for group in o.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
        copies = [megatron_gpu.model_copies(o) for o in subs]
        assert all(cp and all(d is not None and d.dtype == torch.bfloat16 for d in cp.values()) for cp in copies)
    start = [p.detach().clone() for p in model.parameters()]
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    norms, stale = [], []
    for step in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(data[step, rank * 4:(rank + 1) * 4]).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        ok, gn = megatron_gpu.step(opt) if mine else opt.step()[:2]
        assert ok
        norms.append(float(gn))
        if mine:
            written = [p.detach().clone() for p in model.parameters()]
            for o in subs:
                o._copy_main_params_to_model_params()
                for chunk in o.model_chunks:
                    chunk.start_param_sync()
            stale.append(sum(int((a != b.detach()).sum()) for a, b in zip(written, model.parameters(), strict=True)))
    mains = [p.detach().clone() for o in subs for g in o.shard_fp32_from_float16_groups for p in g]
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "start": start, "mains": mains,
                "norms": norms, "stale": stale}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _norm_worker(rank: int, port: int, seed: int, out: str) -> None:
    """megatron_gpu.grad_norm and Megatron's get_grad_norm on stand-ins for Megatron's
    optimizers (their gradients and statistics groups; Megatron's own methods): one optimizer,
    a chain sharing one group, a chain whose groups differ (the world, each rank alone) with a
    member holding no gradients."""
    _init(rank, port)
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    from miles.train import megatron_gpu

    alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank makes every group
    world = dist.group.WORLD
    g = torch.Generator().manual_seed(seed + rank)  # each rank its own gradients

    class Sub:
        get_grad_norm = MegatronOptimizer.get_grad_norm

        def __init__(self, sizes, group):
            self.grads, self.group = [torch.randn(n, generator=g) * 10 ** torch.randn(()) for n in sizes], group

        def get_main_grads_for_grad_norm(self):
            return self.grads

        def get_grad_stats_parallel_group(self):
            return self.group

    class Chain:
        grads_states_parallel_group_is_shared = ChainedOptimizer.grads_states_parallel_group_is_shared
        get_grad_stats_parallel_group = ChainedOptimizer.get_grad_stats_parallel_group
        get_grad_norm = ChainedOptimizer.get_grad_norm

        def __init__(self, subs):
            self.chained_optimizers = subs

    cases = {"one": Sub([7, 300], world), "shared": Chain([Sub([5, 64], world), Sub([33], world)]),
             "apart": Chain([Sub([5, 64], world), Sub([33, 2], alone), Sub([], alone)])}
    res = {k: (megatron_gpu.grad_norm(o).item(), float(o.get_grad_norm())) for k, o in cases.items()}
    torch.save(res, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _pp_worker(rank: int, port: int, seed: int, out: str) -> None:
    _init(rank, port, pipeline_model_parallel_size=2)
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 8) for _ in range(2)]  # the same two layers on both ranks

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.config, self.model_type, self.inp = layers[rank], cfg, ModelType.encoder_or_decoder, None

        def set_input_tensor(self, t):
            self.inp = t[0] if isinstance(t, list) else t

        def forward(self, x):
            return torch.tanh(self.layer(x if rank == 0 else self.inp))

    stage = Stage()
    data = torch.randn(4, 2, 3, 8, generator=torch.Generator().manual_seed(seed + 1))  # 4 micro-batches [S, B, d]

    def step(it, model):
        out = model(next(it))
        return out, lambda o: (o.pow(2).mean(), {"loss": o.pow(2).mean().detach()})

    res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(data), model=[stage],
                                      num_microbatches=4, seq_length=2, micro_batch_size=3, forward_only=False)
    losses = [r["loss"] for r in res] if rank == 1 else []
    torch.save({"w": stage.layer.weight.grad, "b": stage.layer.bias.grad, "losses": losses}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


CLIP_IN_ADAM = 0.05  # below every step's gradient norm: each step clips


def _moments_worker(rank: int, port: int, seed: int, out: str) -> None:
    """DP=2 with bf16 weights, 3 steps of megatron_gpu.step three times from the same start:
    fp32 moments by the AdamW kernel, bf16 moments by the kernel, and bf16 moments by
    Megatron's own step (its clip and copy; AdamW by adamw.update's torch path). Records each run's main
    shards and moments after step 1 and step 3."""
    _init(rank, port)
    from miles.train import adamw, megatron_gpu

    res = {}
    for name, moments, fused in (("fp32", "float32", True), ("bf16", "bfloat16", True),
                                 ("bf16_megatron", "bfloat16", False)):
        _model, ddp, opt = _bf16_dp_model(seed)
        subs = getattr(opt, "chained_optimizers", [opt])
        for o in subs:
            adamw.set_moments(o.optimizer, moments)
            for group in o.optimizer.param_groups:
                group["fused"], group["foreach"] = fused, not fused
        data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
        for step in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(data[step, rank * 4:(rank + 1) * 4]).float().pow(2).mean().backward()
            ddp.finish_grad_sync()
            assert megatron_gpu.step(opt)[0]
            if step in (0, 2):
                mains = [p for o in subs for g in o.shard_fp32_from_float16_groups for p in g]
                st = [o.optimizer.state[p] for o in subs for g in o.shard_fp32_from_float16_groups for p in g]
                res[f"{name}{step + 1}"] = [p.detach().clone() for p in mains]
                res[f"{name}{step + 1}_m"] = [s["exp_avg"].clone() for s in st]
                res[f"{name}{step + 1}_v"] = [s["exp_avg_sq"].clone() for s in st]
    torch.save(res, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _spawn(worker, tmp_path, seed, *extra) -> list[dict]:
    # The workers are the CPU processes under test (the bridge stays off where CUDA exists):
    # on a GPU machine they see none, and run the Triton kernels (the AdamW) in the interpreter
    # as on a CPU machine.
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    try:
        mp.spawn(worker, args=(free_port(), seed, str(tmp_path), *extra), nprocs=2)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]


def test_version_pin_fails_loudly(monkeypatch):
    """Guards running the bridge on a Megatron-core whose CUDA call sites moved."""
    if torch.cuda.is_available():
        pytest.skip("the bridge is inactive with CUDA")
    monkeypatch.setattr(megatron_core, "__version__", "0.17.0")
    with pytest.raises(megatron_cpu.MegatronVersionError, match="0.16.1"):
        megatron_cpu.apply()


def test_bridge_is_inactive_when_cuda_exists(monkeypatch):
    """Guards the bridge changing GPU behaviour: with CUDA present it patches nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.zeros
    assert megatron_cpu.apply() is False
    assert torch.zeros is before


def test_tensor_parallel_linears_match_single_process(tmp_path, seed):
    """TP=2 column -> row parallel linears: output, input gradient and weight-shard gradients
    equal the unsharded computation (the RNG tracker seeds on CPU too)."""
    r = _spawn(_tp_worker, tmp_path, seed)
    x, w1, w2 = _inputs(seed)
    x, w1, w2 = x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_()
    y = x @ w1.t() @ w2.t()
    (y * torch.arange(8.0)).sum().backward()
    # fp32, sums split across ranks in another order: ~1e-7 relative on values of size ~10
    for rank in range(2):
        assert_close(r[rank]["y"], y.detach(), atol=1e-5, rtol=1e-5, what="output")
        assert_close(r[rank]["dx"], x.grad, atol=1e-5, rtol=1e-5, what="dx")
        assert_close(r[rank]["dw1"], w1.grad.chunk(2, 0)[rank], atol=1e-5, rtol=1e-5, what="dw1 shard")
        assert_close(r[rank]["dw2"], w2.grad.chunk(2, 1)[rank], atol=1e-5, rtol=1e-5, what="dw2 shard")


@pytest.mark.parametrize("fused", [True, False])
def test_linears_add_their_weight_gradient_into_main_grad(tmp_path, seed, fused):
    """MegatronContext's linears under Megatron DDP with gradient_accumulation_fusion (the apex
    GEMM Megatron calls, supplied by megatron_gpu: main_grad += dy^T x) and without: each
    weight's main_grad after two accumulated micro-batches is the unsharded gradient's shard
    (a second add by DDP's hook, or none, would be off by a whole gradient), and with the
    fusion each linear's backward went through the GEMM (2 linears x 2 micro-batches)."""
    r = _spawn(_fusion_worker, tmp_path, seed, fused)
    x, w1, w2 = _inputs(seed)
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    for mb in range(2):
        ((x * (mb + 1)) @ w1.t() @ w2.t() * torch.arange(8.0)).sum().backward()
    for rank in range(2):
        assert r[rank]["gemms"] == (4 if fused else 0)
        got1, got2 = r[rank]["main"]
        assert_close(got1, w1.grad.chunk(2, 0)[rank], atol=1e-4, rtol=1e-5, what="w1 main_grad shard")
        assert_close(got2, w2.grad.chunk(2, 1)[rank], atol=1e-4, rtol=1e-5, what="w2 main_grad shard")


@pytest.mark.parametrize("clip_in_adam", [False, True])
def test_ddp_distributed_optimizer_matches_single_process_adam(tmp_path, seed, clip_in_adam):
    """DP=2 with Megatron DDP + DistributedOptimizer (sharded Adam state, grad clipping) for 3
    steps equals one process running Adam on the whole batch: same parameters on both ranks,
    same gradient norms. clip_in_adam: fused AdamW with the clip folded into it
    (megatron_gpu.step, the trainer's GPU step) and a clip below every step's norm."""
    clip = CLIP_IN_ADAM if clip_in_adam else 1.0
    r = _spawn(_dp_worker, tmp_path, seed, clip_in_adam, clip)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    norms = []
    for step in range(3):
        opt.zero_grad()
        # each rank averages its half; DDP averages the two means = the full-batch mean
        (model(data[step]) - 1).pow(2).mean().backward()
        # Megatron's OptimizerConfig clips at grad norm 1.0 by default: the same clip here
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        assert norms[-1] > clip or not clip_in_adam  # the clip acts
        opt.step()
    for rank in range(2):
        for got, want in zip(r[rank]["params"], model.parameters(), strict=True):
            assert_close(got, want.detach(), atol=1e-6, what=f"rank {rank} params")
        assert r[rank]["norms"] == pytest.approx(norms, rel=1e-5)


def test_the_device_grad_norm_is_megatrons(tmp_path, seed):
    """megatron_gpu.grad_norm (kept on the device) equals Megatron's get_grad_norm to 1 ulp for
    one optimizer and both of ChainedOptimizer's branches: one shared statistics group, or
    groups apart (each member's norm over its own group; EP's expert optimizer shares the
    dense one's group in Megatron 0.16.1, so no layout run reaches that branch)."""
    r = _spawn(_norm_worker, tmp_path, seed)
    for rank in range(2):
        for case, (mine, theirs) in r[rank].items():
            assert math.isfinite(theirs) and theirs > 0, (rank, case, theirs)
            assert mine == pytest.approx(theirs, rel=3e-16, abs=0), (rank, case)
    # the groups matter: ranks agree where every member reduces over the world, and not where
    # a member's gradients are each rank's own
    assert r[0]["shared"][1] == r[1]["shared"][1] and r[0]["apart"][1] != r[1]["apart"][1]


def test_clip_in_adam_meets_an_infinite_norm_as_megatron_does(tmp_path, seed):
    """A step whose gradient norm overflows to inf: with the clip inside fused AdamW the
    step scales the gradients as Megatron's own clip does (Megatron multiplies by clip / inf =
    0; fused AdamW divides by its grad_scale, inf) and the run goes on as Megatron's (foreach
    AdamW)."""
    mine = _spawn(_dp_worker, tmp_path, seed, True, CLIP_IN_ADAM, True)
    theirs = _spawn(_dp_worker, tmp_path, seed, False, CLIP_IN_ADAM, True)
    for rank in range(2):
        assert mine[rank]["norms"][1] == theirs[rank]["norms"][1] == float("inf")
        assert mine[rank]["norms"] == pytest.approx(theirs[rank]["norms"], rel=1e-5)
        for got, want in zip(mine[rank]["params"], theirs[rank]["params"], strict=True):
            assert_close(got, want, atol=1e-6, what=f"rank {rank} params")


def test_the_adamw_kernel_writes_the_bf16_weights_megatron_would_copy(tmp_path, seed):
    """bf16 weights, DP=2 (each rank's main shards, two parameter groups): the AdamW kernel
    that megatron_gpu.step runs in place of AdamW and Megatron's copy leaves the weights that
    Megatron's own copy and all-gather write (they change no element after any step), and the
    run equals Megatron's own step (foreach AdamW, its clip, its copy)."""
    mine = _spawn(_bf16_worker, tmp_path, seed, True)
    theirs = _spawn(_bf16_worker, tmp_path, seed, False)
    for rank in range(2):
        assert mine[rank]["stale"] == [0, 0, 0]
        assert all(n > CLIP_IN_ADAM for n in theirs[rank]["norms"])  # every step clips
        assert mine[rank]["norms"] == pytest.approx(theirs[rank]["norms"], rel=1e-5)
        assert mine[rank]["mains"], "no fp32 main shard on this rank"
        for got, want in zip(mine[rank]["mains"], theirs[rank]["mains"], strict=True):
            assert_close(got, want, atol=1e-6, what=f"rank {rank} main weights")
        moved = 0
        for got, want, start in zip(mine[rank]["params"], theirs[rank]["params"], mine[rank]["start"], strict=True):
            assert got.dtype == torch.bfloat16
            # one bf16 step apart at most, where the fp32 weights round to either side
            assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7, what=f"rank {rank} bf16 weights")
            moved += int((got != start).sum())
        assert moved > 0


def test_bf16_moments_round_what_fp32_moments_keep_on_both_step_paths(tmp_path, seed):
    """train.optim.moments: bfloat16 under Megatron's DistributedOptimizer (DP=2, bf16
    weights): the first step's weights are fp32 moments' bit for bit (a step reads its moments
    before they are rounded) and its kept moments are theirs rounded to bf16; later steps
    start from the rounded moments, so the runs part; Megatron's own step (its clip and copy,
    torch's AdamW swapped for adamw.update's torch path, which widens the bf16 moments around
    torch's fused AdamW) equals the kernel's."""
    r = _spawn(_moments_worker, tmp_path, seed)
    for rank in range(2):
        got = r[rank]
        assert got["fp321"], f"rank {rank}: no main shard"
        for a, b in zip(got["bf161"], got["fp321"], strict=True):
            assert_finite(a, b, what=f"rank {rank} step 1")
            assert torch.equal(a, b), f"rank {rank}: step 1 weights differ with bf16 moments"
        for n in ("_m", "_v"):
            for a, b in zip(got["bf161" + n], got["fp321" + n], strict=True):
                assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
                assert torch.equal(a, b.to(torch.bfloat16)), f"rank {rank}: kept moments{n} are not fp32's rounded"
        assert any(not torch.equal(a, b) for a, b in zip(got["bf163"], got["fp323"], strict=True)), \
            f"rank {rank}: step 3 the same with bf16 and fp32 moments (were they rounded?)"
        for a, b in zip(got["bf16_megatron3"], got["bf163"], strict=True):
            assert_close(a, b, atol=1e-6, what=f"rank {rank}: Megatron's step with bf16 moments")
        assert all(t.dtype == torch.bfloat16 for t in got["bf16_megatron3_m"] + got["bf16_megatron3_v"])


def test_pipeline_1f1b_matches_single_process(tmp_path, seed):
    """PP=2 with the 1F1B schedule over gloo, 4 micro-batches: per-micro-batch losses and each
    stage's gradients equal the unsplit two-layer model (backward scaled by 1/micro-batches)."""
    r = _spawn(_pp_worker, tmp_path, seed)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 8) for _ in range(2)]
    data = torch.randn(4, 2, 3, 8, generator=torch.Generator().manual_seed(seed + 1))
    losses = []
    for mb in data:
        loss = torch.tanh(layers[1](torch.tanh(layers[0](mb)))).pow(2).mean()
        (loss / 4).backward()
        losses.append(loss.detach())
    # the schedule scales the backward by 1/micro-batches; the reported losses are unscaled
    assert_close(torch.stack(r[1]["losses"]), torch.stack(losses), atol=1e-6, what="losses")
    for rank in range(2):
        assert_close(r[rank]["w"], layers[rank].weight.grad, atol=1e-6, what=f"stage {rank} weight grad")
        assert_close(r[rank]["b"], layers[rank].bias.grad, atol=1e-6, what=f"stage {rank} bias grad")
