"""Checkpoint save and load through the workers (Megatron dist_checkpointing): seconds and GB/s,
sync vs async, and the training-step stall an async save causes.

    .venv/bin/python benchmarks/checkpoint.py [--config small_50m|1b] [--repeats 3] [--tp 1]

One TrainGroup (CPU workers here; GPU workers when the cluster has GPUs) with the model, its
AdamW state after one step, then per repeat:
- sync save: save_checkpoint until every file is written (the commit's fsync excluded);
- load: load_checkpoint of that directory into the same workers;
- async save: the save_checkpoint call (what the training loop waits for: host staging and
  the writer thread starting), then a training step while it writes, then finish_save.
The stall is the async call's time over the sync save's; the issue's bar is 10%.
Medians over the repeats; GB/s over the bytes on disk.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_gpu import CONFIGS  # noqa: E402
from miles.cluster.train_group import TrainGroup  # noqa: E402
from miles.data.synthetic import SyntheticSource  # noqa: E402
from miles.train.batching import replica_micro_batches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small_50m", choices=sorted(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    cfg = CONFIGS[args.config](args.seq)
    gpu = torch.cuda.is_available()
    ray.init(num_cpus=max(2, args.tp), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    group = TrainGroup(args.tp, resources={"CPU": 1} | ({"GPU": 1} if gpu else {}), tp=args.tp)
    group.call("build_model", cfg.to_dict(), 0)
    group.call("setup_training", lr=1e-4, total_steps=100)
    src = SyntheticSource(args.seq, cfg.vocab_size, 0)
    step = iter(range(1, 10_000))

    def train() -> float:
        t = time.perf_counter()
        group.train_step(replica_micro_batches(src.batch(next(step), 2), 1, 1))
        return time.perf_counter() - t

    train()
    root = Path(tempfile.mkdtemp(prefix="miles-ckpt-bench-"))
    rows: dict[str, list[float]] = {"sync save s": [], "load s": [], "async call s": [], "async total s": [],
                                    "train step s": [], "step during async s": []}
    size = 0
    try:
        for r in range(args.repeats):
            d = root / f"sync{r}"
            d.mkdir()
            t = time.perf_counter()
            group.call("save_checkpoint", str(d))
            rows["sync save s"].append(time.perf_counter() - t)
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            t = time.perf_counter()
            group.call("load_checkpoint", str(d), same_layout=True)
            rows["load s"].append(time.perf_counter() - t)
            rows["train step s"].append(train())
            d = root / f"async{r}"
            d.mkdir()
            t = time.perf_counter()
            group.call("save_checkpoint", str(d), True)
            rows["async call s"].append(time.perf_counter() - t)
            rows["step during async s"].append(train())
            while not all(group.call("finish_save", False)):
                time.sleep(0.01)
            rows["async total s"].append(time.perf_counter() - t)
            shutil.rmtree(root / f"sync{r}")
            shutil.rmtree(d)
    finally:
        group.shutdown()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = size / 1e9
    print(f"\n{args.config} (TP={args.tp}, {'GPU' if gpu else 'CPU'}), checkpoint "
          f"{gb:.3f} GB (model + AdamW), median of {args.repeats}")
    print(f"{'':24s}{'seconds':>10s}{'GB/s':>8s}")
    for k in ("sync save s", "load s", "async call s", "async total s", "train step s", "step during async s"):
        rate = f"{gb / med[k]:8.2f}" if k in ("sync save s", "load s", "async total s") else " " * 8
        print(f"{k:24s}{med[k]:10.3f}{rate}")
    print(f"async stall / sync save: {med['async call s'] / med['sync save s']:.1%} (goal: under 10%)")


if __name__ == "__main__":
    main()
