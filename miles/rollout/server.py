"""SGLang's native HTTP API over an `EngineService` (FastAPI, served by uvicorn in a thread).

Every malformed request gets a 400 with a message naming the field; nothing a client sends
can stop the engine. Bound to 127.0.0.1 unless the spec says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from miles.rollout.chat_stream import TextStream, split_reasoning
from miles.rollout.engine import RequestError
from miles.rollout.sampling import SamplingParams
from miles.rollout.service import EngineService
from miles.rollout.weights import WeightSyncError, decode_tensors


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = SamplingParams()
    return_logprob: StrictBool | list[StrictBool] = False
    return_routed_experts: StrictBool | list[StrictBool] = False  # meta_info["routed_experts"] (routing replay)
    return_indexer_picks: StrictBool | list[StrictBool] = False  # meta_info["indexer_picks"] (indexer replay; ours)
    rid: StrictStr | list[StrictStr] | None = None
    stream: Literal[False] = False  # streaming is not served
    logprob_start_len: StrictInt = -1  # accepted for SGLang clients; prompt log-probs are not returned
    top_logprobs_num: Literal[0] = 0
    return_text_in_logprobs: StrictBool = False
    # Fields sglang-router adds to what it forwards (its defaults; other values are refused).
    model: StrictStr | None = None
    log_metrics: StrictBool = True
    return_hidden_states: Literal[False] = False
    background: Literal[False] = False
    no_logs: StrictBool = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    lora_path: None = None
    data_parallel_rank: None = None

    def items(self, tokenizer) -> tuple[bool, list[tuple[list[int], SamplingParams, bool, str | None, bool]]]:
        """(batched?, one (ids, params, return_logprob, rid, return_routed_experts,
        return_indexer_picks) per request)."""
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("give exactly one of 'text' and 'input_ids'")
        if self.text is not None:
            if tokenizer is None:
                raise RequestError("'text' needs a tokenizer; this engine has none (send input_ids)")
            batched = isinstance(self.text, list)
            prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in
                       (self.text if batched else [self.text])]
        else:
            batched = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts = self.input_ids if batched else [self.input_ids]
        n = len(prompts)
        if batched and n == 0:
            raise RequestError("empty batch")

        def per(v, name):
            if isinstance(v, list):
                if not batched or len(v) != n:
                    raise RequestError(f"'{name}' is a list of {len(v)}, the batch has {n if batched else 1} prompt")
                return v
            return [v] * n

        rids = per(self.rid, "rid") if self.rid is not None else [None] * n
        return batched, list(zip(prompts, per(self.sampling_params, "sampling_params"),
                                 per(self.return_logprob, "return_logprob"), rids,
                                 per(self.return_routed_experts, "return_routed_experts"),
                                 per(self.return_indexer_picks, "return_indexer_picks"), strict=True))


class ChatRequest(BaseModel):
    """POST /v1/chat/completions (OpenAI's shape, as SGLang serves it): the messages rendered with
    DeepSeek-V4's chat encoding and the engine's tokenizer; one choice, streamed as server-sent
    events with `stream: true`."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields that change nothing here
    messages: list[dict]
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: Literal[1] = 1
    stream: StrictBool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the token counts
    chat_template_kwargs: dict = {}  # {"thinking": true}: DeepSeek-V4's thinking mode

    def params(self) -> SamplingParams:
        n = next((x for x in (self.max_completion_tokens, self.max_tokens) if x is not None), 128)
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
                              max_new_tokens=n)


def _bad(msg: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "code": code}}, status_code=code)


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _pydantic_message(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])


