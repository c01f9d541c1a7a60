"""Per-forward facts every layer reads: the sequence layout, the rotary tables of each kind,
this rank's query tokens, and the auxiliary-loss terms the layers append."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops
from .layout import SequenceLayout


def once(memo: dict | None, key, make):
    """make() computed once per key in a decoding step's memo (every time without one): what
    each layer would compute again from the step's positions (RoPE tables, masks, block
    numbers), a few small kernels each."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


@dataclass
class Rope:
    """cos/sin [B, S, rd/2] at token positions for one rotation kind, plus its inv_freq."""

    inv_freq: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    # a decoding step's position facts by what they are (`once`): every layer of a kind rotates
    # at the same positions, its tables computed once a step (seven fp64 kernels a table)
    memo: dict | None = None

    def at(self, positions: torch.Tensor, key=None) -> tuple[torch.Tensor, torch.Tensor]:
        return once(self.memo if key is not None else None, ("rope", key),
                    lambda: ops.rope_cos_sin(positions, self.inv_freq))


# What a trace can hold of an attention layer's forward (doc and pos always: its replay needs them)
TRACE_FIELDS = ("input", "q", "kv", "entries", "chosen", "lse", "output")


@dataclass
class Trace:
    """Attention internals of chosen layers (a job's log.trace), for replay and debugging: each
    forward while it is set appends, per chosen layer, the tensors `what` names (detached, on
    the host): input [B, s, d] (after the attention norm), q [B, s, H, D], kv [B, S, D] (K = V
    of the whole sequence), entries [B, G, D] (compressed), chosen [B, s, G] (the entries each
    query attends: the indexer's top-k in CSA layers), lse [B, s, H] (where the path gives it),
    output [B, s, d]; with doc and pos [B, S] and rows [s] (the positions this rank's queries
    are: its context-parallel chunk)."""

    layers: frozenset[int]
    what: frozenset[str] = frozenset(TRACE_FIELDS)
    captured: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def add(self, layer: int, tensors: dict[str, torch.Tensor | None]) -> None:
        keep = self.what | {"doc", "pos", "rows"}  # copies: a host tensor's .cpu() is the tensor itself
        self.captured.setdefault(layer, []).append(
            {k: v.detach().cpu().clone() for k, v in tensors.items() if k in keep and v is not None})


@dataclass
class Fwd:
    """Per-forward facts shared by all layers. `layout` and `ropes` cover the whole
    sequence; `q` is the slice of it whose queries this rank computes (context parallel)."""

    layout: SequenceLayout
    ropes: dict[str, Rope]
    q: slice | torch.Tensor = field(default_factory=lambda: slice(None))  # this rank's tokens [s] (CP)
    aux: frozenset[str] = frozenset()  # auxiliary losses to compute: "indexer", "balance"
    indexer_terms: list[torch.Tensor] = field(default_factory=list)  # per CSA layer: KL summed over rows
    balance_terms: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: summed over rows
    capture: Any = None  # model.PrefillCapture, set by prefill
    replay: bool = False  # a block's forward run again in the backward (config.recompute)
    # Routing replay (RL): routed [B, S, L, k] the experts each token of the whole sequence took
    # in the rollout's engine, per learned MoE layer l = layer - num_hash_layers (-1: route as
    # this model does); routes, when a dict, collects the experts this forward chose, by l, [B, s, k].
    routed: torch.Tensor | None = None
    routes: dict[int, torch.Tensor] | None = None
    # Indexer replay (RL): picked [B, S, C, K] the compressed entries each token's query attended
    # in the rollout's engine, per CSA layer c of the main stack, as in-document block numbers
    # (-1: none); picks, when a dict, collects the entries this forward chose, by c, [B, s, K].
    picked: torch.Tensor | None = None
    picks: dict[int, torch.Tensor] | None = None
    trace: Trace | None = None  # log.trace: attention internals of chosen layers
