"""The embedded engine: continuous batching over the plugin's model and its slot cache.

One scheduler thread owns the model. Each iteration it admits waiting requests into free
slots (distinct prompts prefilled together in one packed forward; requests with the same
prompt share one prefill and copy its slot), then runs one decode step over every running
sequence, each at its own position. An iteration prefills at most `prefill_tokens` prompt
tokens: a longer prompt is prefilled in chunks over as many iterations (`model.extend`), so
the running sequences decode a step between chunks rather than wait for the whole prompt.
Requests join and leave at every step. Weight updates are staged off to the side and swapped in
between two steps (see `weights.py`).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from miles.memory import to_device
from miles.rollout.decode_step import DecodeStep
from miles.rollout.sampling import SamplingParams, sample, uniforms
from plugins.deepseek_v4.model import DeepSeekV4ForCausalLM

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve (reported to the client as a 4xx)."""


@dataclass
class Sequence:
    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    on_done: Callable[[dict], None]
    gen: torch.Generator | None = None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    aborted: str | None = None
    finish: dict | None = None
    started: float = field(default_factory=time.monotonic)
    # the choices to return for every token the model read (replay): "routes" (return_routed_experts:
    # the experts), "picks" (return_indexer_picks: the indexer's compressed entries)
    returns: frozenset[str] = frozenset()
    # by name: [P, L, k] / [P, C, K] for the prompt, then [1, L, k] / [1, C, K] a step
    choices: dict[str, list[np.ndarray]] = field(default_factory=dict)
    # prefilling: the prompt tokens in the slot so far, the requests of the same prompt that copy
    # the slot when it is whole, and the choices of the prompt's chunks so far (by name)
    filled: int = 0
    followers: list[Sequence] = field(default_factory=list)
    prompt_choices: dict[str, list[np.ndarray]] = field(default_factory=dict)
    on_token: Callable[[int], None] | None = None  # each token as it is appended (streaming), on the scheduler's thread


@dataclass
class _Sampled:
    """A step's tokens sampled on the device and on their way to the host (`read` waits)."""
    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device: the next decode step's input ids
    host: torch.Tensor  # [2, n] float64 on the host: the tokens and their log-probs
    choices: dict[str, torch.Tensor]  # by name, on the host: "routes" [n, L, k], "picks" [n, C, K] int32
    landed: torch.cuda.Event | None  # the copies to the host are done (None on CPU: they are)


