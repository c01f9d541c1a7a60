"""Rewards: DAPO's `Answer:` verifier, math-verify's equivalence, a user's function or a reward
server, and overlong shaping.

`Rewards` scores a rollout's responses: a reward server through `reward_url` (HTTP, retried),
async functions in the rollout's event loop, and sync functions (math-verify's included) in a
pool of worker processes. math-verify bounds its parsing and comparison with signal.alarm,
which runs in a process's main thread only; a process can also be killed when a call runs
past `timeout`, which a thread cannot. DAPO's verifier (a regular expression) runs inline.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"Answer:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def overlong_penalty(length, max_len: int, cache_len: int):
    """DAPO's soft overlong punishment added to the reward: 0 up to max_len - cache_len, then
    falling linearly to -1 at max_len, -1 beyond. length: an int or a tensor of them."""
    import torch  # not at module level: reward worker processes import this module

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


def math_reward(response: str, label: str) -> float:
    """+1 if the response's final answer (its last `Answer:`, else the whole response) is
    mathematically equal to the label by math-verify (LaTeX, fractions, sets, ...), else -1."""
    from math_verify import parse, verify

    got = extract_answer(response)
    gold, pred = parse(f"${label}$" if "$" not in label else label), parse(got if got is not None else response)
    return 1.0 if gold and pred and verify(gold, pred) else -1.0


BUILTIN = {"dapo": dapo_reward, "math": math_reward}


def load_reward(spec: str):
    """algo.reward: "dapo", "math", or "module:function" taking (response, label, prompt) ->
    float, plain or async."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    from miles.user_code import load_function

    return load_function(spec, "algo.reward")


def _call(spec: str, item: dict) -> float:
    """One reward in a worker process (its main thread): the function `spec` names, loaded once
    per process."""
    fn = _loaded.get(spec) or _loaded.setdefault(spec, load_reward(spec))
    args = (item["response"], item["label"]) + (() if spec in BUILTIN else (item["prompt"],))
    return float(fn(*args))


_loaded: dict = {}


async def _remote(client, url: str, item: dict, timeout: float, attempts: int = 3) -> float:
    import asyncio

    import aiohttp

    last = ""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(0.5 * 2 ** attempt)
        try:
            async with client.post(url, json=item, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status == 200:
                    return float((await r.json(content_type=None))["reward"])
                last = f"HTTP {r.status}: {(await r.text(errors='replace'))[:200]}"
                if 400 <= r.status < 500 and r.status not in (408, 429):
                    break
        except TimeoutError:
            last = f"timed out after {timeout:.0f} s"
        except (aiohttp.ClientError, KeyError, TypeError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
    raise RuntimeError(f"reward server {url}: {last}")


def where(e: BaseException) -> str:
    """' at FILE:LINE in FUNCTION' of the innermost frame of an exception that the user's code
    raised, here or in a worker process (pebble hands its traceback over as text); '' if
    unknown."""
    import re
    import traceback

    remote = e.__cause__ if type(e.__cause__).__name__ == "RemoteTraceback" else None
    if remote is not None:
        found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(remote))
        return f" at {found[-1][0]}:{found[-1][1]} in {found[-1][2]}" if found else ""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


class RewardError(RuntimeError):
    """A reward function failed on a response (the message names the function and the response)."""


class Rewards:
    """Scores items {"response", "label", "prompt"} with the job's reward: `url` (POSTed each
    item, answering {"reward": r}; 3 tries each), else the function `spec`. Every call gets
    `timeout` seconds and at most `concurrency` run at once; a local call that times out scores
    `timeout_score` and is counted (`timeouts`; a remote one is retried, then fails the rollout:
    a server that does not answer is no answer about the response). Sync functions run in
    min(concurrency, CPUs) worker processes, started at the first call; close() stops them."""

    def __init__(self, spec: str = "dapo", url: str | None = None, timeout: float = 30.0, concurrency: int = 64,
                 timeout_score: float = -1.0):
        import inspect

        self.spec, self.url, self.timeout, self.concurrency = spec, url, timeout, concurrency
        self.timeout_score = timeout_score
        self.fn = None if url else load_reward(spec)  # errors name the field before anything starts
        self.is_async = self.fn is not None and inspect.iscoroutinefunction(self.fn)
        self.inline = spec == "dapo" and not url  # a regular expression: no process needed
        self.timeouts = 0  # local calls that ran past the timeout, over the object's life
        self._pool = None

    @classmethod
    def of(cls, algo) -> Rewards:
        """The job's rewards (its `algo` section)."""
        return cls(algo.reward, algo.reward_url, algo.reward_timeout, algo.reward_concurrency,
                   algo.reward_timeout_score)

    def __call__(self, items: list[dict]) -> list[float]:
        import asyncio

        if self.inline:
            return [dapo_reward(x["response"], x["label"]) for x in items]
        return asyncio.run(self._all(items))

    async def _all(self, items: list[dict]) -> list[float]:
        import asyncio
        import contextlib

        import aiohttp

        sem = asyncio.Semaphore(self.concurrency)
        # aiohttp, as the rollout manager's client (httpx's pool is quadratic in connections);
        # trust_env: HTTP(S)_PROXY / NO_PROXY apply
        async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency), trust_env=True)
                    if self.url else contextlib.nullcontext()) as client:
            async def one(item: dict) -> float:
                async with sem:
                    if self.url:
                        return await _remote(client, self.url, item, self.timeout)
                    return await self._local(item)
            return list(await asyncio.gather(*(one(i) for i in items)))

    async def _local(self, item: dict) -> float:
        import asyncio

        try:
            if self.is_async:
                args = (item["response"], item["label"], item["prompt"])
                return float(await asyncio.wait_for(self.fn(*args), self.timeout))
            return await asyncio.wrap_future(self._workers().schedule(_call, (self.spec, item),
                                                                      timeout=self.timeout))
        except TimeoutError:
            self.timeouts += 1
            return self.timeout_score
        except Exception as e:
            text = item["response"] if len(item["response"]) <= 200 else item["response"][:200] + "..."
            raise RewardError(f"algo.reward {self.spec!r} failed on the response {text!r} (label "
                              f"{item['label']!r}): {type(e).__name__}: {e}{where(e)}") from None

    def _workers(self):
        """The worker processes (pebble's pool: a call past its timeout has its process killed
        and replaced). Spawned, not forked: the driver runs threads (Ray's, the rollout's)."""
        if self._pool is None:
            import multiprocessing
            import os

            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=min(self.concurrency, os.cpu_count() or 1),
                                     context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None


def score(items: list[dict], spec: str = "dapo", url: str | None = None, timeout: float = 30.0,
          concurrency: int = 64) -> list[float]:
    """Rewards of items {"response", "label", "prompt"} in one go (see Rewards)."""
    rewards = Rewards(spec, url, timeout, concurrency)
    try:
        return rewards(items)
    finally:
        rewards.close()
