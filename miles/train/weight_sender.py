"""A trainer rank's side of every weight path out of the trainer: host buckets (export, the
object store), safetensors shards (the HF layout, disk sync), flat buffers shared in place
with colocated engines (CUDA IPC on GPUs), and the broadcast group to engines of their own.
Each path takes the rank's buckets of the full (TP-gathered) weights under DeepSeek's names
(miles.train.weight_export); every rank of the trainer takes part in each call."""

from __future__ import annotations

import torch

from miles.ckpt.sharded import model_tensors
from miles.rollout.weights import bucket_buffer, bucket_digests, open_group, pack, put_buckets, share, spans_of, spec_of
from miles.train import weight_export
from plugins.deepseek_v4.checksum import packed_fingerprints
from plugins.deepseek_v4.hf_io import write_shard


class WeightSender:
    def __init__(self, model, rank: int, device: torch.device | None):
        self.model, self.rank, self.device = model, rank, device
        self.shared: list[torch.Tensor] = []  # share()'s buffers, kept until the engines are done
        self.group = None  # the broadcast group with the engines, between open_group and close_group

    def export(self, bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
        """This rank's buckets as host copies."""
        return [{k: v.cpu().clone() for k, v in b.items()} for b in weight_export.buckets(self.model, bucket_bytes)]

    def save_hf_shards(self, directory: str, bucket_bytes: int) -> tuple[dict[str, str], int, list[str]]:
        """This rank's buckets as safetensors files of its own in `directory`; returns ({name:
        file}, bytes, the names of every tensor this rank holds: the driver checks each was
        written). Nothing passes through the driver."""
        names, total = {}, 0
        for i, b in enumerate(weight_export.buckets(self.model, bucket_bytes)):
            fname = f"model-rank{self.rank:05d}-{i + 1:05d}.safetensors"
            total += write_shard(directory, fname, b)
            names.update(dict.fromkeys(b, fname))
        return names, total, list(model_tensors(self.model))

    def put(self, bucket_bytes: int) -> list[tuple]:
        """The buckets put into the object store one at a time, as [(ObjectRef, {name: md5})]."""
        return put_buckets(weight_export.buckets(self.model, bucket_bytes))

    def share(self, bucket_bytes: int) -> list[tuple]:
        """The buckets packed into flat buffers that stay here until release(), each as (share
        handle, spec, {name: fingerprint}): colocated engines open them in place."""
        out = []
        self.shared = []
        for b in weight_export.buckets(self.model, bucket_bytes):
            flat, spec = pack(b), spec_of(b)
            self.shared.append(flat)
            out.append((share(flat), spec, packed_fingerprints(flat, spans_of(spec))))
        if self.device is not None:
            torch.cuda.synchronize()  # the buffers are written before another process reads them
        return out

    def release(self) -> None:
        self.shared = []

    def plan(self, bucket_bytes: int) -> list:
        return weight_export.plan(self.model, bucket_bytes)

    def open_group(self, host: str, port: int, rank: int, size: int, backend: str, listening=None) -> None:
        self.group = open_group(host, port, rank, size, backend, listening=listening)

    def broadcast(self, plan: list[dict], bucket_bytes: int, me: int | None) -> dict[str, str]:
        """Send this rank's buckets over the group (`me`: this rank's index in it, None when it
        sends nothing but takes part in the TP gathers); every member takes part in every
        bucket in plan order. Returns the digests (weights.digests) of what this rank sent."""
        gen = weight_export.buckets(self.model, bucket_bytes)
        if me is None:
            for _ in gen:
                pass
            return {}
        sums = {}
        for b in plan:
            if b["src"] == me:
                flat = pack(next(gen))
                sums.update(bucket_digests(flat, b["spec"]))
            else:
                flat, _ = bucket_buffer(b["spec"], self.device)
            self.group.broadcast(flat, b["src"]).wait()
        if next(gen, None) is not None:
            raise RuntimeError(f"rank {self.rank}: the sync plan misses some of this rank's buckets")
        return sums

    def close_group(self) -> None:
        self.group = None
