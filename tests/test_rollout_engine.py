"""The embedded engine in one process: continuous batching against one request at a time,
seeded sampling, shared prefill, stop conditions, abort, and its HTTP API under bad input."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch
from conftest import NEAR_TIE, answers_margin, assert_close, randomize, tiny_model

from miles.data.sft import tokenizer_path
from miles.rollout.engine import Engine
from miles.rollout.sampling import SamplingParams
from miles.rollout.server import HttpServer, build_app
from miles.rollout.service import EngineService, EngineSpec
from plugins.deepseek_v4 import DeepSeekV4Config

VOCAB = 320


class Collector:
    def __init__(self):
        self.results: dict[str, dict] = {}
        self.cv = threading.Condition()

    def __call__(self, r: dict) -> None:
        with self.cv:
            assert r["meta_info"]["id"] not in self.results, "a request finished twice"
            self.results[r["meta_info"]["id"]] = r
            self.cv.notify_all()

    def wait(self, n: int, timeout: float = 120) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.results) >= n, timeout), f"{len(self.results)}/{n} finished"


def _engine(seed: int, **kw) -> Engine:
    return Engine(randomize(tiny_model(seed), seed).eval(), max_len=kw.pop("max_len", 128), **kw)


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 11)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def _logprobs(r: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]])


def _run(engine: Engine, prompts, params, stagger: float = 0.0, prefix: str = "",
         together: bool = False) -> dict[str, dict]:
    """together: every request is queued before the scheduler may admit any (else it can
    wake after the first submit and admit it alone)."""
    col = Collector()
    if together:
        engine.pause()
    for i, p in enumerate(prompts):
        engine.submit(p, params[i] if isinstance(params, list) else params, col, True, rid=f"{prefix}{i}")
        if stagger:
            time.sleep(stagger * (i % 4))  # requests join a batch that is already decoding
    if together:
        engine.resume()
    col.wait(len(prompts))
    return col.results


def test_continuous_batching_equals_one_at_a_time(seed):
    """16 greedy requests of different lengths joining a running batch at different times
    (8 slots: some wait for others to leave) give each request the tokens it gets alone, and
    log-probs within 1e-5 (fp32; batch composition changes BLAS blocking, not the math).
    Seeded sampling gives the same tokens in the same mix twice, and alone. Prompts whose
    answers meet a near tie (an expert, indexer entry or greedy token within a few ulps of
    the next: conftest.answers_margin) are drawn again: there the rounding may choose."""
    engine = _engine(seed, max_running=8)
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    try:
        for draw in range(5):
            prompts = _prompts(seed + 1000 * draw, 16)
            seeded = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16,
                                     seed=seed + 1000 * draw + i, ignore_eos=True) for i in range(16)]
            alone = [_run(engine, [p], greedy, prefix=f"alone{draw}.{i}-")[f"alone{draw}.{i}-0"]
                     for i, p in enumerate(prompts)]
            a = _run(engine, prompts, seeded, stagger=0.01, prefix=f"a{draw}.")
            a = [a[f"a{draw}.{i}"] for i in range(16)]
            if min(answers_margin(engine.model, prompts, alone),
                   answers_margin(engine.model, prompts, a, greedy=False)) > NEAR_TIE:
                break
        steps = engine.counters["steps"]
        together = _run(engine, prompts, greedy, stagger=0.02)
        assert engine.counters["steps"] - steps < 16 * 24, "requests were not batched"
        for i in range(16):
            both = together[str(i)]
            assert both["output_ids"] == alone[i]["output_ids"], f"request {i}: tokens depend on the batch"
            assert_close(_logprobs(both), _logprobs(alone[i]), atol=1e-5, what=f"request {i} log-probs")
        b = _run(engine, prompts, seeded, stagger=0.01)
        for i in range(16):
            assert a[i]["output_ids"] == b[str(i)]["output_ids"], f"seeded request {i} not reproducible"
        one = _run(engine, [prompts[3]], [seeded[3]])["0"]
        assert one["output_ids"] == a[3]["output_ids"], "a seeded request depends on its batch"
        assert len({tuple(r["output_ids"]) for r in a}) > 1
    finally:
        engine.stop()


def test_a_cache_shorter_than_a_compression_block(seed):
    """max_len under the HCA ratio (16): that compressor's cache holds no entry at all, no
    block can complete, and decoding runs on (it aborted every request once: the write of
    an entry indexed a dimension of size 0), with the tokens of a cache that has room."""
    prompts = [p[:5] for p in _prompts(seed, 4)]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    runs = {}
    for max_len in (15, 128):
        engine = _engine(seed, max_running=4, max_len=max_len)
        try:
            runs[max_len] = _run(engine, prompts, greedy, together=True)
        finally:
            engine.stop()
    for i, p in enumerate(prompts):
        short, roomy = runs[15][str(i)], runs[128][str(i)]
        assert short["meta_info"]["finish_reason"]["type"] == "length", short["meta_info"]["finish_reason"]
        assert len(p) + 8 <= 15 and short["output_ids"] == roomy["output_ids"], f"request {i}"


def test_samples_of_one_prompt_share_its_prefill(seed):
    """8 requests with one prompt: the prompt is prefilled once (prefill token counter), the
    8 greedy continuations are identical, seeded ones differ from each other."""
    engine = _engine(seed, max_running=16)
    prompt = _prompts(seed, 1)[0] + [5, 6, 7]
    try:
        res = _run(engine, [prompt] * 8, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
                   together=True)
        assert engine.counters["prefill_tokens"] == len(prompt)
        assert len({tuple(r["output_ids"]) for r in res.values()}) == 1
        res = _run(engine, [prompt] * 8, [SamplingParams(max_new_tokens=12, seed=i, ignore_eos=True)
                                          for i in range(8)], together=True)
        assert engine.counters["prefill_tokens"] == 2 * len(prompt)
        assert len({tuple(r["output_ids"]) for r in res.values()}) > 1
    finally:
        engine.stop()


def _submit_all(engine: Engine, reqs: list[tuple[str, list[int], set[str]]], col: Collector,
                params: SamplingParams) -> None:
    """reqs: (rid, prompt, the choices it asks: "routes", "picks"), queued together."""
    engine.pause()
    for rid, p, asks in reqs:
        engine.submit(p, params, col, True, rid=rid, return_routed_experts="routes" in asks,
                      return_indexer_picks="picks" in asks)
    engine.resume()


def _same(got: dict, ref: dict, what: str) -> None:
    assert got["output_ids"] == ref["output_ids"], what
    assert_close(_logprobs(got), _logprobs(ref), atol=1e-5, what=f"{what} log-probs")
    for key in ("routed_experts", "indexer_picks"):
        assert got["meta_info"].get(key) == ref["meta_info"].get(key), f"{what}: {key}"


def test_long_prompts_prefilled_in_chunks_between_decode_steps(seed):
    """With a prefill budget of 9 tokens an iteration, prompts of 90 and 61 tokens go in over
    many iterations (model.extend), a running request decodes a step between chunks, and every
    request gets the tokens, log-probs (1e-5) and replay choices it asked for (routed experts,
    indexer entries, each asked by some requests) that it gets from a whole prefill. Requests of
    a prompt share its chunks, also one queued behind another prompt (each prompt prefilled once).
    Prompts whose whole-prefill answers meet a near tie are drawn again (conftest.answers_margin)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    whole = _engine(seed, max_running=8)
    chunked = _engine(seed, max_running=8, prefill_tokens=9)
    try:
        for draw in range(5):
            g = torch.Generator().manual_seed(seed + 5 + 1000 * draw)
            long = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (90, 61)]
            short = torch.randint(2, VOCAB, (5,), generator=g).tolist()  # 5 tokens always (the count below)
            reqs = [("1", long[0], {"routes"}), ("2", long[1], set()), ("3", long[1], {"routes", "picks"}),
                    ("4", long[0], {"picks"})]
            want = Collector()
            _submit_all(whole, reqs, want, greedy)
            want.wait(4)
            if answers_margin(whole.model, long, [want.results["1"], want.results["2"]]) > NEAR_TIE:
                break
        seen = []  # tokens the short request had at each chunk
        extend = chunked.model.extend

        def watch(*a, **k):
            seen.append(sum(len(s.out) for s in chunked.running if s.prompt == short))
            return extend(*a, **k)

        chunked.model.extend = watch
        col = Collector()
        chunked.submit(short, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True), col, True, rid="s")
        while not chunked.running:
            time.sleep(0.001)
        _submit_all(chunked, reqs, col, greedy)
        col.wait(5)
        assert len(seen) >= 12 and max(seen) >= seen[0] + 12, f"no decode steps between chunks: {seen}"
        for rid, _, asks in reqs:
            _same(col.results[rid], want.results[rid], f"request {rid}")
            assert {k for k in ("routed_experts", "indexer_picks") if k in col.results[rid]["meta_info"]} == \
                {{"routes": "routed_experts", "picks": "indexer_picks"}[a] for a in asks}, rid
        assert chunked.counters["prefill_tokens"] == 5 + 90 + 61, "a prompt was prefilled twice"
    finally:
        whole.stop()
        chunked.stop()


