"""The driver of SFT and plain jobs (`miles run`, `miles sft`, the first stage of `make demo`, the
tests, a submitted Ray job); only the job file differs. RL jobs have their own loop, miles/rl.py,
built from the same pieces (run directory, Ray session, trainer, checkpoints, monitor).

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

import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from miles.ckpt.manager import Checkpoints
from miles.config import JobConfig, save_resolved
from miles.data.sample import Sample
from miles.observe import alignment, records
from miles.observe.metrics import FILE as METRICS_FILE
from miles.observe.metrics import Monitor
from miles.train.batching import MicroBatch, packed_replica_micro_batches, replica_micro_batches

if TYPE_CHECKING:
    from miles.cluster.train_group import TrainGroup


class JobError(RuntimeError):
    """The job cannot run as configured here (run directory taken, not enough GPUs, ...)."""


@dataclass
class RunResult:
    run_dir: Path
    history: list[dict]  # per step: the logged metrics
    summary: dict[str, float]  # the finished run: final losses and evaluations


def run(job: JobConfig, stream: TextIO | None = None) -> RunResult:
    """Run a validated job to its end. Uses the Ray cluster this process is connected to, or
    connects to / starts the one job.cluster names."""
    out = stream or sys.stdout
    ckpt = Checkpoints(job, report=lambda text: print(text, file=out, flush=True))
    run_dir = prepare_run_dir(job, resume_from=ckpt.iteration if job.ckpt.load else None, stream=out)
    with ray_session(job), contextlib.ExitStack() as stack:
        device = resolve_device(job)
        monitor = Monitor(job.log, run_dir, job.train.steps, job.resolved(), stream)
        stack.push(lambda exc_type, *_: monitor.close(failed=exc_type is not None))
        ckpt.report = monitor.print
        data = make_source(job, run_dir, monitor)
        stack.callback(data.close)
        trainer = start_trainer(job, device)
        stack.callback(trainer.shutdown)
        monitor.print(f"miles: {job.name}: {job.train.steps} steps of {job.train.global_batch_size} sequences, "
                      f"{describe_layout(job, trainer)} on {device.upper()}; run directory {run_dir}")
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
            with profiling(job, trainer, run_dir, step):
                ranks = trainer.train_step(replicas, checksums=job.log.alignment)
            t2 = time.perf_counter()
            if job.log.alignment:
                alignment.append(run_dir, alignment.ranks_record(step, ranks[0], ranks[0]["grad_norm"],
                                                                 [r["grad_md5"] for r in ranks]))
            tokens = sum(len(s.tokens) - 1 for s in samples)
            metrics = step_metrics(ranks[0], data_time=t1 - t0, train_time=t2 - t1, tokens=tokens) | data.metrics()
            if evaluates(job, data, step):
                metrics.update(evaluate(job, trainer, data.eval_samples()))
            monitor.log(step, metrics)
            history.append(metrics)
            ckpt.maybe_save(step, trainer, data)
        ckpt.close(trainer)
        summary = {k: v for k, v in history[-1].items() if k.startswith(("train/", "eval/", "data/"))}
        summary.update(finish(job, trainer, data, run_dir, monitor))
        monitor.summary(summary)
    return RunResult(run_dir, history, summary)


# --------------------------------------------------------------------------- steps of the loop
def prepare_run_dir(job: JobConfig, resume_from: int | None = None, stream: TextIO | None = None) -> Path:
    """Create the run directory and write the resolved job into it. A directory that already
    holds a run's metrics is refused (its records would mix with this run's), unless the run
    resumes from a checkpoint (`resume_from`: its iteration, 0 for ckpt.load: auto with none
    saved yet): then the records after that iteration are dropped, since it redoes them."""
    run_dir = Path(job.log.run_dir)
    if (run_dir / METRICS_FILE).exists():
        if resume_from is None:
            raise JobError(f"{run_dir} already holds a run ({METRICS_FILE}); choose another log.run_dir, remove "
                           f"it, or resume it (ckpt.load: auto)")
        last = resume_from if resume_from > 0 else -1  # a fresh start redoes the evaluation before step 1 too
        dropped = sum(records.truncate(run_dir / f, last) for f in (METRICS_FILE, alignment.FILE, records.ROLLOUTS))
        if dropped:
            print(f"{run_dir}: dropped {dropped} records after step {resume_from} (this run redoes those steps)",
                  file=stream or sys.stdout, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(job, run_dir / "config.yaml")
    return run_dir


@contextlib.contextmanager
def ray_session(job: JobConfig):
    """The Ray cluster of the job: the one this process already joined, job.cluster.address or
    $RAY_ADDRESS, or a local one started here on 127.0.0.1 and stopped afterwards."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = job.cluster.address or os.environ.get("RAY_ADDRESS")
    # Ray's start-up lines (one advises turning token auth off) are not the user's business
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(num_cpus=job.cluster.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    previous = unwind_on_sigterm()  # after ray.init, which installs its own SIGTERM handler
    try:
        yield
    finally:
        ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def unwind_on_sigterm():
    """`ray job stop` and `kill` send SIGTERM, which would end the driver without unwinding:
    raise KeyboardInterrupt instead, so the run closes like Ctrl-C (actors killed, engines and
    router stopped, metrics, summary and wandb closed) within the cluster's stop window.
    Returns the handler it replaced (None off the main thread, where none is installed)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame) -> None:
        raise KeyboardInterrupt("stopped by SIGTERM")

    return signal.signal(signal.SIGTERM, handler)


def resolve_device(job: JobConfig) -> str:
    """cpu or gpu workers: `auto` takes GPUs when the cluster has one per rank. A cluster too
    small for the workers is an error here, not a placement group waiting forever."""
    import ray

    world, have = job.train.parallel.world, ray.cluster_resources()
    gpus, cpus = int(have.get("GPU", 0)), have.get("CPU", 0)
    if job.cluster.device == "gpu" and gpus < world:
        raise JobError(f"cluster.device is gpu and train.parallel needs {world} GPUs; the cluster has {gpus}")
    if cpus < world * job.cluster.cpus_per_worker:
        raise JobError(f"{world} workers x cluster.cpus_per_worker={job.cluster.cpus_per_worker:g} need "
                       f"{world * job.cluster.cpus_per_worker:g} CPUs; the cluster has {cpus:g}")
    return job.cluster.device if job.cluster.device != "auto" else ("gpu" if gpus >= world else "cpu")


def with_device(job: JobConfig, device: str) -> JobConfig:
    """The job with cluster.device resolved (cpu or gpu; resolve_device's answer), so every
    path that reads it (workers, engines, the weight-sync backend) sees the same one."""
    return job.model_copy(update={"cluster": job.cluster.model_copy(update={"device": device})})


def start_trainer(job: JobConfig, device: str, colocation=None):
    """The TrainGroup with this job's model, loss and optimizer (GPU workers ask Ray for a GPU
    each; `colocation`, a miles.cluster.placement.Colocation: their share of GPUs that
    rollout engines share with them, in its bundles)."""
    from miles.cluster.train_group import TrainGroup

    par, model, algo = job.train.parallel, job.model, job.algo
    resources = {"CPU": job.cluster.cpus_per_worker} | ({"GPU": 1.0} if device == "gpu" else {})
    bundles = None
    if colocation is not None:
        resources, bundles = colocation.rank, colocation.bundles
    group = TrainGroup(par.world, resources=resources, bundles=bundles, tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp)
    try:
        group.call("build_model", model.arch.to_dict(), job.train.seed, dtype=model.dtype,
                   deterministic=job.train.deterministic)
        rl = algo.loss == "policy"  # RL: train.steps counts rollouts, each several optimizer steps
        group.call("set_loss", algo.loss, algo.policy_options(job.rollout) if rl else None,
                   mtp=algo.mtp_loss_coef, indexer=algo.indexer_loss_coef, balance=algo.balance_loss_coef)
        group.call("setup_training", **job.train.optim.model_dump(), total_steps=job.optimizer_steps)
    except BaseException:
        group.shutdown()
        raise
    return group


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


@contextlib.contextmanager
def profiling(job: JobConfig, trainer, run_dir: Path, step: int):
    """The torch.profiler window of log.profile: started before its first step, stopped (traces
    written to <run_dir>/profile/) after its last."""
    p = job.log.profile
    last = min(p.start_step + p.num_steps - 1, job.train.steps)
    if p.enabled and step == p.start_step:
        trainer.call_ranks(p.ranks, "start_profile", str(run_dir / "profile" / f"steps{p.start_step}-{last}"),
                           record_shapes=p.record_shapes, with_stack=p.with_stack, profile_memory=p.profile_memory)
    yield
    if p.enabled and step == last and step >= p.start_step:
        trainer.call_ranks(p.ranks, "stop_profile")


def finish(job: JobConfig, trainer, data, run_dir: Path, monitor: Monitor) -> dict[str, float]:
    """After the last step: the weights in DeepSeek's HF layout (ckpt.save_hf) and, for the
    synthetic source, its generation test of them (data.eval_size; on the checkpoint
    reloaded from disk when one was written)."""
    generate = job.data.source == "synthetic" and job.data.eval_size > 0
    if not (job.ckpt.save_hf or generate):
        return {}
    from plugins.deepseek_v4 import DeepSeekV4ForCausalLM

    if job.ckpt.save_hf:  # each rank writes its own tensors: no copy of the model in this process
        nbytes = trainer.save_hf(run_dir / "hf", job.model.arch)
        from miles.data.sft import copy_tokenizer

        copy_tokenizer(job.data.tokenizer, job.data.template, run_dir / "hf")  # serves text on its own
        monitor.print(f"saved the final weights in DeepSeek's HF layout to {run_dir / 'hf'} ({nbytes / 2**30:.2f} GiB)")
        if not generate:
            return {}
        model = DeepSeekV4ForCausalLM.from_pretrained(run_dir / "hf")
    else:
        weights = {}
        for bucket in trainer.export_weights():
            weights.update(bucket)
        model = DeepSeekV4ForCausalLM(job.model.arch, seed=None)
        model.load_state_dict(weights)
    return data.evaluate(model, job.data.eval_size)


def describe_layout(job: JobConfig, trainer: TrainGroup) -> str:
    """"2 workers (tp=1 ... dp=2)", and the nodes they run on when there are several."""
    p = job.train.parallel
    text = f"{p.world} worker{'s' if p.world > 1 else ''} (tp={p.tp} pp={p.pp} ep={p.ep} cp={p.cp} dp={p.dp})"
    nodes = sorted({x["node"] for x in trainer.layout})
    return text + (f" on {len(nodes)} nodes ({', '.join(nodes)})" if len(nodes) > 1 else "")
