"""Weight sync from a TrainGroup to the engines: buckets of DeepSeek-named full tensors
streamed from the trainer ranks that own them (never gathered into the driver), swapped
in whole. Three paths:

- object store (CPU default): each owning rank puts its buckets; engines pull them and
  check each tensor's MD5.
- broadcast: a process group of its own between the owning ranks and the engines
  (gloo on CPU, nccl on GPU), one broadcast per bucket from its owner; MD5s compared.
- shared (colocated engines): each owning rank packs its buckets into buffers of its own and
  shares them (CUDA IPC on GPUs: no host copy); the engines copy out of them in place,
  checking device fingerprints.
- disk (SGLang's engines; any engine): each rank writes the tensors it owns in DeepSeek's
  HF layout to <dir>/v<version>, each engine loads that directory (names, shapes and
  completeness checked, not bytes); older versions are removed once the engines serve
  the new one.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import ray

from miles.rollout.weights import WeightSyncError


def sync_object_store(trainer, manager, bucket_bytes: int, version: int) -> dict:
    t0 = time.perf_counter()
    per_rank = trainer.call("put_weight_buckets", bucket_bytes)
    buckets = [b for rank in per_rank for b in rank]
    names = [n for _, sums in buckets for n in sums]
    res = manager.update_weights(buckets, names, version)
    return {**res, "seconds": time.perf_counter() - t0, "path": "object_store"}


def sync_shared(trainer, manager, bucket_bytes: int, version: int) -> dict:
    """Colocated engines open the trainer ranks' packed buckets in place (CUDA IPC on GPUs,
    shared memory on hosts), checked by fingerprints computed on the device; the ranks free
    them once every engine has its copy."""
    t0 = time.perf_counter()
    per_rank = trainer.call("share_weight_buckets", bucket_bytes)
    try:
        buckets = [b for rank in per_rank for b in rank]
        res = manager.update_shared(buckets, [n for _, _, fps in buckets for n in fps], version)
    finally:
        trainer.call("release_shared")
    return {**res, "seconds": time.perf_counter() - t0, "path": "shared"}


def sync_broadcast(trainer, engines: list, bucket_bytes: int, version: int, backend: str) -> dict:
    t0 = time.perf_counter()
    plans = trainer.call("weight_plan", bucket_bytes)
    senders = [r for r, p in enumerate(plans) if p]
    index = {r: i for i, r in enumerate(senders)}
    plan = [{"src": index[r], "spec": spec} for r in senders for spec in plans[r]]
    size = len(senders) + len(engines)
    host, port = ray.get(trainer.workers[senders[0]].rendezvous_address.remote())
    ray.get([trainer.workers[r].open_sync_group.remote(host, port, index[r], size, backend) for r in senders]
            + [e.open_group.remote(host, port, len(senders) + j, size, backend) for j, e in enumerate(engines)])
    try:
        ray.get([e.begin_update.remote() for e in engines])
        send = [w.broadcast_weights.remote(plan, bucket_bytes, index.get(r)) for r, w in enumerate(trainer.workers)]
        recv = [e.receive_broadcast.remote(plan) for e in engines]
        sent = {k: v for part in ray.get(send) for k, v in part.items()}
        for j, got in enumerate(ray.get(recv)):
            bad = sorted(k for k in sent if got.get(k) != sent[k])
            if bad or set(got) != set(sent):
                raise WeightSyncError(f"engine {j}: received tensors differ from the sent ones: {bad[:5]}")
        res = ray.get([e.commit.remote(list(sent), version) for e in engines])
    except Exception:
        ray.get([e.abort_update.remote() for e in engines])
        raise
    finally:
        ray.get([trainer.workers[r].close_sync_group.remote() for r in senders] + [e.close_group.remote()
                                                                                   for e in engines])
    return {"seconds": time.perf_counter() - t0, "bytes": res[0]["bytes"], "engines": len(engines),
            "path": "broadcast"}


MARKER = ".miles-weight-version"  # in each version directory: the run that wrote it


def write_version(trainer, directory: Path, config, version: int, owner: str | None = None) -> tuple[Path, int]:
    """The trainer's weights of `version` as <directory>/v<version> in DeepSeek's HF layout
    (every rank writes its own tensors), marked as `owner`'s (the run directory; default the
    folder itself) before anything is written; returns the path and its bytes. A version
    directory this owner wrote before a restart is rewritten whole; anything else there is
    refused, never removed (rollout.sync_dir may be a folder of the user's)."""
    path = Path(directory) / f"v{version:07d}"
    owner = owner or str(Path(directory).absolute())
    if path.exists():
        if not _owned(path, owner):
            raise FileExistsError(f"rollout.sync_dir: {path} exists and this run did not write it (no {MARKER} "
                                  f"naming {owner}); give rollout.sync_dir a folder of its own")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text(owner)
    return path, trainer.save_hf(path, config)


def sync_disk(trainer, manager, directory: Path, config, version: int, owner: str | None = None) -> dict:
    t0 = time.perf_counter()
    path, nbytes = write_version(trainer, directory, config, version, owner)
    res = manager.update_from_disk(str(path), version)
    remove_older_versions(directory, version, owner)
    return {**res, "seconds": time.perf_counter() - t0, "bytes": nbytes, "path": "disk"}


def _owned(path: Path, owner: str) -> bool:
    marker = path / MARKER
    return path.is_dir() and marker.is_file() and marker.read_text() == owner


def remove_older_versions(directory: Path, version: int, owner: str | None = None) -> list[str]:
    """Delete the version directories below `version` (the engines serve it now) that `owner`
    wrote (write_version's marker); any other folder is left alone."""
    owner = owner or str(Path(directory).absolute())
    gone = []
    for d in sorted(Path(directory).glob("v*")):
        m = re.fullmatch(r"v(\d+)", d.name)
        if m and int(m[1]) < version and _owned(d, owner):
            shutil.rmtree(d)
            gone.append(d.name)
    return gone