def test_a_chunked_prefill_survives_aborts_weight_swaps_and_late_requests(seed):
    """A prompt's first request aborted mid-prefill finishes at once and hands its slot to the
    next request of the prompt, which ends as it does from a whole prefill; a request that asks
    for the experts after the prompt's first chunks went in without them is prefilled on its own
    (its experts cover every prompt token); weights swapped between two chunks restart the
    prompt, which then decodes as an engine started from the new weights. Every slot comes back.
    A prompt whose whole-prefill answers meet a near tie is drawn again (conftest.answers_margin)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    chunked = _engine(seed, max_running=6, prefill_tokens=8)
    new = randomize(tiny_model(seed + 1), seed + 1).state_dict()
    other = Engine(randomize(tiny_model(seed + 1), seed + 1).eval(), max_len=128, max_running=2)
    whole = _engine(seed, max_running=4)
    extend, calls = chunked.model.extend, []
    try:
        for draw in range(5):
            g = torch.Generator().manual_seed(seed + 5 + 1000 * draw)
            prompt = torch.randint(2, VOCAB, (60,), generator=g).tolist()
            want, want_new = Collector(), Collector()
            _submit_all(whole, [("a", prompt, set()), ("late", prompt, {"routes"})], want, greedy)
            _submit_all(other, [("n", prompt, set())], want_new, greedy)
            want.wait(2)
            want_new.wait(1)
            if min(answers_margin(whole.model, [prompt], [want.results["a"]]),
                   answers_margin(other.model, [prompt], [want_new.results["n"]])) > NEAR_TIE:
                break

        def hooked(*a, **k):
            calls.append(sum(r.startswith("x0") for r in col.results))  # x0 finished before this chunk?
            if len(calls) == 1:
                chunked.abort("x0")
            if len(calls) == 2:  # queued now: the prompt's first chunks recorded no experts
                chunked.submit(prompt, greedy, col, True, rid="late", return_routed_experts=True)
            return extend(*a, **k)

        chunked.model.extend = hooked
        col = Collector()
        _submit_all(chunked, [(f"x{i}", prompt, set()) for i in range(3)], col, greedy)
        col.wait(4)
        assert col.results["x0"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 1 in calls[:3], f"the aborted first request waited for the prompt's prefill: {calls}"
        for rid in ("x1", "x2"):
            _same(col.results[rid], want.results["a"], f"{rid} after the abort")
        _same(col.results["late"], want.results["late"], "the late request")

        paused = threading.Event()

        def pause_midway(*a, **k):
            if not paused.is_set():  # no iteration after this one until resumed: the swap falls between chunks
                chunked.pause()
                paused.set()
            return extend(*a, **k)

        chunked.model.extend = pause_midway
        col = Collector()
        chunked.submit(prompt, greedy, col, True, rid="w0")
        assert paused.wait(60)
        chunked.run_exclusive(lambda: chunked.model.load_state_dict(new))
        assert chunked.stats()["prefilling"] == 1, "the swap did not fall inside the prompt's prefill"
        chunked.resume()
        col.wait(1)
        _same(col.results["w0"], want_new.results["n"], "the prompt prefilled across a weight swap")
        assert chunked.stats()["free_slots"] == 6 and chunked.stats()["prefilling"] == 0
    finally:
        for e in (chunked, other, whole):
            e.stop()


def test_requests_stopping_mid_batch_leave_the_others_and_the_counts_exact(seed):
    """The scheduler reads a step's tokens while the next step runs, so a request that stops
    runs one step more, whose token is dropped. Requests stopping at different steps, one of
    them at the engine's last position (prompt + max_new_tokens = max_len: its extra step
    writes position max_len - 1), one by a stop token, get the tokens they get alone; the
    engine counts only the tokens it returned; an idle engine holds no step unread. Prompts
    whose answers alone meet a near tie are drawn again (conftest.answers_margin)."""
    engine = _engine(seed, max_running=4, max_len=40)
    greedy = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (10, 10, 3, 7)]
    try:
        for draw in range(5):
            short = [p[:20] for p in _prompts(seed + 1000 * draw, 3)]
            full = (_prompts(seed + 1000 * draw + 1, 1)[0] * 40)[:30]
            prompts = [short[0], full, short[1], short[2]]
            alone = [_run(engine, [p], g, prefix=f"a{draw}.{i}-")[f"a{draw}.{i}-0"]
                     for i, (p, g) in enumerate(zip(prompts, greedy, strict=True))]
            if answers_margin(engine.model, prompts, alone) > NEAR_TIE:
                break
        stop_at = alone[0]["output_ids"][3]
        first = alone[0]["output_ids"].index(stop_at)
        params = [SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop_at])] + greedy[1:]
        before = engine.counters["generated_tokens"]
        got = _run(engine, prompts, params, together=True)
        assert got["0"]["output_ids"] == alone[0]["output_ids"][: first + 1]
        assert got["0"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
        assert got["1"]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        for i in (1, 2, 3):
            assert got[str(i)]["output_ids"] == alone[i]["output_ids"], f"request {i}"
            assert_close(_logprobs(got[str(i)]), _logprobs(alone[i]), atol=1e-5, what=f"request {i} log-probs")
        produced = sum(len(r["output_ids"]) for r in got.values())
        assert engine.counters["generated_tokens"] - before == produced, "dropped rows were counted"
        deadline = time.monotonic() + 10  # the scheduler reads it once it finds itself idle
        while engine._pending is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._pending is None, "an idle engine holds a step it has not read"
    finally:
        engine.stop()


def test_stop_conditions_and_abort(seed):
    """max_new_tokens, stop_token_ids (the matched id reported, kept in output_ids), EOS unless
    ignore_eos, abort of a running request (finish_reason abort, its slot reused)."""
    engine = _engine(seed, max_running=2, max_len=512)
    p = _prompts(seed, 1)[0]
    try:
        free = _run(engine, [p], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))["0"]
        assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        stop_at = free["output_ids"][4]
        first = free["output_ids"].index(stop_at)
        r = _run(engine, [p], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop_at]))["0"]
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
        assert r["output_ids"] == free["output_ids"][: first + 1]
        engine.eos_ids = frozenset({stop_at})
        assert _run(engine, [p], SamplingParams(temperature=0, max_new_tokens=10))["0"]["output_ids"] == \
            free["output_ids"][: first + 1]
        engine.eos_ids = frozenset()
        col = Collector()
        engine.submit(p, SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True), col, rid="long")
        time.sleep(0.3)
        assert engine.abort("long") == 1
        col.wait(1)
        assert col.results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(col.results["long"]["output_ids"]) < 400
        assert engine.stats()["free_slots"] == 2
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def server():
    svc = EngineService(EngineSpec(config=DeepSeekV4Config.tiny(vocab_size=512).to_dict(), seed=3, max_running=4,
                                   max_len=96, tokenizer=tokenizer_path("tiny")))
    http = HttpServer(build_app(svc))
    yield svc, httpx.Client(base_url=http.url, timeout=60)
    http.stop()
    svc.stop()


BAD = {
    "garbage JSON": b"{garbage",
    "not an object": b"[1, 2]",
    "negative max_new_tokens": b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}',
    "unknown field": b'{"input_ids": [1, 2], "temprature": 0.5}',
    "unknown sampling field": b'{"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}',
    "id outside the vocabulary": b'{"input_ids": [1, 512]}',
    "negative id": b'{"input_ids": [-1]}',
    "too long": b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 94}}',
    "empty input": b'{"input_ids": []}',
    "text and ids": b'{"input_ids": [1], "text": "a"}',
    "string ids": b'{"input_ids": "abc"}',
    "bad temperature": b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}',
    "top_p 0": b'{"input_ids": [1], "sampling_params": {"top_p": 0}}',
    "top_k 0": b'{"input_ids": [1], "sampling_params": {"top_k": 0}}',
    "NaN temperature": b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
    "streaming": b'{"input_ids": [1], "stream": true}',
    "rid list of the wrong length": b'{"input_ids": [[1], [2]], "rid": ["a"]}',
}


def test_bad_requests_get_4xx_and_the_engine_keeps_serving(server):
    svc, client = server
    good = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    want = client.post("/generate", json=good).json()["output_ids"]
    for what, body in BAD.items():
        r = client.post("/generate", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, f"{what}: HTTP {r.status_code} {r.text[:200]}"
        assert r.json()["error"]["message"], what
        assert client.post("/generate", json=good).json()["output_ids"] == want, f"engine broken after {what}"
    for path, body in (("/abort_request", b"{}"), ("/update_weights_from_disk", b'{"model_path": "/nonexistent"}'),
                       ("/update_weights_from_tensor", b'{"serialized_named_tensors": ["@@"]}')):
        r = client.post(path, content=body)
        assert 400 <= r.status_code < 500, f"{path}: HTTP {r.status_code}"
    assert svc.engine.weight_version == 0
    assert client.get("/health").status_code == 200


def test_an_idle_connection_outlives_the_gap_between_rollouts(server):
    """The router reuses pooled connections to an engine after the seconds a training step
    takes; a server that closed them after uvicorn's 5 s made the router's next requests fail
    in a burst that opened its circuit breaker on the engine. One connection, two requests 6 s
    apart: the second is answered on it."""
    svc, client = server
    port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
    req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for gap in (0.0, 6.0):
            time.sleep(gap)
            s.sendall(req)
            head = _http_response(s)
            assert head.startswith(b"HTTP/1.1 200"), f"after {gap:.0f} s idle: {head[:80]!r}"


def _http_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response from s (its head, then Content-Length bytes of body), so
    the next read starts at the next response; b"" where the server closed the connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return buf
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    length = next((int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                   if k.strip().lower() == b"content-length"), 0)
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return head


def test_http_api_serves_sglang_shapes(server):
    """Text in and out with the tokenizer, batches, output_token_logprobs as [logprob, id,
    None], the info endpoints the router reads."""
    svc, client = server
    r = client.post("/generate", json={"text": ["hello", "a b c"], "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 5, "seed": 1}}).json()
    assert len(r) == 2 and all(len(x["output_ids"]) == len(x["meta_info"]["output_token_logprobs"]) for x in r)
    lp = r[0]["meta_info"]["output_token_logprobs"]
    assert all(x[1] == t and x[0] <= 0 and x[2] is None for x, t in zip(lp, r[0]["output_ids"], strict=True))
    assert "routed_experts" not in r[0]["meta_info"]
    from miles.rollout.engine import decode_choices

    cfg = svc.model.config
    ids = [5, 6, 7, 8]
    x = client.post("/generate", json={"input_ids": ids, "return_routed_experts": True,
                                       "sampling_params": {"max_new_tokens": 3, "seed": 1}}).json()
    routes = decode_choices(x["meta_info"]["routed_experts"], cfg.num_hidden_layers - cfg.num_hash_layers,
                           cfg.num_experts_per_tok)  # every token the model read: the prompt and 2 of the 3
    assert routes.shape[0] == len(ids) + len(x["output_ids"]) - 1 and (routes >= 0).all()
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        assert client.get(path).json()["vocab_size"] == 512
    assert client.get("/health_generate").status_code == 200


def _stop_piece(tok, out: list[int]) -> tuple[str, int]:
    """A stop string the greedy continuation `out` hits mid-way: the text of its first whole,
    non-special token (after the first) that appends cleanly to the text before it and is not
    already in it; and after how many tokens of `out` it is hit."""
    for k in range(1, len(out) - 1):
        head, piece = tok.decode(out[:k], skip_special_tokens=False), tok.decode([out[k]])
        if piece and "\ufffd" not in piece and piece not in head and \
                tok.decode(out[: k + 1], skip_special_tokens=False) == head + piece:
            return piece, k + 1
    raise AssertionError(f"no token of {out} decodes to a clean new piece of text: pick another prompt")


def test_stop_strings_end_generation_and_are_trimmed(server):
    """A stop string ends a request at the token that completes it (a check that never looked
    at the text ran on to max_new_tokens), finish_reason names it, and the text ends just
    before it, or just after with no_stop_trim. The stop string is a piece of what the same
    greedy request generates without it, so it is hit whatever the model's weights."""
    svc, client = server
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    free = client.post("/generate", json={"text": "hello", "sampling_params": sp}).json()
    out = free["output_ids"]
    assert len(out) == 12
    stop, n = _stop_piece(svc.tokenizer, out)
    full = svc.tokenizer.decode(out[:n])
    assert full.endswith(stop)
    for no_trim, text in ((False, full[: full.index(stop)]), (True, full)):
        got = client.post("/generate", json={"text": "hello", "sampling_params": {
            **sp, "stop": ["\x00never", stop], "no_stop_trim": no_trim}}).json()
        assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, f"no_stop_trim={no_trim}"
        assert got["output_ids"] == out[:n], f"no_stop_trim={no_trim}: did not stop at token {n}"
        assert got["text"] == text, f"no_stop_trim={no_trim}: {got['text']!r} != {text!r}"


