"""Long-context training throughput against context parallelism: the ~1B config of
train_gpu.py at 32k-64k tokens per sequence, one sequence per step, CP = 1 and CP = N
(N processes, one GPU each, nccl), block recompute on (a 32k sequence's activations do
not fit an 80 GiB GPU without it).

    python3 benchmarks/context_gpu.py [--seq 32768] [--cp 1 2] [--steps 4]

Each CP size runs in its own processes; rank 0 prints the median step, tokens/s and its
peak memory. CP ranks each take two of 2 x CP equal pieces of the sequence
(parallel.cp_chunk) and project K = V and the compressor inputs for their own tokens only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run(rank: int, world: int, seq: int, steps: int, out: dict) -> None:
    # Before any import that may touch CUDA: TrainWorker takes device 0, as under Ray.
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    from benchmarks.train_gpu import config_1b, spawned_rendezvous
    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker

    cfg = config_1b(seq)
    w = TrainWorker(rank, world)
    w.init_distributed(*spawned_rendezvous(w, rank, out, ("rendezvous", world)), cp=world)
    w.build_model({**cfg.to_dict(), "kernels": "triton", "recompute": True}, seed=0, dtype="bfloat16")
    w.setup_training(lr=1e-4, warmup_steps=0, total_steps=1000)
    ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    mbs = [MicroBatch.lm(ids[:, :-1], ids[:, 1:].contiguous())]
    times = []
    for i in range(steps + 1):  # the first step autotunes
        torch.cuda.synchronize()
        t = time.perf_counter()
        w.train_step(mbs)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    if rank == 0:
        out[world] = (statistics.median(times), torch.cuda.max_memory_allocated() / 2**30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    gpus = torch.cuda.device_count()
    out = mp.Manager().dict()
    print(f"{torch.cuda.get_device_name()}  ~1B config, seq={a.seq}, 1 sequence per step, recompute on")
    print(f"{'CP':>3s} {'step ms':>9s} {'tokens/s':>10s} {'vs CP=1':>8s} {'peak GiB/rank':>14s}", flush=True)
    for cp in a.cp:  # a row as each CP size finishes (a long run may be cut off)
        if cp > gpus:
            print(f"cp={cp}: needs {cp} GPUs, {gpus} here: skipped")
            continue
        mp.spawn(_run, args=(cp, a.seq, a.steps, out), nprocs=cp)
        t, mem = out[cp]
        base = out.get(1, (None,))[0]
        ratio = f"{base / t:.2f}x" if base else "-"
        print(f"{cp:3d} {t * 1e3:9.1f} {a.seq / t:10,.0f} {ratio:>8s} {mem:14.1f}", flush=True)


if __name__ == "__main__":
    main()
