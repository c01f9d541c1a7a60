"""V4-Flash's widths across GPUs (issue 58): train_gpu.py's flash_slice config on one GPU, with
expert parallelism over four (EP=4: the all-to-all) and with TP=2 x EP=2. Each GPU holds the 8
routed experts an EP=32 layout gives it (the model's routed experts = 8 x EP), so a GPU's expert
work per token stays EP=32's; tokens/s per GPU against the first layout, peak memory per GPU.

    python3 benchmarks/layouts_gpu.py [--layouts 1 ep4 tp2ep2] [--seq 4096] [--batch 2] [--steps 4]
    python3 benchmarks/layouts_gpu.py --layouts 1 dp2-sync dp2 ep2-sync ep2 --graphs  # reduction after/in backward
    .venv/bin/python benchmarks/layouts_gpu.py --device cpu --config small_50m --seq 128 --layouts 1 ep2  # the path
    python3 benchmarks/layouts_gpu.py --layouts tp2ep2 --groups  # and each rank's first use of each process group

Each layout runs in processes of its own (a GPU each, nccl; gloo on CPU). Every data-parallel
rank trains --batch sequences of its own a step (the ranks of a TP group share theirs), so a
GPU's tokens a step are batch x seq / TP. Rank 0 times the steps (median, after two warm-up
steps: autotuning, the allocator); the memory column is the largest of the ranks' peaks.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPERTS_PER_GPU = 8  # V4-Flash's 256 routed experts over EP=32


def parse_layout(name: str) -> tuple[int, int, int, bool]:
    """'1' -> (tp 1, ep 1, dp 1, overlap); 'ep4' -> (1, 4, 1, True); 'tp2ep2' -> (2, 2, 1, True);
    'dp2' -> (1, 1, 2, True): two GPUs data parallel. A '-sync' suffix ('ep2-sync'): the
    data-parallel gradient reduction after the backward instead of overlapped with it
    (train.optim.overlap_grad_reduce false). GPUs = tp x ep x dp (the expert-parallel ranks
    are data-parallel ones for the dense weights)."""
    m = re.fullmatch(r"(?:tp(\d+))?(?:ep(\d+))?(?:dp(\d+))?(-sync)?", name)
    if name in ("1", "1-sync"):
        return 1, 1, 1, name == "1"
    if not m or not any(m.groups()[:3]):
        raise SystemExit(f"--layouts: {name!r} is not 1, epN, tpN, dpN or tpNepM (each with an optional -sync)")
    return int(m.group(1) or 1), int(m.group(2) or 1), int(m.group(3) or 1), m.group(4) is None


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "all_to_all", "broadcast", "barrier", "all_gather_object", "send", "recv", "isend", "irecv")


def note_first_uses(note) -> None:
    """note() each process group's first collective on this rank (its ranks, the call, where).
    NCCL makes a group's communicator at its first collective and the host waits there until
    every member arrives: ranks that first use two shared groups in opposite orders wait on
    each other outside NCCL's watchdog; the last line a stalled rank printed names its group."""
    import torch.distributed as dist

    seen = set()

    def noting(name: str, fn):
        def first_use(*args, **kw):
            group = kw.get("group") or next((x for x in args if isinstance(x, dist.ProcessGroup)), None)
            group = group or dist.group.WORLD
            if id(group) not in seen:  # a group object, not its ranks: each has its own communicator
                seen.add(id(group))
                frame = traceback.extract_stack()[-2]
                note(f"first use of group {getattr(group, 'group_name', '?')} {dist.get_process_group_ranks(group)}: "
                     f"{name} at {Path(frame.filename).name}:{frame.lineno}")
            return fn(*args, **kw)
        return first_use

    for name in COLLECTIVES:
        setattr(dist, name, noting(name, getattr(dist, name)))