def _sse(r: httpx.Response) -> list[dict | str]:
    """The events of a server-sent stream: each `data:` payload as JSON ([DONE] as the string)."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()[:300]
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        else:
            assert line == "", line
    return out


def test_a_streamed_chat_adds_up_to_the_unstreamed_one(server):
    """stream: true gives OpenAI's chunks (the role first, the finish reason last, the usage
    when asked, then [DONE]) whose content joined is the unstreamed answer of the same greedy
    request, also when a stop string cuts it (a tail held back until it is known not to begin
    the stop)."""
    from miles.data.chat import load_tokenizer
    from miles.data.prompts import prompt_ids

    svc, client = server
    tok = svc.tokenizer
    chat = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=chat).json()
    # the same completion's tokens: a stop string of 3 characters across two of them (its first
    # character ends a token), first met there, so a stream must hold that character back
    ids = prompt_ids(chat["messages"], load_tokenizer(svc.spec.tokenizer))
    out = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 16}}).json()["output_ids"]
    text = tok.decode(out)
    assert text.strip() == whole["choices"][0]["message"]["content"]
    heads = [tok.decode(out[:k]) for k in range(1, len(out))]
    stop = next((text[len(h) - 1: len(h) + 2] for h in heads if text.startswith(h) and "\ufffd" not in h
                 and len(text) >= len(h) + 2 and text.find(text[len(h) - 1: len(h) + 2]) == len(h) - 1), None)
    assert stop, f"no stop string across two tokens of {out}: pick another prompt"
    cut = client.post("/v1/chat/completions", json={**chat, "stop": [stop]}).json()
    answer = whole["choices"][0]["message"]["content"]
    assert cut["choices"][0]["message"]["content"] == answer[:answer.index(stop)].strip()
    _stream_matches(client, chat, whole, pieces=3)
    _stream_matches(client, {**chat, "stop": [stop]}, cut)


def _stream_matches(client: httpx.Client, body: dict, unstreamed: dict, pieces: int = 1) -> None:
    """`body` streamed gives OpenAI's chunks (the role first, the finish reason last, the usage
    when asked, then [DONE]) whose content and reasoning joined are `unstreamed`'s (the same
    request's answer), in at least `pieces` chunks of text."""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events[:-1])
    chunks, usage = events[:-2], events[-2]
    reason = unstreamed["choices"][0]["finish_reason"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
    for part in ("content", "reasoning_content"):
        joined = "".join(c["choices"][0]["delta"].get(part, "") for c in chunks)
        assert joined.strip() == unstreamed["choices"][0]["message"].get(part, ""), (part, joined, body)
    assert len(chunks) - 2 >= pieces, f"{len(chunks) - 2} pieces of text: not streamed"
    assert usage["choices"] == [] and usage["usage"] == unstreamed["usage"], usage


def test_a_streamed_thinking_answer_splits_as_the_unstreamed_one():
    """Thinking mode: the text before </think> is reasoning_content, streamed or not, also
    when the answer ends before any </think> (the unstreamed answer gave it as content)."""
    svc = EngineService(EngineSpec(config=DeepSeekV4Config.tiny(vocab_size=512).to_dict(), seed=3, max_running=2,
                                   max_len=512, tokenizer=tokenizer_path("tiny")))
    http = HttpServer(build_app(svc))
    try:
        client = httpx.Client(base_url=http.url, timeout=60)
        think = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0,
                 "chat_template_kwargs": {"thinking": True}}
        reasoned = client.post("/v1/chat/completions", json=think).json()
        message = reasoned["choices"][0]["message"]
        assert message["content"] == "" and message["reasoning_content"], message  # 16 tokens: no </think>
        _stream_matches(client, think, reasoned, pieces=3)
    finally:
        http.stop()
        svc.stop()


