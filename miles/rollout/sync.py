"""Weight sync from a TrainGroup to the engines: buckets of DeepSeek-named full tensors
streamed from the trainer ranks that own them (never gathered into the driver), swapped
in whole. Three paths:

- object store (CPU default): each owning rank puts its buckets; engines pull them and
  check each tensor's MD5.
- broadcast: a process group of its own between the owning ranks and the engines
  (gloo on CPU, nccl on GPU; kept across syncs), one broadcast per bucket from its owner;
  digests compared (MD5s on the host, fingerprints on GPUs).
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
    t1 = time.perf_counter()
    try:
        buckets = [b for rank in per_rank for b in rank]
        res = manager.update_shared(buckets, [n for _, _, fps in buckets for n in fps], version)
    finally:
        t2 = time.perf_counter()
        trainer.call("release_shared")
    # the parts, for benchmarks/rollout.py: the ranks' packing and fingerprints, the engines'
    # opening, checking and staging, their swap, the ranks' release
    return {**res, "seconds": time.perf_counter() - t0, "path": "shared", "share_s": t1 - t0,
            "release_s": time.perf_counter() - t2}


class BroadcastGroup:
    """The trainer's sending ranks and the engines as one process group of their own (gloo on
    CPU, nccl on GPU), opened at the first broadcast and kept for the next ones while its
    members are the same: setting up an NCCL group cost ~0.9 s a sync on two H200s, more than
    a small model's bytes. A new member set (an engine replaced, a new trainer) or a failed
    broadcast closes it; the next broadcast opens a fresh one."""

    def __init__(self, backend: str):
        self.backend = backend
        self.members: tuple | None = None  # (sending worker handles, engine handles)

    def ensure(self, senders: list, engines: list) -> None:
        members = (tuple(senders), tuple(engines))
        if members == self.members:
            return
        self.close()
        size = len(senders) + len(engines)
        host, port = ray.get(senders[0].rendezvous_address.remote())
        ray.get([w.open_sync_group.remote(host, port, i, size, self.backend) for i, w in enumerate(senders)]
                + [e.open_group.remote(host, port, len(senders) + j, size, self.backend)
                   for j, e in enumerate(engines)])
        self.members = members

    def close(self) -> None:
        if self.members is None:
            return
        senders, engines = self.members
        self.members = None
        _settle([w.close_sync_group.remote() for w in senders] + [e.close_group.remote() for e in engines])


def _settle(refs: list, timeout_s: float = 10.0) -> None:
    """Wait a little (all together) for clean-up calls. A member still inside a failed
    broadcast runs them once the group's timeout frees it; a dead one has nothing to clean."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001
            pass


def sync_broadcast(trainer, engines: list, bucket_bytes: int, version: int, backend: str,
                   group: BroadcastGroup | None = None) -> dict:
    """One broadcast per bucket from the rank that owns it to every engine; `group` kept
    across calls (RolloutManager keeps one), else a group for this call alone. Returns its
    seconds and their parts: the plan, the group's set-up (~0 once kept), the buckets' way
    (senders pack and fingerprint, the broadcasts, engines fingerprint and stage), the
    digests' comparison and the engines' commit."""
    t0 = time.perf_counter()
    plans = trainer.call("weight_plan", bucket_bytes)
    t_plan = time.perf_counter()
    senders = [r for r, p in enumerate(plans) if p]
    index = {r: i for i, r in enumerate(senders)}
    plan = [{"src": index[r], "spec": spec} for r in senders for spec in plans[r]]
    own = group is None
    group = group or BroadcastGroup(backend)
    if group.backend != backend:
        raise WeightSyncError(f"a {group.backend} broadcast group cannot carry a {backend} sync")
    ok = False
    try:
        group.ensure([trainer.workers[r] for r in senders], engines)
        ray.get([e.begin_update.remote() for e in engines])
        t_open = time.perf_counter()
        try:
            send = [w.broadcast_weights.remote(plan, bucket_bytes, index.get(r)) for r, w in enumerate(trainer.workers)]
            recv = [e.receive_broadcast.remote(plan) for e in engines]
            pending = send + recv
            while pending:  # the first failure at once: the others wait in the group until its timeout
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
            t_sent = time.perf_counter()
            sent = {k: v for part in ray.get(send) for k, v in part.items()}
            for j, got in enumerate(ray.get(recv)):
                bad = sorted(k for k in sent if got.get(k) != sent[k])
                if bad or set(got) != set(sent):
                    raise WeightSyncError(f"engine {j}: received tensors differ from the sent ones: {bad[:5]}")
            t_check = time.perf_counter()
            res = ray.get([e.commit.remote(list(sent), version) for e in engines])
            t1 = time.perf_counter()
        except Exception:
            _settle([e.abort_update.remote() for e in engines])  # (a later update begins afresh anyway)
            raise
        ok = True
    finally:
        if own or not ok:
            group.close()
    return {"seconds": time.perf_counter() - t0, "bytes": res[0]["bytes"], "engines": len(engines),
            "path": "broadcast", "plan_s": t_plan - t0, "open_s": t_open - t_plan, "transfer_s": t_sent - t_open,
            "check_s": t_check - t_sent, "commit_s": t1 - t_check}  # closing a group of this call's own: in seconds


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
