"""DAPO dynamic sampling: keep only groups whose rewards differ, generate until enough."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DynamicSamplingError(RuntimeError):
    """Too few informative groups after the allowed generation rounds."""


def informative(rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """rewards [num_groups, group_size] -> keep [num_groups] (rewards not all equal) and the
    drop counts: drop_all_correct (all equal and > 0), drop_all_wrong (all equal and <= 0)."""
    same = (rewards == rewards[:, :1]).all(1)
    correct = same & (rewards[:, 0] > 0)
    return ~same, {"drop_all_correct": int(correct.sum()), "drop_all_wrong": int((same & ~correct).sum())}


def dynamic_filter(generate_round: Callable[[int], list[tuple[object, torch.Tensor]]], need: int,
                   max_rounds: int) -> tuple[list, dict[str, int]]:
    """Call generate_round(round) -> [(group, rewards [group_size])] until `need` informative
    groups are collected (extra ones of the last round are dropped, counted as surplus).
    Raises DynamicSamplingError after max_rounds rounds without enough."""
    kept: list = []
    counts = {"drop_all_correct": 0, "drop_all_wrong": 0, "rounds": 0, "surplus": 0}
    for rnd in range(max_rounds):
        groups = generate_round(rnd)
        counts["rounds"] += 1
        if not groups:
            continue
        keep, drops = informative(torch.stack([r for _, r in groups]))
        for k in drops:
            counts[k] += drops[k]
        kept += [g for (g, _), k in zip(groups, keep.tolist(), strict=True) if k]
        if len(kept) >= need:
            counts["surplus"] = len(kept) - need
            return kept[:need], counts
    raise DynamicSamplingError(f"dynamic sampling: {len(kept)} of {need} groups with differing rewards after "
                               f"{max_rounds} rounds (dropped {counts['drop_all_correct']} all-correct, "
                               f"{counts['drop_all_wrong']} all-wrong); raise max_rounds or the over-sampling")
