"""The RL job's rollout engines: what the job may ask of them (checked before anything starts),
starting them (embedded or SGLang, colocated in the trainer's bundles on GPUs), bringing them
to the trainer's weights by the job's sync path, and the colocated generation phase (the
trainer's memory out, the engines' in)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import ray

from miles.cluster.placement import colocate_on_gpus
from miles.config import JobConfig
from miles.rollout.manager import RolloutManager
from miles.rollout.sync import sync_disk, sync_object_store, sync_shared, write_version
from miles.session import JobError


def check_engines(job: JobConfig, cluster_gpus: float) -> None:
    """Refuse, before anything starts, engine setups this RL loop cannot run (each would fail
    minutes later, inside an engine or as a placement that never comes). job.cluster.device is
    the resolved one (cpu or gpu)."""
    r, device = job.rollout, job.cluster.device
    if r.engine == "sglang":
        if device != "gpu":
            raise JobError("rollout.engine: sglang runs on GPU clusters; on CPUs use rollout.engine: embedded")
        sglang_options(job)
    if device != "gpu":
        return
    if r.gpus_per_engine == 0:
        raise JobError("rollout.gpus_per_engine is 0 on a GPU cluster: an engine would see no GPU; give each "
                       "engine its GPUs (e.g. rollout.gpus_per_engine: 1, or colocated: a share such as 0.5)")
    if r.placement == "colocated":
        if r.engine == "sglang":
            raise JobError("rollout.placement: colocated with rollout.engine: sglang is not built (an SGLang server "
                           "spans its own GPUs); use the embedded engine, or rollout.placement: disaggregated")
        try:
            colocation(job)
        except ValueError as e:
            raise JobError(str(e)) from None
        need = job.train.parallel.world  # the engines take shares of the trainer's GPUs
    else:
        need = job.train.parallel.world + r.num_engines * r.gpus_per_engine
    if cluster_gpus < need:
        raise JobError(f"{job.train.parallel.world} trainer GPUs + rollout.num_engines={r.num_engines} x "
                       f"rollout.gpus_per_engine={r.gpus_per_engine:g} need {need:g} GPUs; the cluster has "
                       f"{cluster_gpus:g}")


def colocation(job: JobConfig):
    """Colocated on GPUs: the placement (miles.cluster.placement.Colocation) of the trainer's
    ranks and the engines on the same GPUs; None otherwise (CPUs share a node's cores)."""
    r = job.rollout
    if r.placement != "colocated" or job.cluster.device != "gpu":
        return None
    return colocate_on_gpus(job.train.parallel.world, r.num_engines, r.gpus_per_engine, job.cluster.cpus_per_worker,
                            r.cpus_per_engine)


def start_engines(job: JobConfig, run_dir: Path, trainer, version: int, shared=None):
    """The rollout manager: rollout.num_engines engines behind SGLang's router, weights to
    come from the trainer (update_engines). Embedded engines start from seeded weights that are
    not the trainer's (another seed, no weight version), so generation before a working weight
    sync cannot pass for the trainer's; SGLang's engines start from the trainer's weights of
    `version` written to disk (their format is then the one every later sync writes). `shared`:
    colocated on GPUs, each engine in its bundle of the trainer's placement group."""
    spec = {"config": job.model.arch.to_dict(), "seed": job.train.seed + 1, "weight_version": None,
            "dtype": job.model.dtype, "device": "cuda" if job.cluster.device == "gpu" else "cpu",
            "return_routed_experts": bool(job.algo.routing_replay), "return_indexer_picks": job.algo.indexer_replay}
    if job.rollout.engine != "sglang":
        return RolloutManager(job.rollout, spec, log_dir=str(run_dir),
                              colocation=(trainer.pg, shared) if shared is not None else None)
    path, _ = write_version(trainer, sync_dir(job), job.model.arch, version, sync_owner(job))
    rollout = job.rollout.model_copy(update={"sglang": sglang_options(job)})
    return RolloutManager(rollout, spec | {"hf": str(path)}, log_dir=str(run_dir), version=version)


def sglang_options(job: JobConfig) -> dict:
    """rollout.sglang with the tokenizer's directory: the engines start from the trainer's
    weights, which carry no tokenizer files; it is ckpt.hf's unless tokenizer-path is given."""
    opts = dict(job.rollout.sglang)
    if not any(k.replace("-", "_") == "tokenizer_path" for k in opts):
        if job.ckpt.hf is None:
            raise JobError("rollout.engine: sglang needs its tokenizer's directory: set ckpt.hf (DeepSeek's HF "
                           "checkpoint holds it) or rollout.sglang.tokenizer-path (the engines load the trainer's "
                           "weights, which carry no tokenizer files)")
        opts["tokenizer-path"] = str(Path(job.ckpt.hf).absolute())
    return opts


def sync_dir(job: JobConfig) -> Path:
    """rollout.sync: disk: where the trainer writes each version for the engines."""
    return Path(job.rollout.sync_dir or Path(job.log.run_dir) / "weights").absolute()


def sync_owner(job: JobConfig) -> str:
    """What marks the version directories this run writes (its run directory): the only ones
    it ever removes."""
    return str(Path(job.log.run_dir).absolute())


def update_engines(job: JobConfig, trainer, engines, version: int) -> dict:
    """The trainer's weights into every engine (unless they already serve `version`)."""
    if engines.version == version:
        return {}
    colocated = job.rollout.placement == "colocated"
    if colocated:
        ray_get_all([e.resume_memory.remote() for e in engines.engine_actors()])
    bucket = job.rollout.bucket_mb << 20
    if job.rollout.sync == "broadcast":
        res = engines.update_by_broadcast(trainer, bucket, version, sync_backend(job))
    elif job.rollout.sync == "disk":
        res = sync_disk(trainer, engines, sync_dir(job), job.model.arch, version, sync_owner(job))
    elif job.rollout.sync == "shared":
        res = sync_shared(trainer, engines, bucket, version)
    else:
        res = sync_object_store(trainer, engines, bucket, version)
    if colocated:
        ray_get_all([e.release_memory.remote() for e in engines.engine_actors()])
    return res


def sync_backend(job: JobConfig) -> str:
    """The broadcast group's backend for trainer ranks and engines alike: nccl on GPUs, gloo on
    CPUs, from the job's resolved device (cluster.device auto must be resolved first: gloo on
    one side and nccl on the other hang until the group's timeout)."""
    device = job.cluster.device
    if device not in ("cpu", "gpu"):
        raise ValueError(f"cluster.device is {device!r}: resolve it (miles.controller.with_device) before a sync")
    return "nccl" if device == "gpu" else "gloo"


def ray_get_all(refs: list) -> list:
    return ray.get(refs)


@contextlib.contextmanager
def generation_phase(job: JobConfig, trainer, engines):
    """Colocated: the trainer's memory out and the engines' in for generation, then back."""
    if job.rollout.placement != "colocated":
        yield
        return
    trainer.call("sleep")
    ray_get_all([e.resume_memory.remote() for e in engines.engine_actors()])
    try:
        yield
    finally:
        ray_get_all([e.release_memory.remote() for e in engines.engine_actors()])
        trainer.call("wake_up")