class Engine:
    """Serves one model replica. Thread-safe entry points: submit, abort, pause/resume,
    stats; `run_exclusive` runs a function between two decoding steps (weight swaps)."""

    def __init__(self, model: DeepSeekV4ForCausalLM, max_running: int = 64, max_len: int = 4096,
                 tokenizer=None, eos_ids: tuple[int, ...] = (), prefill_tokens: int = 8192, cuda_graphs: bool = True,
                 return_routed_experts: bool = False, return_indexer_picks: bool = False,
                 overlap: bool = True):
        """`return_routed_experts`, `return_indexer_picks`: every request's answer carries the
        experts, the indexer's entries (as if each asked). `overlap`: a decode step's tokens read while the
        next step runs (`_decode`; off: each step read before the next, the A/B)."""
        self.overlap = overlap
        self.model = model.eval()
        self.always = frozenset(n for n, on in (("routes", return_routed_experts), ("picks", return_indexer_picks))
                                if on)
        self.device = next(model.parameters()).device
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.max_running, self.max_len, self.prefill_tokens = max_running, max_len, prefill_tokens
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.vocab = model.config.vocab_size
        # one slot more than sequences: the decode step's padding rows write there (DecodeStep)
        self.cache = model.new_cache(max_running + 1, max_len, self.device)
        self.decoder = DecodeStep(model, self.cache, scratch=max_running, max_batch=max_running, graphs=cuda_graphs)
        self.free = list(range(max_running))[::-1]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitted: list[Sequence] = []  # out of waiting, being prefilled, not yet running
        self._prefilling: list[Sequence] = []  # the first request of each prompt being prefilled (in chunks)
        self._pending: _Sampled | None = None  # the last decode step's tokens, launched, not yet read
        self.cv = threading.Condition()
        self.step_lock = threading.Lock()  # held for each scheduler iteration and each weight swap
        self.paused = False
        self.weight_version = 0
        self.last_progress = time.monotonic()  # end of the last step (or when work arrived at an idle engine)
        self.counters = {"prefill_tokens": 0, "generated_tokens": 0, "finished": 0, "steps": 0}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ entry points
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that cannot be served (checked before queueing)."""
        if not prompt:
            raise RequestError("input_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"input_ids hold ids outside the vocabulary [0, {self.vocab}): {bad[:5]}")
        if any(not 0 <= t < self.vocab for t in params.stop_token_ids or []):
            raise RequestError(f"stop_token_ids must be ids in [0, {self.vocab})")
        if len(prompt) + params.max_new_tokens > self.max_len:
            raise RequestError(f"input ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                               f"the engine's context length {self.max_len}")
        if params.stops and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")

    def submit(self, prompt: list[int], params: SamplingParams, on_done: Callable[[dict], None],
               return_logprob: bool = False, rid: str | None = None, return_routed_experts: bool = False,
               return_indexer_picks: bool = False, on_token: Callable[[int], None] | None = None) -> str:
        """Queue a request; on_done(its result) when it finishes, on_token(id) after each token
        (both on the scheduler's thread: hand the work to another; an exception is logged)."""
        self.check(prompt, params)
        asked = {n for n, on in (("routes", return_routed_experts), ("picks", return_indexer_picks)) if on}
        seq = Sequence(rid or uuid.uuid4().hex, list(prompt), params, return_logprob, on_done,
                       params.generator(), returns=self.always | asked, on_token=on_token)
        if params.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return seq.rid
        with self.cv:
            if not (self.waiting or self.running or self._prefilling):
                self.last_progress = time.monotonic()
            self.waiting.append(seq)
            self.cv.notify_all()
        return seq.rid

    def abort(self, rid: str | None = None) -> int:
        """Abort one request (rid) or all (None); each finishes with finish_reason abort."""
        with self.cv:
            hit = [s for s in list(self.waiting) + self._admitted + self.running if rid is None or s.rid == rid]
            for s in hit:
                s.aborted = "aborted by request"
            self.cv.notify_all()
        return len(hit)

    def pause(self) -> None:
        with self.cv:
            self.paused = True

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def run_exclusive(self, fn: Callable[[], object]) -> object:
        """Run fn with no decoding step in progress (the model's weights may change). Prompts
        part-way through a chunked prefill start again after it (their cached chunks may come
        from other weights, or their cache may have been released), so a prompt is prefilled
        under one weight version."""
        with self.step_lock:
            self._drain()
            try:
                return fn()
            finally:
                for s in self._prefilling:
                    s.filled, s.prompt_choices = 0, {}

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (it never exits on a failed step, only on stop)."""
        return self._thread.is_alive()

    def stats(self) -> dict:
        with self.cv:
            return {"waiting": len(self.waiting), "running": len(self.running), "prefilling": len(self._prefilling),
                    "free_slots": len(self.free),
                    "weight_version": self.weight_version, "paused": self.paused, **self.counters}

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._thread.join(timeout=30)
        self._pending = None
        self.abort()
        for s in list(self.waiting) + self._admitted + self.running:
            self._finish(s, {"type": "abort", "message": "engine stopped"})

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and self._idle() and self._pending is None:
                    self.cv.wait()
                if self._stop:
                    return
            with self.step_lock:
                with self.cv:  # under the step lock: a pause and a run_exclusive may come before it
                    idle = self._idle()
                try:
                    self._drain() if idle else self._iteration()  # idle: the last step's tokens read first
                except Exception as e:  # a failed step fails its requests, never the engine
                    log.exception("engine step failed")
                    self._pending = None
                    with self.cv:
                        failed = self._admitted + self.running + list(self.waiting)
                        self._admitted, self._prefilling, self.running, self.waiting = [], [], [], deque()
                    for s in failed:
                        self._release(s)
                        self._finish(s, {"type": "abort", "message": f"engine error: {e}"})

    def _idle(self) -> bool:
        return self.paused or not (self.waiting or self.running or self._prefilling)

    def _iteration(self) -> None:
        with self.cv:
            for s in [s for s in self.running if s.aborted]:
                self.running.remove(s)
                self._release(s)
                self._finish(s, {"type": "abort", "message": s.aborted})
            for s in [s for s in self.waiting if s.aborted]:
                self.waiting.remove(s)
                self._finish(s, {"type": "abort", "message": s.aborted})
            self._drop_aborted_prefills()
            work, budget = [], self.prefill_tokens  # (first request of a prompt, tokens from, to)
            for s in self._prefilling:  # prompts part-way in: their next chunks first
                if budget > 0:
                    work.append((s, s.filled, s.filled + min(budget, len(s.prompt) - s.filled)))
                    budget -= work[-1][2] - work[-1][1]
            firsts = {tuple(s.prompt): s for s in self._prefilling}
            while self.waiting and self.free and budget > 0:
                s = self.waiting.popleft()
                s.slot = self.free.pop()
                self._admitted.append(s)  # abort finds them (their abort takes effect at the next iteration)
                if not self._join(s, firsts):
                    firsts.setdefault(tuple(s.prompt), s)
                    self._prefilling.append(s)
                    work.append((s, 0, min(budget, len(s.prompt))))
                    budget -= work[-1][2]
            for s in [s for s in self.waiting if tuple(s.prompt) in firsts]:  # joins cost no prefill: any
                if self.free and self._join(s, firsts, admit=True):  # place in the queue
                    self.waiting.remove(s)
        if work:
            self._drain()  # the running sequences' last tokens on the host: the next step takes them from there
            self._prefill(work)
        if self.running:
            self._decode()
        self.counters["steps"] += 1
        self.last_progress = time.monotonic()

    def _join(self, s: Sequence, firsts: dict[tuple[int, ...], Sequence], admit: bool = False) -> bool:
        """Join s to the prompt of its own being prefilled, if any, as a request that copies the
        slot when the prompt is whole: when the choices s wants were recorded from the prompt's
        first token on (or nothing is prefilled yet). `admit`: s takes a free slot first."""
        first = firsts.get(tuple(s.prompt))
        if first is None or not (first.filled == 0 or s.returns <= first.prompt_choices.keys()):
            return False
        if admit:
            s.slot = self.free.pop()
            self._admitted.append(s)
        first.followers.append(s)
        return True

    def _drop_aborted_prefills(self) -> None:
        """Finish the aborted requests of prompts being prefilled; a prompt whose first request
        was aborted goes on in the slot of the next one of its requests, if any is left."""
        for s in list(self._prefilling):
            group = [x for x in (s, *s.followers) if not x.aborted]
            for x in (s, *s.followers):
                if x.aborted:
                    self._admitted = [y for y in self._admitted if y is not x]
                    if x is s and group:  # the prefill so far lives in s's slot: hand it on
                        group[0].slot, s.slot = s.slot, group[0].slot
                    self._release(x)
                    self._finish(x, {"type": "abort", "message": x.aborted})
            i = self._prefilling.index(s)
            if not group:
                self._prefilling.pop(i)
            elif group[0] is not s:
                lead = group[0]
                lead.filled, lead.prompt_choices, lead.followers = s.filled, s.prompt_choices, group[1:]
                self._prefilling[i] = lead
            else:
                s.followers = group[1:]

    def _prefill(self, work: list[tuple[Sequence, int, int]]) -> None:
        """Prompt tokens [start, end) of each prompt: those starting at 0 in one packed forward,
        the others continuing their slots in one `extend`. A prompt that is whole then has its
        slot copied to the requests of the same prompt, and each samples its first token from
        the shared logits."""
        logits: dict[int, torch.Tensor] = {}  # by id of the first request: [V] after its chunk
        for cont in (False, True):
            part = [w for w in work if (w[1] > 0) == cont]
            if not part:
                continue
            chunks = [torch.tensor(s.prompt[a:b], dtype=torch.long) for s, a, b in part]  # on the host
            # what any request of the prompt asks, and what its earlier chunks recorded (a request that
            # asks it may join later: `_join`)
            wanted = frozenset().union(*(x.returns for s, _, _ in part for x in (s, *s.followers)),
                                       *(s.prompt_choices.keys() for s, _, _ in part))
            call = self.model.extend if cont else self.model.prefill
            out = call(chunks, self.cache, [s.slot for s, _, _ in part], record=wanted)
            rows, choices = out if wanted else (out, {})  # [P, V]; [P, T, L, k], [P, T, C, K]
            self.counters["prefill_tokens"] += sum(b - a for _, a, b in part)
            for i, (s, a, b) in enumerate(part):
                s.filled = b
                logits[id(s)] = rows[i]
                for name, t in choices.items():
                    s.prompt_choices.setdefault(name, []).append(t[i, :b - a].to(torch.int32).cpu().numpy())
        whole = [s for s, _, b in work if b == len(s.prompt)]
        if not whole:
            return
        copies = [(s.slot, x.slot) for s in whole for x in s.followers]
        if copies:
            self.cache.copy_slots([a for a, _ in copies], [b for _, b in copies])
        seqs = [x for s in whole for x in (s, *s.followers)]
        for s in whole:  # the choices the prompt's tokens made, [P, L, k] / [P, C, K]
            for x in (s, *s.followers):
                for name in x.returns:
                    x.choices[name] = [np.concatenate(s.prompt_choices[name])]
        done = {id(x) for x in seqs}
        with self.cv:
            self._prefilling = [s for s in self._prefilling if id(s) not in done]
            self._admitted = [x for x in self._admitted if id(x) not in done]
            self.running += seqs
        self._read(self._sample(seqs, torch.stack([logits[id(s)] for s in whole for _ in (s, *s.followers)])))

    def _decode(self) -> None:
        """One step of every running sequence, overlapped with the host's reading of the step
        before: its tokens go on as this step's inputs on the device, and are read (appended,
        checked for a stop) while this step runs. A sequence that stopped at the step before
        thus runs one step more, whose token is dropped (its slot still holds the position:
        a sequence stops by max_len at max_len tokens, and the extra step writes position
        max_len - 1)."""
        seqs, last = list(self.running), self._pending
        self._pending = None
        if last is None:
            ids = [s.out[-1] for s in seqs]
        elif len(last.seqs) == len(seqs) and all(a is b for a, b in zip(last.seqs, seqs, strict=True)):
            ids = last.tokens
        else:  # some stopped or were aborted since: the rows of those still running
            row = {id(s): i for i, s in enumerate(last.seqs)}
            ids = last.tokens[to_device(torch.tensor([row[id(s)] for s in seqs]), self.device)]
        wanted = frozenset().union(*(s.returns for s in seqs))
        logits, choices = self.decoder(ids, [s.slot for s in seqs], wanted)
        self._pending = self._sample(seqs, logits, choices)
        if last is not None:
            self._read(last)
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        """Read the last decode step's tokens, if any are still on their way."""
        last, self._pending = self._pending, None
        if last is not None:
            self._read(last)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, choices: dict[str, torch.Tensor] | None = None
                ) -> _Sampled:
        """Sample each sequence's next token from `logits` and start its copy to the host;
        `choices` ("routes" [n, L, k], "picks" [n, C, K]): what the step's input tokens (each
        sequence's last) chose."""
        tokens, logps = sample(logits, [s.params for s in seqs], uniforms([s.gen for s in seqs]))
        both = torch.stack((tokens.double(), logps.double()))  # [2, n]
        wanted = {name: t.to(torch.int32) for name, t in (choices or {}).items()}
        if both.device.type != "cuda":
            return _Sampled(seqs, tokens, both, wanted, None)

        def landing(t: torch.Tensor) -> torch.Tensor:  # a pinned copy the host reads after `landed`
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        host, wanted = landing(both), {name: landing(t) for name, t in wanted.items()}
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.device))
        return _Sampled(seqs, tokens, host, wanted, landed)

    def _read(self, step: _Sampled) -> None:
        """Append a step's tokens (and the choices of those that asked) to the sequences it
        ran that are still running; finish those that stop. The step's one wait for the device."""
        if step.landed is not None:
            step.landed.synchronize()
        live = [s.finish is None for s in step.seqs]  # not stopped or aborted while the step ran
        for name, t in step.choices.items():
            for s, on, r in zip(step.seqs, live, t.numpy(), strict=True):
                if on and name in s.returns:
                    s.choices[name].append(r[None])
        self.counters["generated_tokens"] += sum(live)
        for s, on, t, lp in zip(step.seqs, live, step.host[0].long().tolist(), step.host[1].tolist(), strict=True):
            if not on:
                continue
            s.out.append(t)
            s.logprobs.append(lp)
            if s.on_token is not None:
                try:
                    s.on_token(t)
                except Exception:
                    log.exception("request %s: token callback failed; no more tokens are passed to it", s.rid)
                    s.on_token = None
            reason = self._stopped(s)
            if reason is not None:
                with self.cv:
                    self.running.remove(s)
                self._release(s)
                self._finish(s, reason)

    def _stopped(self, s: Sequence) -> dict | None:
        p, t, n = s.params, s.out[-1], len(s.out)
        if n >= p.min_new_tokens:
            if t in (p.stop_token_ids or ()) or (t in self.eos_ids and not p.ignore_eos):
                return {"type": "stop", "matched": t}
            if p.stops:
                text = self.tokenizer.decode(s.out[-32:], skip_special_tokens=False)
                hit = min((x for x in p.stops if x in text), key=text.find, default=None)  # the first in the text
                if hit is not None:
                    return {"type": "stop", "matched": hit}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        if len(s.prompt) + n >= self.max_len:
            return {"type": "length", "length": n}
        return None

    def _release(self, s: Sequence) -> None:
        if s.slot >= 0:
            with self.cv:
                self.free.append(s.slot)
            s.slot = -1

    def _finish(self, s: Sequence, reason: dict) -> None:
        s.finish = reason
        self.counters["finished"] += 1
        try:
            s.on_done(self.result(s))
        except Exception:
            log.exception("request %s: completion callback failed", s.rid)

    def result(self, s: Sequence) -> dict:
        """SGLang's /generate response for one request."""
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(s.out, skip_special_tokens=s.params.skip_special_tokens)
            hit = s.finish.get("matched") if s.finish else None
            if isinstance(hit, str) and not s.params.no_stop_trim and hit in text:
                text = text[: text.index(hit)]
        meta = {"id": s.rid, "prompt_tokens": len(s.prompt), "completion_tokens": len(s.out),
                "finish_reason": s.finish, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - s.started}
        if s.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.out, strict=True)]
        for name in sorted(s.returns):
            meta[META_KEYS[name]] = encode_choices(s.choices.get(name, []))
        return {"text": text, "output_ids": list(s.out), "meta_info": meta}


# the meta_info field of each choice: SGLang's name for the experts; the indexer's entries are ours
META_KEYS = {"routes": "routed_experts", "picks": "indexer_picks"}


def encode_choices(arrays: list[np.ndarray]) -> str:
    """A meta_info choice field, SGLang's shape of routed_experts: base64 of int32 ids ordered
    by token, layer, slot, for every token the model read (the prompt's and each generated
    token fed back: prompt + output - 1 tokens). routed_experts: [tokens, learned MoE layers of
    the main stack (hash layers route by token id), top-k experts]; indexer_picks: [tokens, CSA
    layers of the main stack, index_topk in-document block numbers, -1 = none].
    decode_choices reads it back."""
    flat = np.concatenate(arrays) if arrays else np.zeros((0, 0, 0), np.int32)
    return base64.b64encode(np.ascontiguousarray(flat, dtype="<i4").tobytes()).decode()


def decode_choices(text: str, layers: int, k: int) -> np.ndarray:
    """[tokens, layers, k] int32 from a meta_info choice field (routed_experts, indexer_picks)."""
    return np.frombuffer(base64.b64decode(text), dtype="<i4").reshape(-1, layers, k)