@pytest.mark.parametrize("thinking", [False, True])
def test_stream_deltas_join_to_the_final_text_at_any_cut(seed, thinking):
    """chat_stream.TextStream against random texts decoded a few bytes at a time (a partial
    UTF-8 character shows as U+FFFD, as the decoder shows it): the deltas joined are the final
    text, cut before its stop string, split at </think> into reasoning and answer in thinking
    mode, whatever the cuts. The stop string and </think> are planted across cuts."""
    import random

    from miles.rollout.chat_stream import THINK_END, TextStream

    # what may still change is held back, and nothing more
    assert TextStream(["ab"]).deltas("aaaa") == [{"content": "aaa"}]
    assert TextStream([], thinking=True).deltas("x <<</th") == [{"reasoning_content": "x <<"}]
    assert TextStream([">n"], thinking=True).deltas("b</think>") == [{"reasoning_content": "b"}]
    rng = random.Random(seed)
    alphabet = "ab </>kthiné日本😀\n"
    for _ in range(200):
        words = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        if thinking and rng.random() < 0.7:
            words.insert(rng.randint(0, len(words)), THINK_END)
        body = "".join(words)
        stop = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        tail = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        full = body + (stop + tail if rng.random() < 0.6 else "")
        stops = [stop] if rng.random() < 0.8 else []
        final = full[:full.find(stop)] if stops and stop in full else full
        raw = full.encode()
        # the engine stops at the token completing the stop string: no text after it is decoded
        end = len(full[:full.find(stop) + len(stop)].encode()) if stops and stop in full else len(raw)
        cuts = sorted(rng.sample(range(1, end), min(end - 1, rng.randint(0, 12)))) if end > 1 else []
        st, sent = TextStream(stops, thinking), {"reasoning_content": "", "content": ""}
        for c in cuts + [end]:
            for d in st.deltas(raw[:c].decode(errors="replace")):
                for k, v in d.items():
                    sent[k] += v
        for d in st.deltas(final, final=True):
            for k, v in d.items():
                sent[k] += v
        reasoning, mark, answer = final.partition(THINK_END) if thinking else ("", "", final)
        want = {"reasoning_content": reasoning, "content": answer}
        assert sent == want, (full, stops, cuts, sent, want)


