"""What every job's loop runs inside (SFT and plain jobs in miles/controller.py, RL in
miles/rl/loop.py): the run directory, the Ray session, the resolved device, the monitor,
checkpoints, the trainer, and the teardown that a finished, failed or stopped run goes through.

    with session(job) as s:        # run directory, Ray, device, monitor, checkpoints
        data = s.closing(<the loop's data source>)
        trainer = s.closing(start_trainer(s.job), "shutdown")
        start = s.ckpt.restore(trainer, data)
        for step in ...: ...       # the loop
        summary = s.finish(trainer, data, history, prefixes)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import ray

from miles.ckpt.manager import Checkpoints
from miles.cluster.train_group import TrainGroup
from miles.config import JobConfig, save_resolved
from miles.data.sft import copy_tokenizer
from miles.observe import alignment, records
from miles.observe.metrics import FILE as METRICS_FILE
from miles.observe.metrics import Monitor
from miles.observe.profiler import default_ranks
from plugins.deepseek_v4 import DeepSeekV4ForCausalLM


class JobError(RuntimeError):
    """The job cannot run as configured here (run directory taken, not enough GPUs, ...)."""


@dataclass
class RunResult:
    run_dir: Path
    history: list[dict]  # per step: the logged metrics
    summary: dict[str, float]  # the finished run: final losses and evaluations


@dataclass
class Session:
    job: JobConfig  # cluster.device resolved (cpu or gpu): every path sees the same one
    run_dir: Path
    monitor: Monitor
    ckpt: Checkpoints
    stack: contextlib.ExitStack  # what the run closes on its way out, last opened first

    def closing(self, obj, close: str = "close"):
        """obj, whose `close` method runs when the session ends (however it ends)."""
        self.stack.callback(getattr(obj, close))
        return obj

    def finish(self, trainer, data, history: list[dict], prefixes: tuple[str, ...]) -> dict[str, float]:
        """After the last step: the pending checkpoint written, the final weights saved (and the
        synthetic source's generation test); returns the summary: the last step's metrics under
        `prefixes`, with what finishing measured."""
        self.ckpt.close(trainer)
        summary = {k: v for k, v in history[-1].items() if k.startswith(prefixes)} if history else {}
        return summary | save_final(self.job, trainer, data, self.run_dir, self.monitor)


@contextlib.contextmanager
def session(job: JobConfig, stream: TextIO | None = None) -> Iterator[Session]:
    """The run directory (refused if it holds another run, unless resuming), the job's Ray
    cluster, the device resolved, the monitor (closed as failed when the loop raises) and the
    checkpoints of ckpt.*."""
    out = stream or sys.stdout
    ckpt = Checkpoints(job, report=lambda text: print(text, file=out, flush=True))
    run_dir = prepare_run_dir(job, resume_from=ckpt.iteration if job.ckpt.load else None, stream=out)
    with ray_session(job), contextlib.ExitStack() as stack:
        job = with_device(job, resolve_device(job))
        monitor = Monitor(job.log, run_dir, job.train.steps, job.resolved(), stream)
        stack.push(lambda exc_type, *_: monitor.close(failed=exc_type is not None))
        ckpt.report = monitor.print
        yield Session(job, run_dir, monitor, ckpt, stack)


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
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame) -> None:
        raise KeyboardInterrupt("stopped by SIGTERM")

    return signal.signal(signal.SIGTERM, handler)


def resolve_device(job: JobConfig) -> str:
    """cpu or gpu workers: `auto` takes GPUs when the cluster has one per rank. A cluster too
    small for the workers is an error here, not a placement group waiting forever."""
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


def start_trainer(job: JobConfig, colocation=None) -> TrainGroup:
    """The TrainGroup with this job's model, loss and optimizer (GPU workers ask Ray for a GPU
    each; `colocation`, a miles.cluster.placement.Colocation: their share of GPUs that
    rollout engines share with them, in its bundles)."""
    par = job.train.parallel
    resources = {"CPU": job.cluster.cpus_per_worker} | ({"GPU": 1.0} if job.cluster.device == "gpu" else {})
    bundles = None
    if colocation is not None:
        resources, bundles = colocation.rank, colocation.bundles
    group = TrainGroup(par.world, resources=resources, bundles=bundles, tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp)
    try:
        for method, args, kwargs in worker_setup(job):
            group.call(method, *args, **kwargs)
    except BaseException:
        group.shutdown()
        raise
    return group


def worker_setup(job: JobConfig) -> list[tuple[str, tuple, dict]]:
    """The TrainWorker calls, in order, that give a rank this job's model, loss, router
    settings and optimizer (start_trainer makes them on every rank; a benchmark on one
    in-process worker makes the same)."""
    model, algo = job.model, job.algo
    rl = algo.loss == "policy"  # RL: train.steps counts rollouts, each several optimizer steps
    return [("build_model", (model.arch.to_dict(), job.train.seed),
             {"dtype": model.dtype, "deterministic": job.train.deterministic}),
            ("set_loss", (algo.loss, algo.policy_options(job.rollout) if rl else None),
             {"mtp": algo.mtp_loss_coef, "indexer": algo.indexer_loss_coef, "balance": algo.balance_loss_coef}),
            ("set_router", (), {"freeze_bias": algo.freeze_router_bias, "freeze_weights": algo.freeze_router}),
            ("setup_training", (), {**job.train.optim.model_dump(), "total_steps": job.optimizer_steps})]


@contextlib.contextmanager
def profiling(job: JobConfig, trainer, run_dir: Path, step: int):
    """The torch.profiler window of log.profile: started before its first step, stopped (traces
    written to <run_dir>/profile/) after its last; and log.trace's captures of its steps
    (<run_dir>/trace/step<k>/)."""
    p = job.log.profile
    last = min(p.start_step + p.num_steps - 1, job.train.steps)
    ranks = p.ranks if p.ranks is not None else default_ranks(trainer.layout)
    t = job.log.trace
    if p.enabled and step == p.start_step:
        trainer.call_ranks(ranks, "start_profile", str(run_dir / "profile" / f"steps{p.start_step}-{last}"),
                           record_shapes=p.record_shapes, with_stack=p.with_stack, profile_memory=p.profile_memory)
    if t.enabled and step in t.steps:
        trainer.call_ranks(t.ranks, "start_trace", t.layers, t.what)
    yield
    if t.enabled and step in t.steps:
        trainer.call_ranks(t.ranks, "stop_trace", str(run_dir / "trace" / f"step{step}"))
    if p.enabled and step == last and step >= p.start_step:
        trainer.call_ranks(ranks, "stop_profile")


def save_final(job: JobConfig, trainer, data, run_dir: Path, monitor: Monitor) -> dict[str, float]:
    """After the last step: the weights in DeepSeek's HF layout (ckpt.save_hf) and, for the
    synthetic source, its generation test of them (data.eval_size; on the checkpoint
    reloaded from disk when one was written)."""
    generate = job.data.source == "synthetic" and job.data.eval_size > 0
    if not (job.ckpt.save_hf or generate):
        return {}
    if job.ckpt.save_hf:  # each rank writes its own tensors: no copy of the model in this process
        nbytes = trainer.save_hf(run_dir / "hf", job.model.arch)
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