def _run(rank: int, world: int, a: argparse.Namespace, layout: str, out: dict) -> None:
    cuda = a.device == "gpu"
    t0 = time.perf_counter()

    def note(what: str) -> None:  # where each rank is: a layout that stalls shows its phase
        print(f"  [{layout} rank {rank}] {time.perf_counter() - t0:6.1f} s  {what}", file=sys.stderr, flush=True)

    # A rank still running after --stall-after seconds prints every thread's stack and exits
    # (a wait outside NCCL's watchdog, e.g. on the host or in a compiler, shows where it is).
    faulthandler.dump_traceback_later(a.stall_after, exit=True)
    if cuda:  # before anything touches CUDA: TrainWorker takes device 0, as under Ray
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    else:
        torch.set_num_threads(1)
    if a.groups:  # before the modules that call the collectives are imported
        note_first_uses(note)
    from benchmarks.train_gpu import CONFIGS, spawned_rendezvous
    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker

    tp, ep, _, overlap = parse_layout(layout)
    cfg = CONFIGS[a.config](a.seq)
    w = TrainWorker(rank, world)
    me = w.init_distributed(*spawned_rendezvous(w, rank, out, ("rendezvous", layout)), tp=tp, ep=ep)
    note(f"process groups up: {me}")
    arch = {**cfg.to_dict(), "n_routed_experts": EXPERTS_PER_GPU * ep, "kernels": "triton" if cuda else "torch",
            "cuda_graphs": cuda and tp == 1 and ep == 1 and a.graphs}
    w.build_model(arch, seed=0, dtype="bfloat16" if cuda else "float32")
    w.setup_training(lr=1e-4, warmup_steps=0, total_steps=1000, overlap_grad_reduce=overlap)
    note("model built")
    g = torch.Generator().manual_seed(1000 + me["dp_rank"])  # a data-parallel rank's own sequences
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g)
    mbs = [MicroBatch.lm(ids[i:i + 1, :-1], ids[i:i + 1, 1:].contiguous()) for i in range(a.batch)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(a.steps + 2):
        sync()
        t = time.perf_counter()
        w.train_step(mbs)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t)
        note(f"step {i}: {(time.perf_counter() - t) * 1e3:.1f} ms")
    faulthandler.cancel_dump_traceback_later()
    if w.ddp.early is not None:  # bucket groups whose reduction began during the last step's backward
        note(f"gradient bucket groups reduced in the backward: {w.ddp.early[0]} of {w.ddp.early[1]}")
    if a.profile:  # one more step under the profiler on every rank (its collectives), rank 0's shown
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            w.train_step(mbs)
            sync()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        if rank == 0:
            ops = prof.key_averages()
            print(f"[{layout}] one step on rank 0, by {key}:\n" + ops.table(sort_by=key, row_limit=18), flush=True)
            if cuda:  # where the host waits (synchronizations, blocking copies) shows in its own time
                print(f"[{layout}] rank 0, the host's calls by their own time:\n"
                      + ops.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        if cuda:  # and one more step with torch's sync debug mode: each wait's line of code
            sites = _sync_sites(lambda: (w.train_step(mbs), sync()))
            if rank == 0:
                print(f"[{layout}] rank 0's waits for the GPU in one step ({sum(sites.values())}), by line:\n"
                      + "\n".join(f"  {n:4d}  {site}" for site, n in sites.most_common(12)), flush=True)
    out[(layout, rank)] = (statistics.median(times), torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    torch.distributed.destroy_process_group()


def _sync_sites(step) -> collections.Counter:
    """How often each line of ours or Megatron's made the host wait for the GPU (an item(),
    a copy to the host, an op whose output size lives on the GPU) during step()."""
    sites: collections.Counter = collections.Counter()

    def count(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # another warning, not a wait
            return
        ours = [f for f in traceback.extract_stack()[:-1] if re.search(r"/(miles|plugins|megatron)/", f.filename)]
        where = ours[-1] if ours else None
        sites[f"{where.filename.split('/')[-2]}/{where.filename.split('/')[-1]}:{where.lineno} {where.line}"
              if where else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["1", "ep4", "tp2ep2"])
    ap.add_argument("--config", default="flash_slice")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="sequences a data-parallel rank trains a step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on the layouts without TP or EP (1, dpN)")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--profile", action="store_true", help="rank 0's top kernels over one more step, a layout each")
    ap.add_argument("--stall-after", type=float, default=400,
                    help="seconds after which a rank prints its threads' stacks and exits")
    ap.add_argument("--groups", action="store_true", help="each rank notes its first collective on each group")
    a = ap.parse_args()
    have = torch.cuda.device_count() if a.device == "gpu" else 8  # gloo ranks share the cores: slow, but they run
    out = mp.Manager().dict()
    where = torch.cuda.get_device_name() if a.device == "gpu" else "CPU"
    print(f"{where}  {a.config} ({EXPERTS_PER_GPU} routed experts a GPU), seq={a.seq}, {a.batch} sequences a "
          f"data-parallel rank, medians of {a.steps} steps")
    print(f"{'layout':>11s} {'GPUs':>5s} {'step ms':>9s} {'tok/s/GPU':>10s} {'vs first':>9s} {'peak GiB':>9s}",
          flush=True)
    first = None
    for layout in a.layouts:  # a row as each layout finishes (a long run may be cut off)
        tp, ep, dp, _ = parse_layout(layout)
        world = tp * ep * dp
        if world > have:
            print(f"{layout:>11s} {world:5d}  needs {world} devices, {have} here: skipped", flush=True)
            continue
        try:
            mp.spawn(_run, args=(world, a, layout, out), nprocs=world)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # a stalled rank's stacks are above
            print(f"{layout:>11s} {world:5d}  failed: {e}", flush=True)
            continue
        step = out[(layout, 0)][0]
        mem = max(out[(layout, r)][1] for r in range(world))
        per_gpu = a.batch * a.seq / tp / step
        first = first or per_gpu
        print(f"{layout:>11s} {world:5d} {step * 1e3:9.1f} {per_gpu:10,.0f} {per_gpu / first:9.1%} {mem:9.1f}",
              flush=True)


if __name__ == "__main__":
    main()
