"""The driver loop. Today: training the plugin's model in Megatron workers on synthetic data
(the parity and determinism harness of the trainer); SFT and RL loops build on it.

    group = TrainGroup(world, tp=..., pp=..., ep=..., cp=...)
    build_model -> setup_training -> for each step: batch -> per-replica micro-batches ->
    train_step on every rank -> alignment record -> log line
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.data.synthetic import progressions
from miles.observe import alignment
from plugins.deepseek_v4 import DeepSeekV4Config
from plugins.deepseek_v4.model import IGNORE_INDEX


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def validate(self) -> None:
        for k in ("tp", "pp", "ep", "cp", "dp"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout.{k} must be >= 1, got {getattr(self, k)}")
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ValueError(f"layout.ep={self.ep} must divide dp*cp*tp={self.dp * self.cp * self.tp}")


@dataclass
class SyntheticTrainJob:
    run_dir: Path
    steps: int = 20
    seed: int = 0
    batch: int = 8  # sequences per global batch
    seq: int = 32
    micro_batches: int = 2  # per data-parallel replica
    lr: float = 3e-3
    warmup_steps: int = 5
    deterministic: bool = True
    layout: Layout = field(default_factory=Layout)
    model: DeepSeekV4Config = field(default_factory=DeepSeekV4Config.tiny)

    def validate(self) -> None:
        self.layout.validate()
        if self.steps < 1 or self.batch < 1 or self.micro_batches < 1:
            raise ValueError("steps, batch and micro_batches must be >= 1")
        if self.batch % (self.layout.dp * self.micro_batches):
            raise ValueError(f"batch={self.batch} must split into dp={self.layout.dp} x "
                             f"micro_batches={self.micro_batches}")
        if self.seq % self.layout.cp:
            raise ValueError(f"seq={self.seq} must be a multiple of layout.cp={self.layout.cp}")


def _replica_micro_batches(job: SyntheticTrainJob, step: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The global batch of `step`, split per data-parallel replica into micro-batches."""
    ids = progressions(job.batch, job.seq + 1, job.model.vocab_size, seed=job.seed * 100_003 + step)
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[:, :2] = IGNORE_INDEX  # a progression's step is unknowable before two tokens
    per = job.batch // job.layout.dp
    mb = per // job.micro_batches
    return [[(inputs[r * per + i: r * per + i + mb], labels[r * per + i: r * per + i + mb])
             for i in range(0, per, mb)] for r in range(job.layout.dp)]


def train_synthetic(job: SyntheticTrainJob) -> list[dict]:
    """Train, appending one alignment record per step to <run_dir>/alignment.jsonl. Needs a
    running Ray cluster. Returns the per-step logs of rank 0."""
    from miles.cluster.train_group import TrainGroup

    job.validate()
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / alignment.FILE).unlink(missing_ok=True)
    lay = job.layout
    group = TrainGroup(lay.world, tp=lay.tp, pp=lay.pp, ep=lay.ep, cp=lay.cp)
    logs = []
    try:
        n = group.call("build_model", job.model.to_dict(), job.seed, deterministic=job.deterministic)[0]
        group.call("setup_training", job.lr, warmup_steps=job.warmup_steps, total_steps=job.steps,
                   min_lr=job.lr / 10, weight_decay=0.01)
        print(f"miles: training {n / 1e6:.2f}M params/rank on {lay.world} workers "
              f"(tp={lay.tp} pp={lay.pp} ep={lay.ep} cp={lay.cp} dp={lay.dp}), {job.steps} steps", flush=True)
        t0 = time.perf_counter()
        for step in range(1, job.steps + 1):
            replicas = _replica_micro_batches(job, step)
            ranks = group.call_each("train_step", [(replicas[x["dp_rank"]], True) for x in group.layout])
            log = ranks[0]
            alignment.append(run_dir, alignment.ranks_record(step, log["total"], log["grad_norm"],
                                                             [r["grad_md5"] for r in ranks]))
            logs.append(log)
            if step == 1 or step % 10 == 0 or step == job.steps:
                rate = step * job.batch * job.seq / (time.perf_counter() - t0)
                print(f"step {step:4d}  loss {log['total']:.4f}  lm {log['lm']:.4f}  mtp {log['mtp']:.4f}  "
                      f"indexer {log['indexer']:.4f}  grad_norm {log['grad_norm']:.3f}  lr {log['lr']:.2e}  "
                      f"{rate:,.0f} tok/s", flush=True)
    finally:
        group.shutdown()
    return logs
