"""Rewards: DAPO's `Answer:` verifier and overlong shaping."""

from __future__ import annotations

import re

import torch

_ANSWER = re.compile(r"Answer:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def overlong_penalty(length: torch.Tensor | int, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment added to the reward: 0 up to max_len - cache_len, then
    falling linearly to -1 at max_len, -1 beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    n = torch.as_tensor(length, dtype=torch.float64)
    start = max_len - cache_len
    return torch.where(n <= start, 0.0, torch.where(n <= max_len, (start - n) / cache_len, -1.0))


def extract_answer(response: str, tail: int = 300) -> str | None:
    """The last `Answer: X` in the response's final `tail` characters (DAPO's verifier looks
    near the end), normalised: spaces, a final period, surrounding $ and thousands commas go."""
    found = _ANSWER.findall(response[-tail:])
    if not found:
        return None
    ans = found[-1].strip().rstrip(".").strip().strip("$").strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", ans)


def dapo_reward(response: str, label: str) -> float:
    """+1 if the final `Answer:` equals the label (after normalisation), else -1."""
    got = extract_answer(response)
    want = extract_answer(f"Answer: {label}")
    return 1.0 if got is not None and got == want else -1.0
