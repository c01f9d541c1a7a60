"""One rollout: n responses per prompt through the router (or the user's generate function),
their rewards, the groups dynamic sampling keeps; the responses as compact arrays; the
record of each rollout (rollouts.jsonl) and how stale its weights were."""

from __future__ import annotations

import functools
import json
import math
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from miles.algo.rewards import Rewards, overlong_penalty
from miles.algo.sampling import dynamic_filter
from miles.config import JobConfig
from miles.data.chat import load_hf_tokenizer, v4_tokenizer_file
from miles.data.prompts import Prompt, PromptSource
from miles.data.sft import tokenizer_path
from miles.memory import phase_metrics
from miles.observe import records
from miles.rl.engines import generation_phase, ray_get_all
from miles.rollout.engine import META_KEYS, decode_choices
from miles.rollout.manager import RolloutError


@dataclass
class Response:
    """One sampled response. Per-token data as arrays (int32 ids, float32 log-probs, int8
    mask): a V4-Flash rollout holds tens of millions of tokens in the driver, where Python
    lists cost ~60 bytes a token (benchmarks/driver_memory.py)."""

    prompt: Prompt
    ids: np.ndarray  # [T] generated tokens (the end-of-sentence id included when it stopped there)
    logprobs: np.ndarray  # [T] the engine's log-probs of them
    text: str
    truncated: bool  # stopped by the length limit
    mask: np.ndarray | None = None  # [T] per token: 1 the policy's (trained), 0 environment / tools (multi-turn)
    routes: np.ndarray | None = None  # [P + T - 1, L, k] int16: the experts each token the engine read took
    picks: np.ndarray | None = None  # [P + T - 1, C, K]: the indexer's entries each token the engine read attended
    turns: int = 1
    version: int | None = None  # the weights it was generated with (the engine's weight_version; multi-turn: the
    # oldest of its turns')
    correct: bool = False  # the raw reward was positive
    raw: float = 0.0  # the reward function's value
    reward: float = 0.0  # shaped (overlong penalty added)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.mask is not None:
            self.mask = np.asarray(self.mask, dtype=np.int8)

    @property
    def trained(self) -> int:
        """Tokens the loss sees (the policy's)."""
        return len(self.ids) if self.mask is None else int(self.mask.sum())


@dataclass
class Rollout:
    step: int
    groups: list[list[Response]]  # rollout_batch_size groups of n_samples_per_prompt
    version: int  # the weights it was generated with (a trainer step)
    metrics: dict[str, float]
    drawn: list[str]  # every prompt id drawn for it, kept or not (the data position's record)
    data_state: dict  # the data position right after it (what a checkpoint of its step saves)


