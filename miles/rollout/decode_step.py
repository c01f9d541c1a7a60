"""The engine's decoding step: every running sequence one token on, in batch buckets.

A step runs the model's `decode` over the running sequences padded to the next bucket size
(powers of two up to the engine's slots). The padding rows decode a scratch slot that no
sequence owns, so they touch no one's state, and the step's shapes depend only on the bucket:
on CUDA each bucket's step is captured once as a CUDA graph and replayed (one launch for the
whole model instead of thousands; the decode step has no host synchronisation to break it).
On CPU the same padded step runs eagerly: the padding and the scratch slot are tested there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from miles.memory import to_device

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [bs] the replay's inputs, copied in before each replay
    slots: torch.Tensor  # [bs]
    logits: torch.Tensor  # [bs, V] the replay's output
    choices: dict[str, torch.Tensor]  # "routes" [bs, L, k], "picks" [bs, C, K]: each input token's (replay)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a step is padded to: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeStep:
    def __init__(self, model, cache, scratch: int, max_batch: int, graphs: bool = True):
        """`cache` holds a slot `scratch` that no sequence is given (the padding rows'); with
        `graphs`, on CUDA each bucket is captured at its first step."""
        self.model, self.cache, self.scratch = model, cache, scratch
        self.buckets = buckets(max_batch)
        self.device = cache.length.device
        # bf16 only: an fp32 model's experts loop over their groups on the host, which a
        # capture cannot hold (the grouped GEMMs that need no host are bf16's)
        self.use_graphs = graphs and self.device.type == "cuda" and model.embed.weight.dtype == torch.bfloat16
        self.graphs: dict[tuple[int, frozenset], _Graph] = {}  # by (bucket, what it records)
        self.graph_error: str | None = None  # why the step runs eagerly after all (a capture failed)
        self._pool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.no_grad()
    def __call__(self, ids: list[int] | torch.Tensor, slots: list[int], record=()
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Next-token logits [n, V] of n sequences (their last tokens `ids`, in cache `slots`)
        and the choices `record` names that those tokens made ("routes": the experts per
        learned MoE layer [n, L, k]; "picks": the indexer's entries per CSA layer [n, C, K]);
        each slot advances one token. `ids` may be a [n] long tensor on the device (tokens
        sampled by the step before, not yet seen by the host): nothing here waits for the
        device, so the host can prepare this step while the last one runs."""
        n = len(slots)
        bs, rec = self.bucket(n), frozenset(record)
        if isinstance(ids, torch.Tensor):
            ids_t = torch.cat((ids, ids.new_zeros(bs - n))) if bs > n else ids
        else:
            ids_t = to_device(torch.tensor(ids + [0] * (bs - n), dtype=torch.long), self.device)
        slots_t = to_device(torch.tensor(slots + [self.scratch] * (bs - n), dtype=torch.long), self.device)
        self.cache.length[self.scratch] = 0  # the scratch slot never fills up
        g = (self.graphs.get((bs, rec)) or self._try_capture(bs, rec)) if self.use_graphs else None
        if g is None:
            logits, choices = self._decode(ids_t, slots_t, rec)
        else:
            g.ids.copy_(ids_t)
            g.slots.copy_(slots_t)
            g.graph.replay()
            logits, choices = g.logits, g.choices
        return logits[:n], {k: v[:n] for k, v in choices.items()}

    def _decode(self, ids: torch.Tensor, slots: torch.Tensor, rec: frozenset):
        out = self.model.decode(ids, self.cache, slots, rec)
        return out if rec else (out, {})

    def _try_capture(self, bs: int, rec: frozenset) -> _Graph | None:
        """The bucket's graph, or None (and eager steps from now on, said once in the log) where
        the step cannot be captured after all."""
        try:
            return self._capture(bs, rec)
        except Exception as e:  # noqa: BLE001 (any capture failure: the step still runs, eagerly)
            self.use_graphs, self.graph_error = False, f"{type(e).__name__}: {e}"
            self.graphs.clear()
            log.warning("the decode step cannot be captured as a CUDA graph; it runs eagerly: %s", self.graph_error)
            return None

    def _capture(self, bs: int, rec: frozenset) -> _Graph:
        """Warm the step up on a side stream (Triton's compiles, the allocator) on the scratch
        slot alone, then capture it."""
        ids = torch.zeros(bs, dtype=torch.long, device=self.device)
        slots = torch.full((bs,), self.scratch, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.cache.length[self.scratch] = 0
                self.model.decode(ids, self.cache, slots, rec)
        torch.cuda.current_stream().wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self.cache.length[self.scratch] = 0
        with torch.cuda.graph(graph, pool=self._pool):
            logits, choices = self._decode(ids, slots, rec)
        self.graphs[bs, rec] = _Graph(graph, ids, slots, logits, choices)
        log.info("decode step captured for batch %d (%d buckets captured)", bs, len(self.graphs))
        return self.graphs[bs, rec]

    def reset(self) -> None:
        """Drop the graphs: the weights' or the cache's storages moved (memory released and
        resumed); the next steps capture again."""
        self.graphs.clear()
        self._pool = None
