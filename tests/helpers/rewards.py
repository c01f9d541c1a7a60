"""Reward functions for tests (algo.reward=tests.helpers.rewards:NAME): a response "slow" takes
longer than any test's timeout, anything else scores its length."""

from __future__ import annotations

import asyncio
import time


def slow(response: str, label: str, prompt: list) -> float:
    if response == "slow":
        time.sleep(60)
    return float(len(response))


async def slow_async(response: str, label: str, prompt: list) -> float:
    if response == "slow":
        await asyncio.sleep(60)
    return float(len(response))


def broken(response: str, label: str, prompt: list) -> float:
    raise KeyError("no such key")