@pytest.mark.parametrize("which", ["tiny", "deepseek_v4"])
def test_the_stream_decodes_each_token_once_and_as_the_whole(seed, which):
    """server.Detokenizer (a stream's text, decoding only the tokens after the last whole
    character) gives at every token the text the whole decode gives, for random ids of the
    bundled tokenizer and of DeepSeek-V4's: the tokenizers join at whole characters."""
    from tokenizers import Tokenizer

    from miles.data.chat import v4_tokenizer_file
    from miles.data.sft import tokenizer_path
    from miles.rollout.server import Detokenizer

    tok = Tokenizer.from_file(str(tokenizer_path("tiny") if which == "tiny" else v4_tokenizer_file()))
    g = torch.Generator().manual_seed(seed)
    for skip in (True, False):
        ids = torch.randint(0, tok.get_vocab_size(), (300,), generator=g).tolist()
        d = Detokenizer(tok, skip)
        for k, t in enumerate(ids, 1):
            d.add(t)
            assert d.text() == tok.decode(ids[:k], skip_special_tokens=skip), (which, skip, ids[:k])
        assert d.base > 200, "the decode went back to the start: nothing saved"


def test_a_client_leaving_a_stream_aborts_its_request(server):
    """Closing a streamed chat mid-way aborts its request in the engine (no tokens generated
    for nobody). The engine is paused once the first piece arrives, so the request is still
    running when the client leaves."""
    svc, client = server
    engine = svc.engine
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0, "stream": True}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            while '"content": ""' in (line := next(lines)) or not line.startswith("data: {"):
                pass  # until a first piece of the answer: the request is decoding
            engine.pause()
            with engine.cv:
                mine = [s for s in engine.running if s.on_token is not None]
            assert len(mine) == 1 and mine[0].aborted is None
        deadline = time.monotonic() + 30
        while mine[0].aborted is None:
            assert time.monotonic() < deadline, "the request was not aborted after its client left"
            time.sleep(0.05)
    finally:
        engine.resume()
    deadline = time.monotonic() + 30
    while mine[0].finish is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert mine[0].finish["type"] == "abort" and len(mine[0].out) < 60, (mine[0].finish, len(mine[0].out))


