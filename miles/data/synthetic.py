"""Bundled synthetic data: arithmetic progressions over the vocabulary.

Each sequence is a, a+k, a+2k, ... (mod span) offset past the special ids, with a and k
drawn per sequence. A model must read k from context to predict the next token, so the
loss falls quickly from log(vocab) toward zero: a visible end-to-end training signal
that needs no download.
"""

from __future__ import annotations

import torch

FIRST_ID = 2  # 0 = bos, 1 = eos


def progressions(n: int, seq_len: int, vocab: int, seed: int, max_step: int = 7) -> torch.Tensor:
    """[n, seq_len] int64 sequences, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    span = vocab - FIRST_ID
    start = torch.randint(0, span, (n, 1), generator=g)
    step = torch.randint(1, max_step + 1, (n, 1), generator=g)
    return FIRST_ID + (start + step * torch.arange(seq_len)) % span
