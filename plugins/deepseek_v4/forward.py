"""Per-forward facts every layer reads: the sequence layout, the rotary tables of each kind,
this rank's query tokens, and the auxiliary-loss terms the layers append."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops
from .layout import SequenceLayout


@dataclass
class Rope:
    """cos/sin [B, S, rd/2] at token positions for one rotation kind, plus its inv_freq."""

    inv_freq: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope_cos_sin(positions, self.inv_freq)


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
