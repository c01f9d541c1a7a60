"""Weight sync from a TrainGroup to the engines: buckets of DeepSeek-named full tensors
streamed from the trainer ranks that own them (never gathered into the driver), verified
by MD5 on arrival, swapped in whole. Two paths:

- object store (CPU default): each owning rank puts its buckets; engines pull them.
- broadcast: a process group of its own between the owning ranks and the engines
  (gloo on CPU, nccl on GPU), one broadcast per bucket from its owner.
"""

from __future__ import annotations

import time

import ray

from miles.rollout.weights import WeightSyncError


def sync_object_store(trainer, manager, bucket_bytes: int, version: int) -> dict:
    t0 = time.perf_counter()
    per_rank = trainer.call("put_weight_buckets", bucket_bytes)
    buckets = [b for rank in per_rank for b in rank]
    names = [n for _, sums in buckets for n in sums]
    res = manager.update_weights(buckets, names, version)
    return {**res, "seconds": time.perf_counter() - t0, "path": "object_store"}


def sync_broadcast(trainer, engines: list, bucket_bytes: int, version: int, backend: str = "gloo") -> dict:
    t0 = time.perf_counter()
    plans = trainer.call("weight_plan", bucket_bytes)
    senders = [r for r, p in enumerate(plans) if p]
    index = {r: i for i, r in enumerate(senders)}
    plan = [{"src": index[r], "spec": spec} for r in senders for spec in plans[r]]
    size = len(senders) + len(engines)
    host, port = ray.get(trainer.workers[senders[0]].rendezvous_address.remote())
    ray.get([trainer.workers[r].open_sync_group.remote(host, port, index[r], size) for r in senders]
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
