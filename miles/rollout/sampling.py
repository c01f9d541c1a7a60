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

from miles.memory import to_device

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
        """The stop strings; an empty one stops nothing (it would match before any text)."""
        return [x for x in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if x]

    def generator(self) -> torch.Generator | None:
        """The request's own random stream on the host (None for greedy requests): one uniform
        number a token, drawn on the host so the device's step needs no generator of its own."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else self.sampling_seed
        g = torch.Generator()
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed % 2 ** 63)
        return g


def uniforms(gens: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number [0, 1) per row from its request's stream (0 for greedy rows, which
    draw none): a request samples the same tokens whatever else shares its batch."""
    if all(g is None for g in gens):
        return torch.zeros(len(gens))
    return torch.stack([torch.zeros(()) if g is None else torch.rand((), generator=g) for g in gens])


def sample(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> sampled tokens [B] and their log-probs [B] under softmax(logits /
    temperature) of each row (temperature 0, greedy: 1). Row b follows params[b] (temperature,
    top_k, top_p, min_p) and inverts its cut distribution's CDF at u[b] (uniforms()). The whole
    batch at once, on the logits' device, in shapes that do not depend on the values: each row's
    result is what it would be alone."""
    logits = logits.float()
    b, v = logits.shape
    if all(p.greedy and p.temperature in (0, 1) for p in params):  # no distribution to cut or invert
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    # every row's settings in one host tensor, one copy to the device; the branches decided on
    # the host (a step waits for the device once, for its tokens)
    ks = [p.top_k if 0 < p.top_k < v else v for p in params]
    rows = torch.tensor([[p.temperature or 1.0, k, p.top_p, p.min_p, float(p.greedy)]
                         for p, k in zip(params, ks, strict=True)], dtype=torch.float64)
    rows = to_device(torch.cat((rows, u.double()[:, None]), 1).float(), logits.device)  # [B, 6], no wait for the queue
    temps, top_k, top_p, min_p, greedy, u = rows.unbind(1)
    top_k = top_k.long()
    scaled = logits if all(p.temperature in (0, 1) for p in params) else logits / temps[:, None]
    logp = torch.log_softmax(scaled, -1)
    if min(ks) < v:  # each row's k-th largest logit, and everything below it out
        kth = torch.topk(scaled, max(k for k in ks if k < v), dim=-1).values  # [B, kmax]
        kth = kth.gather(-1, (top_k.clamp_max(kth.shape[1]) - 1)[:, None])  # [B, 1]
        scaled = torch.where((top_k < v)[:, None], scaled.masked_fill(scaled < kth, float("-inf")), scaled)
    probs = torch.softmax(scaled, -1)  # [B, V]
    if any(p.top_p < 1 for p in params):  # the smallest prefix of the sorted probabilities that reaches top_p
        sp, order = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p[:, None]
        cut = probs.scatter(-1, order, sp.masked_fill(drop, 0.0))
        probs = torch.where((top_p < 1)[:, None], cut, probs)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    cdf = probs.cumsum(-1)  # [B, V]
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    tokens = torch.where(greedy.bool(), logits.argmax(-1), drawn.clamp_max(v - 1))
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