def generate_rollout(job: JobConfig, trainer, engines, data: PromptSource, rewards: Rewards, step: int,
                     version: int) -> Rollout:
    r = job.rollout
    t0 = time.perf_counter()
    drawn: list[str] = []
    position: dict = {}
    stats = {"tokens": 0, "responses": 0, "reward_time": 0.0, "correct": 0, "truncated": 0, "raw": 0.0}
    before = {**engines.stats, "reward_timeouts": rewards.timeouts}

    def round_(rnd: int) -> list[tuple[list[Response], torch.Tensor]]:
        prompts = data.batch(step, math.ceil(r.rollout_batch_size * r.over_sampling))
        drawn.extend(p.id for p in prompts)
        position.update(data.state())
        groups = sample_groups(job, engines, prompts, r.n_samples_per_prompt, r.temperature, r.top_p,
                               seed=(job.train.seed, step, rnd), version=version, replay=replayed(job))
        t1 = time.perf_counter()
        reward_groups(job, groups, rewards)
        stats["reward_time"] += time.perf_counter() - t1
        for g in groups:
            for x in g:
                stats["tokens"] += x.trained  # the policy's (multi-turn: not the tools')
                stats["responses"] += 1
                stats["correct"] += x.correct
                stats["truncated"] += x.truncated
                stats["raw"] += x.raw
        return filter_scores(groups)

    with generation_phase(job, trainer, engines):
        if r.dynamic_sampling:
            kept, drops = dynamic_filter(round_, r.rollout_batch_size, r.max_rounds)
        else:
            kept, drops = [g for g, _ in round_(0)[: r.rollout_batch_size]], {}
        memory = {} if r.engine != "embedded" else phase_metrics(  # GPUs: the generation phase's memory
            "engine", ray_get_all([e.memory.remote() for e in engines.engine_actors()]))
    seconds = time.perf_counter() - t0
    responses = [x for g in kept for x in g]
    n = max(stats["responses"], 1)
    metrics = {"rollout/raw_reward": stats["raw"] / n, "rollout/accuracy": stats["correct"] / n,
               "rollout/response_len/mean": stats["tokens"] / n, "rollout/truncated_ratio": stats["truncated"] / n,
               "rollout/reward": sum(x.reward for x in responses) / len(responses),
               "rollout/log_probs": sum(float(x.logprobs.sum(dtype=np.float64)) for x in responses)
               / max(1, sum(x.trained for x in responses)),
               "rollout/prompts_drawn": float(len(drawn)),
               "perf/rollout_time": seconds, "perf/reward_time": stats["reward_time"],
               "perf/rollout_tok_per_s": stats["tokens"] / seconds}
    metrics.update({f"rollout/dynamic_filter/{k}": float(v) for k, v in drops.items()} | memory)
    # aborted: responses the engines cut short (an abort, a weight swap), generated again;
    # wrong_weights: responses from weights that are no trainer version, generated again
    after = {**engines.stats, "reward_timeouts": rewards.timeouts}
    metrics.update({f"rollout/{k}": float(after[k] - before[k])
                    for k in ("aborted", "wrong_weights", "reward_timeouts")})
    if r.generate_fn is not None:  # multi-turn: turns and the policy's share of the response tokens
        metrics["rollout/turns/mean"] = sum(x.turns for x in responses) / len(responses)
        metrics["rollout/trained_ratio"] = sum(x.trained for x in responses) / max(1, sum(len(x.ids)
                                                                                          for x in responses))
    return Rollout(step, kept, version, metrics, drawn, position)


def sample_groups(job: JobConfig, engines, prompts: list[Prompt], n: int, temperature: float, top_p: float,
                  seed: tuple, version: int, replay: dict[str, tuple] | None = None) -> list[list[Response]]:
    """n responses per prompt through the router, from the trainer's weights of `version` (the
    manager generates again what the engines abort or answer from other weights than a trainer
    version); each request seeded by (seed, prompt, i), so a resumed run draws the same samples.
    `replay` (replayed(job)): the choices each answer returns for every token."""
    r = job.rollout
    params = {"temperature": temperature, "top_p": top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}
    reqs = requests(prompts, n, params, seed)
    flags = {"routes": "return_routed_experts", "picks": "return_indexer_picks"}
    reqs = [q | {flags[name]: True for name in replay or {}} for q in reqs]
    tok = response_tokenizer(job.data.tokenizer, job.data.template)
    owners = [p for p in prompts for _ in range(n)]
    if r.generate_fn is None:  # each result made compact as it arrives (its JSON lists dropped)
        results = engines.generate(reqs, version=version, each=functools.partial(compact_result, tok, replay=replay))
        flat = [Response(p, **res) for p, res in zip(owners, results, strict=True)]
    else:  # the user's function drives each conversation through the router
        tools = {"tools": r.tools, "tokenizer": tokenizer_path(job.data.tokenizer), "max_len": r.max_len}
        samples = [q | {"label": p.label, "messages": p.messages}
                   | ({**tools, "thinking": p.thinking} if r.tools else {}) for q, p in zip(reqs, owners, strict=True)]
        transcripts = engines.generate_transcripts(samples, r.generate_fn, version=version)
        flat = [transcript_response(p, t, r.max_len, tok, q["id"])
                for p, t, q in zip(owners, transcripts, samples, strict=True)]
    return [flat[k * n:(k + 1) * n] for k in range(len(prompts))]


