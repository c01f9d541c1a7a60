"""TrainGroup: `world_size` TrainWorker actors in one placement group, rank = bundle index.

Megatron orders ranks TP fastest, then CP, EP/DP, PP; giving rank i bundle i (PACK
strategy) keeps TP peers on neighbouring devices of one node.
"""

from __future__ import annotations

import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.node import device_options
from miles.train.batching import MicroBatch
from miles.train.worker import TrainWorker


class TrainGroup:
    def __init__(self, world_size: int, resources: dict[str, float] | None = None, warn_after: float = 600.0,
                 bundles: list[dict[str, float]] | None = None, **parallel: int):
        """`resources`: each rank's actor resources; `bundles`: the placement group's bundles,
        one per rank (default: each rank's resources; larger where colocated rollout engines
        share them: miles.cluster.placement). `warn_after`: seconds a call may go unanswered by
        some ranks before a line on stderr says which (again every `warn_after`): a hang shows
        instead of silence."""
        resources = resources or {"CPU": 1}
        self.warn_after = warn_after
        self.pg = placement_group([dict(b) for b in bundles] if bundles else [dict(resources)] * world_size,
                                  strategy="PACK")
        self.workers, self.layout = [], []
        try:
            ray.get(self.pg.ready(), timeout=120)
            actor = ray.remote(TrainWorker)
            opts = {"num_cpus": resources.get("CPU", 0), **device_options(resources.get("GPU", 0))}
            self.workers = [actor.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote(i, world_size)
                for i in range(world_size)]
            host, port = ray.get(self.workers[0].rendezvous_address.remote())
            self.layout = self.call("init_distributed", host, port, **parallel)
            for want in parallel:
                got = {lay[want] for lay in self.layout}
                if got != {parallel[want]}:
                    raise RuntimeError(f"asked for {want}={parallel[want]}, the workers report {sorted(got)}")
        except BaseException:
            self._release()
            raise

    def call(self, method: str, *args, **kwargs) -> list:
        """Run `method` on every rank, in rank order, and wait for all results."""
        return self.wait(method, {r: getattr(w, method).remote(*args, **kwargs) for r, w in enumerate(self.workers)})

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list:
        """Run `method` on every rank with that rank's own arguments (e.g. its micro-batches)."""
        return self.wait(method, {r: getattr(w, method).remote(*a)
                                  for r, (w, a) in enumerate(zip(self.workers, per_rank_args, strict=True))})

    def call_ranks(self, ranks: list[int], method: str, *args, **kwargs) -> list:
        """Run `method` on the listed ranks only (ranks outside the group are ignored)."""
        return self.wait(method, {r: getattr(self.workers[r], method).remote(*args, **kwargs) for r in ranks
                                  if 0 <= r < len(self.workers)})

    def wait(self, method: str, refs: dict[int, ray.ObjectRef]) -> list:
        """The ranks' results ({rank: ref}, in that order). A rank's error is raised as soon
        as it comes (its peers may wait for it in a collective until gloo's 5-minute timeout);
        ranks that have not answered after `warn_after` seconds are named on stderr, again
        every `warn_after`, while the wait goes on."""
        rank_of = {ref: r for r, ref in refs.items()}
        pending, t0, warned, results = list(refs.values()), time.monotonic(), 0, {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, t0 + (warned + 1) * self.warn_after
                                                                           - time.monotonic()))
            for ref in done:
                results[rank_of[ref]] = ray.get(ref)  # a failed rank's error raises now
            if not done:
                warned += 1
                late = sorted(rank_of[ref] for ref in pending)
                nodes = sorted({self.layout[r]["node"] for r in late}) if self.layout else []
                print(f"miles: TrainWorker.{method} has not returned on rank(s) {late} after "
                      f"{time.monotonic() - t0:.0f} s; still waiting (a hang? `ray stack` on "
                      f"{', '.join(nodes) or 'their nodes'} prints their Python stacks)", file=sys.stderr, flush=True)
        return [results[r] for r in refs]

    def train_step(self, replicas: list[list[MicroBatch]], checksums: bool = False) -> list[dict]:
        """One optimizer step: each data-parallel replica's micro-batches go into the object
        store once and to every rank of that replica (its TP, PP and CP peers). Returns every
        rank's result, in rank order."""
        refs = [ray.put(r) for r in replicas]
        return self.call_each("train_step", [(refs[x["dp_rank"]], checksums) for x in self.layout])

    def forward_logprobs(self, replicas: list[list[MicroBatch]], reference: bool = False) -> list[list]:
        """Forward only: per data-parallel replica, log p(label) [B, S] of each of its
        micro-batches (from the replica's last pipeline stage, first TP and CP rank);
        `reference`: under the reference weights (TrainWorker.keep_reference)."""
        refs = [ray.put(r) for r in replicas]
        out = self.call_each("forward_logprobs", [(refs[x["dp_rank"]], reference) for x in self.layout])
        last = {x["dp_rank"]: i for i, x in enumerate(self.layout)
                if x["pp_rank"] == x["pp"] - 1 and x["tp_rank"] == 0 and x["cp_rank"] == 0}
        return [out[last[r]] for r in range(len(replicas))]

    def save_hf(self, directory, config) -> int:
        """The weights in DeepSeek's HF layout: each rank writes the tensors it owns (every
        tensor once), then the index and config.json here. Returns the tensors' bytes."""
        import json
        import os
        from pathlib import Path

        from plugins.deepseek_v4.hf_io import write_index

        directory = Path(os.path.abspath(directory))  # the workers' working directory is not ours
        directory.mkdir(parents=True, exist_ok=True)
        weight_map, total, held = {}, 0, set()
        for names, nbytes, tensors in self.call("save_hf_shards", str(directory)):
            twice = set(names) & set(weight_map)
            if twice:
                raise RuntimeError(f"save_hf: {sorted(twice)[:3]} written by two ranks")
            weight_map.update(names)
            total += nbytes
            held.update(tensors)
        if held != set(weight_map):
            raise RuntimeError(f"save_hf: tensors no rank wrote: {sorted(held - set(weight_map))[:3]}")
        absent = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if absent:  # ranks on other nodes wrote to their own disks
            raise RuntimeError(f"save_hf: {len(absent)} shard files the ranks wrote are not in {directory} "
                               f"(e.g. {absent[0]}): on several nodes it must be a filesystem every node shares")
        # The tensors are unquantized: no quantization_config claiming FP8 weights and scales
        cfg = {k: v for k, v in config.to_dict().items() if k not in ("quantization_config", "expert_dtype")}
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_index(directory, weight_map, total)
        return total

    def export_weights(self, bucket_bytes: int = 256 << 20):
        """Yield buckets {DeepSeek name: full tensor} covering the whole model once."""
        for rank_buckets in self.call("export_weights", bucket_bytes):
            yield from rank_buckets

    def shutdown(self, grace: float = 10.0) -> None:
        """Close the ranks' process groups, then kill the actors. A rank still busy after
        `grace` seconds (a step in flight when the job was stopped, or a collective that will
        never complete) is killed as it is: an unwinding job must end within the cluster's
        stop window, not wait on it."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=grace)
        except ray.exceptions.GetTimeoutError:
            pass
        finally:
            self._release()

    def _release(self) -> None:
        """Kill the actors and free the placement group (nothing is left behind)."""
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
