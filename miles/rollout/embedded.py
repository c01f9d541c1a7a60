"""The embedded engine as a Ray actor: an `EngineService` behind its HTTP server, plus the
weight-update calls a trainer drives through Ray (object store buckets, broadcast group, a
directory)."""

from __future__ import annotations

import os

import torch

from miles.rollout.server import HttpServer, build_app
from miles.rollout.service import EngineService, EngineSpec


class EmbeddedEngine:
    def __init__(self, spec: dict):
        from miles.cluster.node import node_address

        torch.set_grad_enabled(False)
        # The router may run on another node: serve on this node's address unless told.
        self.svc = EngineService(EngineSpec(**{"host": node_address(), **spec}))
        self.http = HttpServer(build_app(self.svc), self.svc.spec.host, self.svc.spec.port)

    def url(self) -> str:
        return self.http.url

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {**self.svc.info(), **self.svc.engine.stats(), "url": self.url()}

    def memory(self) -> dict[str, float]:
        """miles.memory.device_memory of this engine's device (empty on CPUs)."""
        from miles.memory import device_memory

        return device_memory(self.svc.engine.device)

    # ---- weight updates (see miles/rollout/sync.py)
    def begin_update(self) -> None:
        self.svc.begin_update()

    def stage(self, bucket: dict[str, torch.Tensor], sums: dict[str, str]) -> int:
        return self.svc.stage(bucket, sums)

    def stage_shared(self, handle: tuple, spec: list, fingerprints: dict[str, int]) -> int:
        return self.svc.stage_shared(handle, spec, fingerprints)

    def commit(self, names: list[str], version: int | None = None) -> dict:
        return self.svc.commit(names, version)

    def abort_update(self) -> None:
        self.svc.abort_update()

    def update_from_disk(self, path: str, version: int | None = None) -> dict:
        return self.svc.update_from_disk(path, version)

    def put_weight_buckets(self, bucket_bytes: int) -> dict:
        """The weights this engine serves: {"version", "buckets": [(ObjectRef, {name: md5})]}
        (object-store buckets): a replacement catches up from a live engine where the last
        update cannot be replayed (a broadcast is not kept)."""
        from miles.rollout.weights import cut, put_buckets

        return self.svc.with_weights(lambda w, version: {"version": version,
                                                         "buckets": put_buckets(cut(w, bucket_bytes))})

    def open_group(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        self.svc.open_group(host, port, rank, size, backend)

    def receive_broadcast(self, plan: list[dict]) -> dict[str, str]:
        return self.svc.receive_broadcast(plan)

    def close_group(self) -> None:
        self.svc.close_group()

    def release_memory(self) -> int:
        return self.svc.release_memory()

    def resume_memory(self) -> None:
        self.svc.resume_memory()

    def shutdown(self) -> None:
        self.http.stop()
        self.svc.stop()
