"""Generation through SGLang's router that loses no sample: every request with a timeout, a
failed, timed-out, aborted or wrong-weights answer generated again (up to rollout.max_attempts),
each sample's result recorded once by its id; multi-turn generate functions get the same
through their Client."""

from __future__ import annotations

import asyncio

import aiohttp

from miles.config import RolloutConfig
from miles.rollout.multiturn import Client, load_generate_fn


class RolloutError(RuntimeError):
    """A sample that could not be generated (a 4xx from the engines, or every attempt failed)."""


class RouterClient:
    def __init__(self, url: str, headers: dict, cfg: RolloutConfig, stats: dict):
        """url, headers: the router's (its key); stats: counters this client adds to
        (retries, timeouts, aborted, wrong_weights)."""
        self.url, self.headers, self.cfg, self.stats = url, headers, cfg, stats

    def generate(self, requests: list[dict], version: int | None = None, each=None) -> list:
        """requests: {"id": sample id, "input_ids" or "text", "sampling_params", ...} (the rest
        is SGLang's /generate body). Returns one result per request, in order, each the
        engine's response plus its "id" (or `each(it)`, applied as it arrives: what is kept of
        a large rollout instead of its JSON); every sample finished exactly once. An aborted
        response is generated again; with `version` (the trainer step whose weights the
        engines should serve) so is one from weights that are no trainer version up to it."""
        self._unique(requests)

        async def one(post, req: dict):
            res = {**await post({k: v for k, v in req.items() if k != "id"}, req["id"]), "id": req["id"]}
            return res if each is None else each(res)

        return asyncio.run(self._each(requests, one, version))

    def generate_transcripts(self, samples: list[dict], fn: str = "miles.rollout.multiturn:single_turn",
                             version: int | None = None) -> list:
        """Multi-turn: the generate function `fn` ("module:function") runs once per sample
        {"id", "input_ids", ...} with a client whose every request has the timeouts, retries
        and checks of `generate`. Returns the Transcripts, in order."""
        gen = load_generate_fn(fn)
        self._unique(samples)

        async def one(post, sample: dict):
            return await gen(Client(lambda body: post(body, sample["id"])), sample)

        return asyncio.run(self._each(samples, one, version))

    @staticmethod
    def _unique(items: list[dict]) -> None:
        ids = [r["id"] for r in items]
        if len(set(ids)) != len(ids):
            raise RolloutError("sample ids must be unique within one generate call")

    async def _each(self, items: list[dict], one, version: int | None = None) -> list:
        """Run `one(post, item)` for every item; results recorded once per item id. aiohttp, not
        httpx: httpx's connection pool scans every connection for every request it places
        (192 requests cost the driver 0.8 s of CPU at 256 connections; aiohttp 0.06 s)."""
        c = self.cfg
        done: dict[str, object] = {}
        sem = asyncio.Semaphore(c.concurrency)
        timeout = aiohttp.ClientTimeout(total=c.request_timeout)
        async with aiohttp.ClientSession(self.url, timeout=timeout, headers=self.headers,
                                         connector=aiohttp.TCPConnector(limit=c.concurrency)) as client:
            async def post(body: dict, sample_id: str) -> dict:
                return await self._post(client, sem, body, sample_id, version)

            async def run(item: dict) -> None:
                res = await one(post, item)
                done.setdefault(item["id"], res)  # exactly once, whatever retried underneath

            tasks = [asyncio.ensure_future(run(x)) for x in items]
            try:
                await asyncio.gather(*tasks)
            except BaseException:  # one sample failed the rollout: the others stop now, not retry
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        return [done[x["id"]] for x in items]

    async def _post(self, client: aiohttp.ClientSession, sem: asyncio.Semaphore, body: dict,
                    sample_id: str, version: int | None = None) -> dict:
        """One /generate through the router with a timeout; failures and timeouts retried
        (a 4xx other than 408/429 is the request's fault and is not), and so are answers that
        must not be trained: an aborted response (stats "aborted": cut short, not complete) and,
        with `version`, one whose weight_version is no trainer version up to it (stats
        "wrong_weights": an engine's own initial weights, say). An older trainer version is
        kept: the caller measures staleness from it."""
        c = self.cfg
        sp = body.get("sampling_params") or {}
        if "seed" in sp:  # the router forwards SGLang's name only
            sp = {k: v for k, v in sp.items() if k != "seed"} | {"sampling_seed": sp["seed"]}
            body = {**body, "sampling_params": sp}
        last = ""
        for attempt in range(c.max_attempts):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
            try:
                async with sem, client.post("/generate", json=body) as r:
                    if r.status == 200:
                        res = await r.json(content_type=None)
                        last = self._unusable(res, version)
                        if not last:
                            return res
                        continue
                    last = f"HTTP {r.status}: {(await r.text(errors='replace'))[:300]}"
            except TimeoutError:
                self.stats["timeouts"] += 1
                last = f"timed out after {c.request_timeout:.0f} s"
                continue
            except aiohttp.ClientError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if 400 <= r.status < 500 and r.status not in (408, 429):
                raise RolloutError(f"sample {sample_id}: the engine refused it: {last}")
        raise RolloutError(f"sample {sample_id}: {c.max_attempts} attempts failed, the last: {last}")

    def _unusable(self, res: dict, version: int | None) -> str:
        """Why a 200 answer cannot be used ('' when it can), counted in stats."""
        meta = res.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            self.stats["aborted"] += 1
            return f"aborted ({reason.get('message', 'no reason given')})"
        if version is not None:
            got = meta.get("weight_version")
            try:
                ok = got is not None and int(got) <= version
            except (TypeError, ValueError):
                ok = False
            if not ok:
                self.stats["wrong_weights"] += 1
                return (f"answered with weight_version {got!r}, not the trainer's weights of version {version} "
                        "(an engine that missed its weight sync)")
        return ""
