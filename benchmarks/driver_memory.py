"""What one rollout's per-token data costs the RL driver: synthetic engine results (as the
router returns them) made into Responses and training samples the way miles/rl/ does
(`compact_result`, `to_samples`: arrays), against the same data held as Python lists (what the
driver held before: ids, log-probs, then the samples' tokens, mask and three per-token value
lists). Memory is what tracemalloc counts as live after each build (numpy reports its buffers
to it), per token and extrapolated to a V4-Flash-sized rollout.

    .venv/bin/python benchmarks/driver_memory.py [--responses 512] [--tokens 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.config import load_job  # noqa: E402
from miles.data.prompts import Prompt  # noqa: E402
from miles.data.sample import Sample  # noqa: E402
from miles.rl.rollout import Response, compact_result, response_tokenizer  # noqa: E402
from miles.rl.train import to_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLASH = 8192 * 8192  # responses x tokens of a V4-Flash-sized rollout (8,192 responses of 8k tokens)


def results(n: int, tokens: int, seed: int):
    """n engine results of `tokens` tokens each, one at a time, as the router's JSON decodes."""
    rng = random.Random(seed)
    for i in range(n):
        ids = [rng.randrange(3, 500) for _ in range(tokens)]
        yield {"id": f"s{i}", "output_ids": ids,
               "meta_info": {"output_token_logprobs": [[-rng.random(), t, None] for t in ids],
                             "finish_reason": {"type": "length"}, "weight_version": 3}}


def as_lists(job, prompt: Prompt, n: int, tokens: int, seed: int) -> list:
    """The list representation: per response its ids and log-probs, then per sample the
    tokens, mask and three value lists (advantages, rollout log-probs, weights)."""
    out = []
    p = len(prompt.input_ids)
    for res in results(n, tokens, seed):
        ids = res["output_ids"]
        lps = [x[0] for x in res["meta_info"]["output_token_logprobs"]]
        mask = [1] * len(ids)
        out.append((ids, lps, Sample(prompt.input_ids + ids, [0] * p + mask, values={
            "advantages": [0.0] * p + [0.5 * m for m in mask], "rollout_logprobs": [0.0] * p + lps,
            "token_weights": [0.0] * p + [1e-4 * m for m in mask]})))
    return out


def as_arrays(job, prompt: Prompt, n: int, tokens: int, seed: int) -> list:
    tok = response_tokenizer("tiny")
    flat = [Response(prompt, **compact_result(tok, res)) for res in results(n, tokens, seed)]
    for i, x in enumerate(flat):
        x.reward = float(i % 2)
    return [flat, to_samples(job, [flat[k:k + 8] for k in range(0, n, 8)])]


def measure(build, *args) -> tuple[float, float]:
    """(bytes live after build, seconds)."""
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    kept = build(*args)
    seconds = time.perf_counter() - t0
    gc.collect()
    live, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return live, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.responses % 8:
        ap.error("--responses must be a multiple of 8 (groups of 8 samples)")
    room = a.tokens + 128
    job = load_job(ROOT / "jobs" / "dapo_tiny.yaml", [
        "rollout.n_samples_per_prompt=8", f"rollout.rollout_batch_size={a.responses // 8}",
        f"train.global_batch_size={a.responses}", f"rollout.max_new_tokens={a.tokens}", f"rollout.max_len={room}",
        f"data.seq_len={room}"])
    prompt = Prompt("p:0", list(range(3, 67)), "1", [])
    n_tok = a.responses * a.tokens
    rows = {}
    for name, build in (("Python lists (before)", as_lists), ("arrays (miles/rl/)", as_arrays)):
        runs = [measure(build, job, prompt, a.responses, a.tokens, seed) for seed in range(a.repeats)]
        rows[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    print(f"{a.responses} responses x {a.tokens} tokens ({n_tok:,} tokens), median of {a.repeats}")
    print(f"{'representation':<24} {'MB live':>9} {'bytes/token':>12} {'8,192 x 8k (GB)':>16} {'build s':>8}")
    base = None
    for name, (live, s) in rows.items():
        per = live / n_tok
        base = base or per
        print(f"{name:<24} {live / 2**20:>9.1f} {per:>12.1f} {per * FLASH / 1e9:>16.1f} {s:>8.2f}")
    print(f"arrays / lists: {list(rows.values())[1][0] / list(rows.values())[0][0]:.3f} of the memory")


if __name__ == "__main__":
    main()