def requests(prompts: list[Prompt], n: int, params: dict, seed: tuple) -> list[dict]:
    """The /generate requests of n samples per prompt, each with its own id and sampling seed
    from (seed, prompt, i). A prompt drawn again in the same round (a round that crosses into
    the next epoch, or a file smaller than a round) is the same prompt's k-th draw: its ids and
    seeds take a `#k` (the first draw's are unchanged), so its samples are new ones."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        k = seen[p.id] = seen.get(p.id, -1) + 1
        key = p.id if k == 0 else f"{p.id}#{k}"
        out += [{"id": f"{'/'.join(map(str, seed))}/{key}/{i}", "input_ids": p.input_ids, "return_logprob": True,
                 "sampling_params": params | {"seed": _seed(seed, key, i)}} for i in range(n)]
    return out


def replayed(job: JobConfig) -> dict[str, tuple]:
    """The choices the engines return for the trainer to replay, by Response field: (layers,
    slots, dtype) of each token's array."""
    arch, out = job.model.arch, {}
    if job.algo.routing_replay:  # experts of the learned MoE layers
        out["routes"] = (arch.num_hidden_layers - arch.num_hash_layers, arch.num_experts_per_tok, np.int16)
    ratios = [arch.layer_ratio(i) for i in range(arch.num_hidden_layers) if arch.is_csa(arch.layer_ratio(i))]
    if job.algo.indexer_replay and ratios:  # block numbers of the CSA layers' picks: int16 while they fit
        fits = job.rollout.max_len // min(ratios) < 2 ** 15
        out["picks"] = (len(ratios), arch.index_topk, np.int16 if fits else np.int32)
    return out


def compact_result(tok, res: dict, replay: dict[str, tuple] | None = None) -> dict:
    """An engine's /generate result as Response's fields (all but the prompt), arrays instead
    of its JSON lists; `replay` (replayed(job)): its choices for every token it read as
    [tokens, layers, slots] arrays."""
    meta = res["meta_info"]
    out = {"ids": np.asarray(res["output_ids"], dtype=np.int32),
           "logprobs": np.fromiter((x[0] for x in meta["output_token_logprobs"]), np.float32, len(res["output_ids"])),
           "text": response_text(tok, res["output_ids"]), "truncated": meta["finish_reason"]["type"] == "length",
           "version": int(meta["weight_version"])}
    for name, (layers, k, dtype) in (replay or {}).items():
        key = META_KEYS[name]
        if key not in meta:
            raise RolloutError(f"sample {res.get('id')}: algo.{'routing' if name == 'routes' else 'indexer'}_replay "
                               f"asked for each token's choices; the engine's answer has no meta_info.{key}")
        out[name] = decode_choices(meta[key], layers, k).astype(dtype)
    return out


def transcript_response(prompt: Prompt, t, max_len: int, tok, sample_id: str) -> Response:
    """A generate function's Transcript as a Response: what follows the prompt, the policy's
    tokens trained and the environment's not."""
    if t.ids[:len(prompt.input_ids)] != prompt.input_ids or t.prompt_len != len(prompt.input_ids):
        raise RolloutError(f"sample {sample_id}: the generate function's transcript does not start with the prompt")
    if len(t.ids) > max_len:
        raise RolloutError(f"sample {sample_id}: the generate function's transcript has {len(t.ids)} tokens, over "
                           f"rollout.max_len={max_len} (what one training row holds): end the conversation sooner")
    if not len(t.ids) == len(t.loss_mask) == len(t.logprobs):
        raise RolloutError(f"sample {sample_id}: the transcript's ids, loss_mask and logprobs differ in length")
    if not t.weight_versions or None in t.weight_versions:
        raise RolloutError(f"sample {sample_id}: the generate function's transcript has no generated turn with a "
                           "weight version (add turns with Transcript.add_generated)")
    k = t.prompt_len
    ids = t.ids[k:]
    return Response(prompt, ids, t.logprobs[k:], response_text(tok, ids),
                    (t.finish_reason or {}).get("type") == "length", mask=t.loss_mask[k:], turns=t.turns,
                    version=min(int(v) for v in t.weight_versions))


