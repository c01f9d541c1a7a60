"""Bundled synthetic data: arithmetic progressions over the vocabulary.

Each sequence is a, a+k, a+2k, ... (mod span) offset past the special ids, with a and k
drawn per sequence. A model must read k from context to predict the next token, so the
loss falls quickly from log(vocab) toward zero: a visible end-to-end training signal
that needs no download. The first two targets are not trained (k is unknowable before two
tokens).
"""

from __future__ import annotations

import torch

from miles.data.sample import Sample

FIRST_ID = 2  # 0 = bos, 1 = eos
PROMPT, CONTINUATION = 12, 12  # evaluation: tokens given, tokens generated


def progressions(n: int, seq_len: int, vocab: int, seed: int, max_step: int = 7) -> torch.Tensor:
    """[n, seq_len] int64 sequences, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    span = vocab - FIRST_ID
    start = torch.randint(0, span, (n, 1), generator=g)
    step = torch.randint(1, max_step + 1, (n, 1), generator=g)
    return FIRST_ID + (start + step * torch.arange(seq_len)) % span


class SyntheticSource:
    """Global batches of progressions, a pure function of (seed, step): a resumed run sees
    the batches the uninterrupted run would have seen."""

    name = "synthetic"

    def __init__(self, seq_len: int, vocab: int, seed: int):
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed

    def batch(self, step: int, n: int) -> list[Sample]:
        """The `n` sequences of optimizer step `step` (1-indexed), each seq_len + 1 tokens (so
        seq_len positions have a target)."""
        ids = progressions(n, self.seq_len + 1, self.vocab, seed=self.seed * 100_003 + step)
        mask = [0, 0, 0] + [1] * (self.seq_len - 2)
        return [Sample(row, mask) for row in ids.tolist()]

    def state(self) -> dict:
        return {"source": self.name}  # batch(step) is a pure function of the step

    def load_state(self, state: dict) -> None:
        if state.get("source") != self.name:
            raise ValueError(f"the checkpoint's data position is for source {state.get('source')!r}, this job's "
                             f"is {self.name!r}")

    def metrics(self) -> dict[str, float]:
        return {}

    def eval_samples(self) -> list[Sample]:
        return []  # evaluated by generation after the last step instead (evaluate)

    def close(self) -> None:
        pass

    @torch.no_grad()
    def evaluate(self, model, n: int) -> dict[str, float]:
        """`n` held-out progressions (a seed no training step uses): `accuracy`, the share of
        greedily generated tokens (incremental decoding) that continue the progression
        correctly, and `nll`, the mean negative log-likelihood of the true continuation."""
        ids = progressions(n, PROMPT + CONTINUATION, self.vocab, seed=-1 - self.seed)
        logp = torch.log_softmax(model.eval()(ids[:, :-1]).logits[:, PROMPT - 1:], -1)  # [n, CONTINUATION, V]
        nll = -logp.gather(-1, ids[:, PROMPT:, None]).mean().item()
        cache, slots = model.new_cache(n, PROMPT + CONTINUATION, ids.device), torch.arange(n)
        tok = model.prefill(list(ids[:, :PROMPT]), cache, slots.tolist()).argmax(-1)
        out = [tok]
        for _ in range(CONTINUATION - 1):
            tok = model.decode(tok, cache, slots).argmax(-1)
            out.append(tok)
        acc = (torch.stack(out, 1) == ids[:, PROMPT:]).float().mean().item()
        return {f"eval/{self.name}/accuracy": acc, f"eval/{self.name}/nll": nll}
