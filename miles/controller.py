"""The driver of SFT and plain jobs (`miles run`, `miles sft`, the first stage of `make demo`, the
tests, a submitted Ray job); only the job file differs. RL jobs have their own loop,
miles/rl/loop.py; both run inside miles.session (run directory, Ray, trainer, checkpoints,
monitor, teardown).

    run(job):
        run directory <- the resolved job; Ray <- job.cluster
        data    <- the job's source (synthetic, or chat conversations tokenized with loss masks)
        trainer <- Megatron workers with the model, optimizer and loss (job.model/train/algo)
        start   <- the checkpoint ckpt.load names (weights, optimizer, RNG, data position), or 0
        for step in start+1..steps:
            samples  <- the data source's global batch for this step
            replicas <- per data-parallel replica, micro-batches (chat: packed, balanced by tokens)
            metrics  <- one optimizer step on the trainer
            eval     <- the held-out loss, every data.eval_interval steps (chat)
            log(step, metrics)                      # metrics.jsonl, wandb, terminal
            checkpoint <- on ckpt.save_interval, the warm-up step and the last (miles.ckpt)
        final weights -> DeepSeek's HF layout (ckpt.save_hf), evaluation (data.eval_size)

SFT is this loop with the chat source; it never starts rollout engines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from miles.cluster.train_group import TrainGroup
from miles.config import JobConfig
from miles.data.sample import Sample
from miles.observe import alignment
from miles.observe.metrics import Monitor
from miles.session import RunResult, profiling, session, start_trainer
from miles.train.batching import MicroBatch, packed_replica_micro_batches, replica_micro_batches


def run(job: JobConfig, stream: TextIO | None = None) -> RunResult:
    """Run a validated job to its end. Uses the Ray cluster this process is connected to, or
    connects to / starts the one job.cluster names."""
    with session(job, stream) as s:
        job, monitor, ckpt = s.job, s.monitor, s.ckpt
        data = s.closing(make_source(job, s.run_dir, monitor))
        trainer = s.closing(start_trainer(job), "shutdown")
        monitor.print(f"miles: {job.name}: {job.train.steps} steps of {job.train.global_batch_size} sequences, "
                      f"{describe_layout(job, trainer)} on {job.cluster.device.upper()}; run directory {s.run_dir}")
        start = ckpt.restore(trainer, data)
        if start == 0 and evaluates(job, data, 0):
            monitor.record(0, first := evaluate(job, trainer, data.eval_samples()))
            monitor.print(f"before step 1: eval loss {first['eval/loss']:.4f}")
        history = []
        for step in range(start + 1, job.train.steps + 1):
            t0 = time.perf_counter()
            samples = data.batch(step, job.train.global_batch_size)
            replicas = layout_batch(job, samples)
            t1 = time.perf_counter()
            with profiling(job, trainer, s.run_dir, step):
                ranks = trainer.train_step(replicas, checksums=job.log.alignment)
            t2 = time.perf_counter()
            if job.log.alignment:
                alignment.append(s.run_dir, alignment.ranks_record(step, ranks[0], ranks[0]["grad_norm"],
                                                                   [r["grad_md5"] for r in ranks]))
            tokens = sum(len(x.tokens) - 1 for x in samples)
            metrics = step_metrics(ranks[0], data_time=t1 - t0, train_time=t2 - t1, tokens=tokens) | data.metrics()
            if evaluates(job, data, step):
                metrics.update(evaluate(job, trainer, data.eval_samples()))
            monitor.log(step, metrics)
            history.append(metrics)
            ckpt.maybe_save(step, trainer, data)
        summary = s.finish(trainer, data, history, ("train/", "eval/", "data/"))
        monitor.summary(summary)
    return RunResult(s.run_dir, history, summary)


# --------------------------------------------------------------------------- steps of the loop


def make_source(job: JobConfig, run_dir: Path, monitor: Monitor):
    """The job's data source: batch(step, n) -> samples, metrics(), eval_samples(), close().
    The chat source tokenizes its held-out split here, so bad data fails before the workers
    start."""
    if job.data.source == "chat":
        from miles.data.dataset import DataError
        from miles.data.sft import SFTSource

        source = SFTSource(job.data, job.train.seed, run_dir, report=monitor.print)
        if 0 < len(source.eval_samples()) < job.train.parallel.dp:
            raise DataError(f"the held-out split has {len(source.eval_samples())} samples, fewer than the "
                            f"{job.train.parallel.dp} data-parallel replicas (data.eval_size / data.eval_path)")
        return source
    from miles.data.synthetic import SyntheticSource

    return SyntheticSource(job.data.seq_len, job.model.arch.vocab_size, job.train.seed)


def layout_batch(job: JobConfig, samples: list[Sample]) -> list[list[MicroBatch]]:
    """A global batch as micro-batches per data-parallel replica: synthetic sequences one per
    row; conversations packed into rows of data.seq_len positions, balanced by tokens."""
    p, mbs = job.train.parallel, job.train.micro_batch_size
    if job.data.source == "synthetic":
        return replica_micro_batches(samples, p.dp, mbs, pad_to_multiple=p.seq_multiple)
    return packed_replica_micro_batches(samples, p.dp, mbs, job.data.seq_len, pad_to_multiple=p.seq_multiple,
                                        same_count=p.ep > 1)


def evaluates(job: JobConfig, data, step: int) -> bool:
    """The held-out loss is measured before the first step, every data.eval_interval steps
    and after the last (sources with a held-out split)."""
    if not data.eval_samples():
        return False
    every = job.data.eval_interval
    return step in (0, job.train.steps) or (every > 0 and step % every == 0)


def evaluate(job: JobConfig, trainer, samples: list[Sample]) -> dict[str, float]:
    """eval/loss: the mean negative log-likelihood of the held-out samples' trained tokens
    (the LM term alone), forward only."""
    replicas = layout_batch(job, samples)
    nll = weight = 0.0
    for mbs, logprobs in zip(replicas, trainer.forward_logprobs(replicas), strict=True):
        for mb, lp in zip(mbs, logprobs, strict=True):
            nll -= float((lp.double() * mb.loss_mask).sum())
            weight += float(mb.loss_mask.sum())
    return {"eval/loss": nll / max(weight, 1.0), "eval/tokens": weight}


def step_metrics(rank0: dict, data_time: float, train_time: float, tokens: int) -> dict[str, float]:
    """A worker's step result under the metric names of docs/algorithms.md. perf/train_time is the
    Ray call, perf/worker_time the step inside the worker (the difference: the object store and
    the actor call)."""
    out = {f"train/{k}": float(v) for k, v in rank0.items() if k not in ("grad_md5", "step_time")}
    out.update({"perf/step_time": data_time + train_time, "perf/train_time": train_time,
                "perf/worker_time": rank0["step_time"], "perf/data_time": data_time,
                "perf/train_tok_per_s": tokens / train_time, "perf/tokens": float(tokens)})
    return out


def describe_layout(job: JobConfig, trainer: TrainGroup) -> str:
    """"2 workers (tp=1 ... dp=2)", and the nodes they run on when there are several."""
    p = job.train.parallel
    text = f"{p.world} worker{'s' if p.world > 1 else ''} (tp={p.tp} pp={p.pp} ep={p.ep} cp={p.cp} dp={p.dp})"
    nodes = sorted({x["node"] for x in trainer.layout})
    return text + (f" on {len(nodes)} nodes ({', '.join(nodes)})" if len(nodes) > 1 else "")
