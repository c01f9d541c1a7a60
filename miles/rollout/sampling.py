"""Sampling parameters (SGLang's names) and token sampling with a generator per request.

Each request draws from its own torch.Generator, so a seeded request samples the same
tokens whatever else shares its batch. Log-probs are those of the distribution sampled from
at its temperature, log_softmax(logits / temperature), before top-k / top-p / min-p cut it (as
SGLang reports them; greedy requests: temperature 1): what an RL trainer computes at the same
temperature.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

Float = Annotated[float, Field(allow_inf_nan=False, strict=False)]


class SamplingParams(BaseModel):
    """`sampling_params` of POST /generate. Unknown keys are errors (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid")
    temperature: Annotated[Float, Field(ge=0)] = 1.0  # 0: greedy
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: StrictInt = -1  # -1: all tokens
    min_p: Annotated[Float, Field(ge=0, le=1)] = 0.0
    max_new_tokens: Annotated[StrictInt, Field(ge=0)] = 128
    min_new_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    seed: StrictInt | None = None  # same seed, same tokens
    sampling_seed: StrictInt | None = None  # SGLang's name for `seed`
    n: Literal[1] = 1  # several samples: send the prompt several times (its prefill is shared)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (all tokens) or >= 1")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (None for greedy requests)."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else self.sampling_seed
        g = torch.Generator(device=device)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed % 2 ** 63)
        return g


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> sampled tokens [B] and their log-probs [B] under softmax(logits /
    temperature) of each row (temperature 0, greedy: 1). Row b follows params[b]
    (temperature, top_k, top_p, min_p) and draws one uniform number from gens[b]."""
    logits = logits.float()
    temps = [p.temperature or 1.0 for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / logits.new_tensor(temps)[:, None]
    logp = torch.log_softmax(scaled, -1)
    tokens = logits.argmax(-1)
    for b, (p, g) in enumerate(zip(params, gens, strict=True)):
        if p.greedy:
            continue
        row = scaled[b]
        if p.top_k > 0 and p.top_k < row.numel():
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, -1)
        if p.top_p < 1:
            sp, order = probs.sort(descending=True)
            drop = sp.cumsum(0) - sp > p.top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(0, order, sp.masked_fill(drop, 0.0))
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        cdf = probs.cumsum(0)
        u = torch.rand((), generator=g, device=cdf.device) * cdf[-1]
        tokens[b] = torch.searchsorted(cdf, u[None], right=True).clamp_max(cdf.numel() - 1)[0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
