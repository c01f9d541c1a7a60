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


def score(items: list[dict], spec: str = "dapo", url: str | None = None, timeout: float = 30.0,
          concurrency: int = 64) -> list[float]:
    """Rewards of items {"response", "label", "prompt"}: through `url` (POSTed each item,
    answering {"reward": r}; timeouts and 3 tries) or the reward function `spec`. The HTTP
    client is aiohttp, as the rollout manager's (httpx's pool is quadratic in connections);
    trust_env: HTTP(S)_PROXY / NO_PROXY apply, as they did with httpx."""
    import asyncio
    import contextlib
    import inspect

    fn = None if url else load_reward(spec)

    async def run() -> list[float]:
        import aiohttp

        sem = asyncio.Semaphore(concurrency)
        async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), trust_env=True) if url
                    else contextlib.nullcontext()) as client:
            async def one(item: dict) -> float:
                async with sem:
                    if url:
                        return await _remote(client, url, item, timeout)
                    args = (item["response"], item["label"]) + ((item["prompt"],) if fn not in BUILTIN.values()
                                                                  else ())
                    out = fn(*args)
                    return float(await out if inspect.isawaitable(out) else out)
            return list(await asyncio.gather(*(one(i) for i in items)))

    return asyncio.run(run())