def build_app(svc: EngineService) -> FastAPI:
    app = FastAPI(title="miles embedded engine", docs_url=None, redoc_url=None)
    engine = svc.engine
    key = svc.spec.api_key

    if key is not None:  # off loopback anyone on the network could otherwise update weights, pause, abort
        import hmac

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            given = request.headers.get("authorization", "")
            if request.url.path != "/health" and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return JSONResponse({"error": "unauthorized: this engine takes its run's key as "
                                              "Authorization: Bearer <key>"}, status_code=401)
            return await call_next(request)

    @app.exception_handler(RequestError)
    async def _request_error(_, e: RequestError):
        return _bad(str(e))

    @app.exception_handler(ValidationError)
    async def _validation_error(_, e: ValidationError):
        return _bad(_pydantic_message(e))

    @app.exception_handler(WeightSyncError)
    async def _sync_error(_, e: WeightSyncError):
        return JSONResponse({"success": False, "message": str(e)}, status_code=400)

    @app.get("/health")
    async def health():
        ok, why = svc.healthy()
        return JSONResponse({"status": why}, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate():
        """A one-token generation end to end (the scheduler really runs)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        engine.submit([0], SamplingParams(temperature=0, max_new_tokens=1),
                      lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        try:
            r = await asyncio.wait_for(fut, timeout=svc.spec.hang_timeout)
        except TimeoutError:
            return _bad("generation did not finish in time", 503)
        ok = r["meta_info"]["finish_reason"]["type"] != "abort"
        return JSONResponse({"status": "ok" if ok else "failed"}, status_code=200 if ok else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return svc.info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {**svc.info(), **engine.stats(), "spec": svc.spec.to_dict(), "last_weight_update": svc.last_update}

    @app.post("/generate")
    async def generate(request: Request):
        req = GenerateRequest.model_validate(await _body(request))
        batched, items = req.items(svc.tokenizer)
        for ids, params, *_ in items:  # all checked before any is queued
            engine.check(ids, params)
        loop = asyncio.get_running_loop()
        futs = []
        for ids, params, lp, rid, routes, picks in items:
            fut = loop.create_future()
            futs.append(fut)
            engine.submit(ids, params, lambda r, f=fut: loop.call_soon_threadsafe(
                lambda: f.done() or f.set_result(r)), lp, rid, return_routed_experts=routes,
                return_indexer_picks=picks)
        results = await asyncio.gather(*futs)
        failed = [r for r in results if _engine_failed(r)]
        if failed:
            return _bad(failed[0]["meta_info"]["finish_reason"]["message"], 500)
        return results if batched else results[0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from miles.data.chat import ChatFormatError, load_tokenizer
        from miles.data.prompts import prompt_ids

        req = ChatRequest.model_validate(await _body(request))
        if svc.spec.tokenizer is None:
            raise RequestError("chat needs a tokenizer; this engine has none (miles serve --tokenizer)")
        thinking = bool(req.chat_template_kwargs.get("thinking", False))
        try:
            ids = prompt_ids(req.messages, load_tokenizer(svc.spec.tokenizer), thinking=thinking)
        except (ChatFormatError, ValueError, KeyError, TypeError) as e:
            raise RequestError(f"messages: {e}") from e
        params = req.params()
        engine.check(ids, params)
        loop = asyncio.get_running_loop()
        if req.stream:
            return _chat_stream(engine, loop, req, ids, params, thinking)
        fut = loop.create_future()
        engine.submit(ids, params, lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        r = await fut
        reason = r["meta_info"]["finish_reason"]
        if _engine_failed(r):
            return _bad(reason["message"], 500)
        reasoning, text = split_reasoning(r["text"], thinking)  # DeepSeek-V4: the reasoning, then the answer
        message = {"role": "assistant", "content": text.strip()}
        if reasoning is not None:
            message["reasoning_content"] = reasoning.strip()
        n_out = r["meta_info"]["completion_tokens"]
        return {"id": r["meta_info"]["id"], "object": "chat.completion", "created": int(time.time()),
                "model": req.model or "miles", "choices": [{"index": 0, "message": message,
                                                          "finish_reason": reason.get("type", "stop")}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _body(request)
        if body.get("abort_all"):
            return {"aborted": engine.abort(None)}
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise RequestError("give 'rid' (a string) or 'abort_all': true")
        return {"aborted": engine.abort(rid)}

    @app.post("/flush_cache")
    async def flush_cache():
        # No prefix cache outlives its requests here: nothing to drop.
        return {"success": True, "message": "Cache flushed."}

    @app.post("/pause_generation")
    async def pause_generation():
        engine.pause()
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"success": True}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        """Body: serialized_named_tensors (base64 safetensors buckets, see weights.encode_tensors),
        optional checksums {name: md5} and weight_version. Applied whole or not at all."""
        body = await _body(request)
        blobs = body.get("serialized_named_tensors")
        if not isinstance(blobs, list) or not all(isinstance(b, str) for b in blobs):
            raise RequestError("'serialized_named_tensors' must be a list of base64 strings")
        tensors = {}
        for blob in blobs:
            tensors.update(decode_tensors(blob))
        sums = body.get("checksums")
        version = body.get("weight_version")
        res = await asyncio.to_thread(svc.update_all, tensors, sums, _version(version))
        return {"success": True, "message": f"updated {res['tensors']} tensors", **res}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise RequestError("'model_path' (a directory of safetensors) is required")
        res = await asyncio.to_thread(svc.update_from_disk, path, _version(body.get("weight_version")))
        return {"success": True, "message": f"updated {res['tensors']} tensors from {path}", **res}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation():
        freed = await asyncio.to_thread(svc.release_memory)
        return {"success": True, "freed_bytes": freed}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation():
        await asyncio.to_thread(svc.resume_memory)
        return {"success": True}

    return app


def _chat_stream(engine, loop, req: ChatRequest, ids: list[int], params: SamplingParams,
                 thinking: bool) -> StreamingResponse:
    """A chat completion as OpenAI's server-sent events: a chunk per settled piece of text
    (chat_stream.TextStream), the finish reason, the usage if asked, then [DONE]. The request
    starts with the response and a client that goes away aborts it."""
    events: asyncio.Queue = asyncio.Queue()  # ("token", id) as decoded, then ("done", result)
    rid = "chatcmpl-" + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model or "miles"}

    def post(event: tuple) -> None:  # from the scheduler's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the server's loop has closed: nobody is listening
            pass

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _event({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def stream():
        done = False
        engine.submit(ids, params, lambda r: post(("done", r)), rid=rid, on_token=lambda t: post(("token", t)))
        try:
            yield chunk({"role": "assistant", "content": ""})
            text, out = TextStream(params.stops, thinking), Detokenizer(engine.tokenizer, params.skip_special_tokens)
            while True:
                kind, value = await events.get()
                while kind == "token":  # every token queued so far, then one decode
                    out.add(value)
                    if events.empty():
                        break
                    kind, value = events.get_nowait()
                if kind == "token":
                    for d in text.deltas(out.text()):
                        yield chunk(d)
                    continue
                done, reason = True, value["meta_info"]["finish_reason"]
                if _engine_failed(value):
                    yield _event({"error": {"message": reason["message"], "code": 500}})
                else:
                    for d in text.deltas(value["text"], final=True):
                        yield chunk(d)
                    yield chunk({}, reason.get("type", "stop"))
                    if (req.stream_options or {}).get("include_usage"):
                        n = value["meta_info"]["completion_tokens"]
                        yield _event({**head, "choices": [], "usage": {
                            "prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}})
                yield _event("[DONE]")
                return
        finally:
            if not done:  # the client left (or the stream broke): stop generating for it
                engine.abort(rid)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(data: dict | str) -> str:
    """One server-sent event: `data: <JSON>` (or a bare string such as [DONE]) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _engine_failed(result: dict) -> bool:
    """Whether a request ended because the engine failed (not by its own stop, length or abort)."""
    return result["meta_info"]["finish_reason"].get("message", "").startswith("engine")


class Detokenizer:
    """A completion's text as its tokens arrive, decoding only the tokens after the last point
    where the text so far ended on a whole character (byte-level decoding joins there), so a
    long stream decodes each token about once instead of the whole answer at every token."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.base, self.base_text = 0, ""  # tokens [0, base) decode to base_text, a whole-character text

    def add(self, token: int) -> None:
        self.ids.append(token)

    def text(self) -> str:
        tail = self.tok.decode(self.ids[self.base:], skip_special_tokens=self.skip)
        if not tail.endswith("\ufffd"):
            self.base, self.base_text = len(self.ids), self.base_text + tail
            return self.base_text
        return self.base_text + tail


def _version(v) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError) as e:
        raise RequestError(f"weight_version must be an integer, got {v!r}") from e


# Idle keep-alive connections stay open this long (uvicorn's default: 5 s). The router pools its
# connections to an engine for up to 50-90 s; a server closing one first races the router's next
# request on it ("error sending request"), and a rollout's burst of such failures opened the
# router's circuit breaker on the only engine for 60 s (seen in the demo job).
KEEP_ALIVE_S = 300


class HttpServer:
    """uvicorn serving `app` from a daemon thread; `url` once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2,
                                                    timeout_keep_alive=KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="engine-http",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the engine's HTTP server did not start on {host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