def test_flush_cache_leaves_generation_unchanged(server):
    """SGLang clients (the router, weight-update scripts) call /flush_cache; it must answer
    success and change nothing that generation depends on: the same greedy tokens and log-probs
    after it as before (a flush that dropped the slot cache or the weights would break them)."""
    svc, client = server
    body = {"input_ids": [7, 8, 9, 10], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            "return_logprob": True}
    before = client.post("/generate", json=body).json()
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = client.post("/generate", json=body).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_flat_buckets_round_trip_mixed_dtypes(seed):
    """A broadcast bucket packs tensors of odd byte sizes and mixed dtypes (fp32, bf16, int64
    router tables, bool) into one byte buffer; the receiver's views of a buffer laid out from
    the spec alone give back every tensor bit for bit."""
    from miles.rollout.weights import bucket_buffer, checksums, pack, spec_of, views_of

    g = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(3, 7, generator=g), "b": torch.randint(0, 9, (5, 3), generator=g),
               "c": torch.randn(11, generator=g).bfloat16(), "d": torch.rand(3, generator=g) > 0.5,
               "e": torch.randint(0, 9, (2,), generator=g)}
    flat = pack(tensors)
    recv, views = bucket_buffer(spec_of(tensors))
    recv.copy_(flat)
    assert checksums(views) == checksums(tensors)
    aliases = [(n, s, {"float32": "float", "int64": "long"}.get(d, d)) for n, s, d in spec_of(tensors)]
    assert checksums(views_of(recv, aliases)) == checksums(tensors)  # a dtype by any of torch's names