def _seed(seed: tuple, prompt_id: str, i: int) -> int:
    return zlib.crc32(f"{seed}/{prompt_id}/{i}".encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=4)
def response_tokenizer(name: str | None, template: str = "deepseek_v4"):
    """What decodes responses for the reward: data.tokenizer as the prompts were rendered with
    it (template hf: the transformers tokenizer of that directory). Loaded once a run."""
    if template == "hf":
        return load_hf_tokenizer(name)
    return Tokenizer.from_file(str(tokenizer_path(name) or v4_tokenizer_file()))


def response_text(tok, ids: list[int]) -> str:
    """A response's text for the reward and the user's code. One cut at max_new_tokens can end
    inside a character (its last tokens hold the first bytes of a multi-byte UTF-8 sequence,
    which decode to one U+FFFD): that fragment is left out. Invalid bytes inside stay U+FFFD."""
    text = tok.decode(ids, skip_special_tokens=True)
    if text.endswith("\ufffd"):
        for k in range(1, min(3, len(ids)) + 1):  # a character is at most 4 bytes: 3 of them cut off
            shorter = tok.decode(ids[:-k], skip_special_tokens=True)
            if text == shorter + "\ufffd":
                return shorter
    return text


def reward_groups(job: JobConfig, groups: list[list[Response]], rewards: Rewards) -> None:
    """Raw rewards (algo.reward or algo.reward_url), then DAPO's overlong shaping."""
    a = job.algo
    flat = [x for g in groups for x in g]
    raw = rewards([{"response": x.text, "label": x.prompt.label, "prompt": x.prompt.messages} for x in flat])
    for x, v in zip(flat, raw, strict=True):
        x.correct, x.raw, x.reward = v > 0, v, v
        if a.overlong_max_len is not None:
            x.reward += float(overlong_penalty(x.trained, a.overlong_max_len, a.overlong_cache))  # the policy's


def filter_scores(groups: list[list[Response]]) -> list[tuple[list[Response], torch.Tensor]]:
    """What dynamic sampling compares within a group: the raw rewards. DAPO keeps a group
    whose accuracy is strictly between 0 and 1; the overlong shaping would make an all-correct
    group's rewards differ by their lengths alone and keep it."""
    return [(g, torch.tensor([x.raw for x in g])) for g in groups]


def staleness(rollout: Rollout, step: int) -> dict[str, float]:
    """How old the weights were that generated the rollout trained at `step`, measured from what
    each response's engine reported (the trainer's weights after step s are version s):
    rollout/staleness the mean over responses of step - 1 - version, staleness_max the largest;
    rollout/stale_samples the responses generated with other weights than the loop asked for
    (a replaced engine that could not catch up serves older ones)."""
    versions = [x.version for g in rollout.groups for x in g]
    ages = [step - 1 - v for v in versions]
    return {"rollout/staleness": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages)),
            "rollout/stale_samples": float(sum(v != rollout.version for v in versions))}


def write_rollout(run_dir: Path, rollout: Rollout, texts: str | int = "all") -> None:
    """rollouts.jsonl: per step the prompt ids drawn and kept, and the reward and text of the
    responses `texts` asks for (log.rollouts: all, none, or N of them, the same N for a step
    whatever the placement)."""
    responses = [x for g in rollout.groups for x in g]
    if texts == "none":
        responses = []
    elif texts != "all" and len(responses) > texts:
        pick = sorted(random.Random(rollout.step).sample(range(len(responses)), texts))
        responses = [responses[i] for i in pick]
    rec = {"step": rollout.step, "version": rollout.version, "drawn": rollout.drawn,
           "kept": [g[0].prompt.id for g in rollout.groups],
           "samples": [{"prompt": x.prompt.id, "reward": x.reward, "text": x.text, "turns": x.turns,
                        "trained_tokens": x.trained} for x in responses]}
    with open(run_dir / records.ROLLOUTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
