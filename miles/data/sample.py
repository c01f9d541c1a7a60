"""A training sample: what every data source produces and the batching turns into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One sequence. `loss_mask[t]` is 1 when the model is trained to produce `tokens[t]` (from
    the tokens before it) and 0 when it only reads it (a prompt, a system turn); `loss_mask[0]`
    is always 0 (nothing comes before the first token)."""

    tokens: list[int]
    loss_mask: list[int]
    origin: str | None = field(default=None, compare=False)  # where it came from: "file:row", "file:row#k"
    # Per-token values for policy losses, by MicroBatch field name (advantages, rollout_logprobs,
    # token_weights, ...), each aligned with `tokens` (0 where loss_mask is 0).
    values: dict[str, list[float]] = field(default_factory=dict, compare=False)
    # Routing replay: the experts each token took when the engine read it, [T, L, k] (L learned
    # MoE layers, top-k), -1 for a token the engine never read (the last one it generated).
    routes: Any = field(default=None, compare=False)
    # Indexer replay: the compressed entries each token's query attended in the engine, [T, C, K]
    # (C CSA layers, index_topk in-document block numbers, -1 = none or never read).
    picks: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.loss_mask):
            raise ValueError(f"sample: {len(self.tokens)} tokens but {len(self.loss_mask)} loss-mask entries")
        if len(self.tokens) < 2:
            raise ValueError("sample: needs at least 2 tokens (one input, one target)")
        for k, v in self.values.items():
            if len(v) != len(self.tokens):
                raise ValueError(f"sample: {len(self.tokens)} tokens but {len(v)} values of {k}")
        for name in ("routes", "picks"):
            if getattr(self, name) is not None and len(getattr(self, name)) != len(self.tokens):
                raise ValueError(f"sample: {len(self.tokens)} tokens but {name} for {len(getattr(self, name))}")
        if self.loss_mask[0]:
            raise ValueError("sample: the first token cannot be trained (nothing precedes it)")