def test_staging_commits_every_dtype_and_an_empty_update(seed):
    """An update's commit copies each staged tensor into the model whatever its dtype (the
    copies go in groups of one device and dtype), and an empty update commits nothing and
    says so (it raised inside the grouped copy once)."""
    from miles.rollout.weights import Staging, update_targets

    model = tiny_model(seed)
    targets = update_targets(model)
    assert len({t.dtype for t in targets.values()}) > 1
    g = torch.Generator().manual_seed(seed)
    new = {k: (torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else
               ~v if v.dtype == torch.bool else torch.randint(0, 4, v.shape, generator=g).to(v.dtype))
           for k, v in targets.items()}
    st = Staging(model)
    st.add(new, None)
    assert st.commit(list(new)) == len(new)
    for k, v in update_targets(model).items():
        assert torch.equal(v, new[k]), k
    assert Staging(model).commit([]) == 0


def test_release_and_resume_memory_keep_weights_and_cache(server):
    """Colocation: releasing memory empties the weights' and the slot cache's storages (the
    bytes go to the host), resuming brings them back bit for bit: the same greedy tokens and
    log-probs as before. A weight update while released is refused by the released guard (an
    update that succeeds once resumed: the engine's own weights, so only the guard can refuse
    it), not half-applied."""
    from miles.rollout.weights import encode_tensors

    svc, client = server
    body = {"input_ids": [4, 5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": True}
    before = client.post("/generate", json=body).json()
    own = svc.with_weights(lambda tensors, _: {k: v.detach().cpu().clone() for k, v in tensors.items()})
    update = {"serialized_named_tensors": [encode_tensors(own)]}
    version = svc.engine.weight_version
    r = client.post("/release_memory_occupation").json()
    weights = sum(p.numel() * p.element_size() for p in svc.model.parameters())
    assert r["success"] and r["freed_bytes"] > weights
    assert all(p.untyped_storage().nbytes() == 0 for p in svc.model.parameters())
    r = client.post("/update_weights_from_tensor", json=update)
    assert r.status_code == 400, f"HTTP {r.status_code} {r.text[:200]}"
    assert r.json()["message"].startswith("memory is released"), r.text[:200]
    assert svc.engine.weight_version == version
    assert client.post("/resume_memory_occupation").json()["success"]
    after = client.post("/generate", json=body).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    r = client.post("/update_weights_from_tensor", json=update)
    assert r.status_code == 200, f"HTTP {r.status_code} {r.text[:200]}"
    assert r.json()["success"] and r.json()["tensors"] == len(own) and r.json()["weight_version"] == version + 1
    again = client.post("/generate", json=body).json()
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_sampled_log_probs_are_those_of_the_tempered_distribution(seed):
    """Guards the engine reporting temperature-1 log-probs while sampling at another
    temperature (the RL trainer computes log-probs at the rollouts' temperature): each row's
    log-prob is log_softmax(logits / T) of its token, before top-k / top-p cut the
    distribution (as SGLang reports them); greedy rows (temperature 0) report temperature 1's."""
    from miles.rollout.sampling import sample, uniforms

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.7, seed=seed), SamplingParams(temperature=1.6, top_k=5, seed=seed + 1),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.8, seed=seed + 2)]
    tokens, logp = sample(logits, params, uniforms([p.generator() for p in params]))
    assert torch.isfinite(logp).all()
    temps = torch.tensor([0.7, 1.6, 1.0, 0.5])[:, None]
    want = torch.log_softmax(logits.double() / temps, -1).gather(-1, tokens[:, None])[:, 0]
    assert_close(logp, want.float(), atol=1e-6, what="tempered log-probs")
    assert tokens[2] == logits[2].argmax()
    alone, alone_logp = sample(logits[2:], [params[2], SamplingParams(temperature=0)], uniforms([None, None]))
    assert alone[0] == tokens[2] and alone_logp[0] == logp[2]  # an all-greedy batch: the same token and log-prob
    # not temperature 1's: per row the gap is linear in the token's logit and crosses 0, so one row
    # can land near it (~1e-3 a row); all three (~1e-9) cannot
    assert (torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0] - logp).abs()[[0, 1, 3]].max() > 1e-3


def test_the_batched_sampler_inverts_each_rows_cut_distribution(seed):
    """Guards the whole-batch sampler (one set of tensor ops for every row, as a CUDA graph
    needs): at a grid of uniforms each row's tokens come out in the proportions of its own
    distribution, temperature, top-k, top-p and min-p applied (within one draw of N x p),
    never a token those cut; and a row's token is the same alone as beside rows with other
    settings."""
    from miles.rollout.sampling import sample

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 12, generator=g) * 2
    cases = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
             SamplingParams(top_p=0.6), SamplingParams(temperature=0.9, min_p=0.2), SamplingParams(temperature=0)]
    n = 2000
    u = (torch.arange(n) + 0.5) / n
    for p in cases:
        z = logits[0].double() / (p.temperature or 1.0)
        if p.top_k > 0:
            z = z.masked_fill(z < z.topk(p.top_k).values[-1], float("-inf"))
        want = torch.softmax(z, -1)
        if p.top_p < 1:
            sp, order = want.sort(descending=True)
            want = torch.zeros_like(want).scatter(0, order, sp.masked_fill(sp.cumsum(0) - sp > p.top_p, 0.0))
        want = want.masked_fill(want < p.min_p * want.max(), 0.0)
        want = want / want.sum()
        tokens, logp = sample(logits.expand(n, -1), [p] * n, u)
        assert torch.isfinite(logp).all()
        counts = torch.bincount(tokens, minlength=12).double()
        if p.greedy:
            assert (tokens == logits.argmax()).all()
        else:
            assert ((counts - n * want).abs() <= 1.0 + 1e-6).all(), (p, counts.tolist(), (n * want).tolist())
    alone = [sample(logits, [p], u[i:i + 1] * 0.9)[0].item() for i, p in enumerate(cases)]
    together = sample(logits.expand(len(cases), -1), cases, u[:len(cases)] * 0.9)[0].tolist()
    assert alone == together


def test_the_decode_step_pads_to_its_bucket_in_a_slot_nobody_owns(seed):
    """Guards the padding that gives a CUDA graph per batch size: 3 sequences decode padded to
    the bucket of 4 with the scratch slot as the fourth row, and give the logits and leave the
    cache state that the 3 alone give (the padding touches no sequence's slot); buckets are the
    powers of two up to the engine's slots."""
    from miles.rollout.decode_step import DecodeStep, buckets

    assert buckets(6) == [1, 2, 4, 6] and buckets(8) == [1, 2, 4, 8] and buckets(1) == [1]
    model = tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 320, (n,), generator=g) for n in (5, 17, 9)]
    caches = [model.new_cache(5, 64) for _ in range(2)]
    for c in caches:
        model.prefill(prompts, c, [0, 2, 3])
    step = DecodeStep(model, caches[1], scratch=4, max_batch=4)
    for k in range(6):
        ids = torch.randint(2, 320, (3,), generator=g)
        with torch.no_grad():
            alone, alone_choices = model.decode(ids, caches[0], torch.tensor([0, 2, 3]), record=("routes", "picks"))
        # ids from the host, or as a tensor (the last step's tokens on the device)
        padded, choices = step(ids.tolist() if k % 2 else ids, [0, 2, 3], record=("routes", "picks"))
        assert step.bucket(3) == 4 and padded.shape == alone.shape
        assert_close(padded, alone, atol=1e-6, what=f"step {k}")
        assert torch.equal(choices["routes"].sort(-1).values, alone_choices["routes"].sort(-1).values), \
            f"step {k}: the rows' experts"
        assert torch.equal(choices["picks"], alone_choices["picks"]), f"step {k}: the rows' indexer entries"
    for i, (a, b) in enumerate(zip(caches[0].tensors(), caches[1].tensors(), strict=True)):
        # rounding apart (a batch of 4 may block its sums unlike one of 3), not a write of other rows
        assert_close(b[:4].double(), a[:4].double(), atol=1e-5, what=f"cache tensor {i}: a sequence's slot")


def test_a_step_that_cannot_be_captured_runs_eagerly(seed):
    """A capture that fails leaves the step eager after one try, said once (the reason kept),
    and the step still decodes: the same logits as the model's own decode."""
    from miles.rollout.decode_step import DecodeStep

    model = tiny_model(seed).eval()
    step = DecodeStep(model, model.new_cache(3, 32), scratch=2, max_batch=2)
    tried = []

    def capture(bs, rec):
        tried.append(bs)
        raise RuntimeError("no graphs here")

    step._capture, step.use_graphs = capture, True
    assert step._try_capture(2, frozenset()) is None and tried == [2]
    assert "no graphs here" in step.graph_error and not step.use_graphs
    ref = model.new_cache(3, 32)
    prompt = [torch.arange(2, 9)]
    model.prefill(prompt, step.cache, [0])
    model.prefill(prompt, ref, [0])
    logits, _ = step([5], [0])
    assert tried == [2]  # eager from now on: no second try
    want = model.decode(torch.tensor([5]), ref, torch.tensor([0]))
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, want)
