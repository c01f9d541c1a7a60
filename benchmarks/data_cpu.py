"""The SFT data path on one core against the training step it feeds.

    .venv/bin/python benchmarks/data_cpu.py [--rows 1000] [--repeats 3]

Data path: JSONL rows -> parse -> DeepSeek's renderer + the real V4 tokenizer with loss masks
(miles.data.sft.row_samples) -> packing into rows of 4,096 positions and the data-parallel
partition (miles.train.batching), on two datasets: the bundled tiny chat data (short
arithmetic dialogues, a tenth with tool definitions) and long-form conversations made here
(three turns of ~250-word answers, thinking on, so each sample is the last turn). One core:
torch, tokenizers and the recipe's Rust code are held to one thread.

Baseline, same process: a training step of the ~50M config (small_50m, fp32, forward +
backward + AdamW, 1 x 512 tokens, one thread). Medians of --repeats.
"""

from __future__ import annotations

import os

os.environ.update(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from miles.config import DataConfig  # noqa: E402
from miles.data.chat import load_tokenizer  # noqa: E402
from miles.data.dataset import iter_rows  # noqa: E402
from miles.data.sft import row_samples  # noqa: E402
from miles.train.batching import packed_replica_micro_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the model reads each token and predicts the next one so that training on chat data teaches it "
         "to answer questions with care about numbers tools and reasoning steps in many languages").split()


def long_rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    text = lambda k: " ".join(r.choice(WORDS) for _ in range(k)).capitalize() + "."
    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text(30)}]
        for _ in range(3):
            msgs += [{"role": "user", "content": text(40)},
                     {"role": "assistant", "content": text(250), "reasoning_content": text(120)}]
        rows.append({"thinking": True, "messages": msgs})
    return rows


def data_path(path: Path, cfg: DataConfig, tok, seq: int, dp: int = 8) -> tuple[int, int, float]:
    """(conversations, tokens, seconds) for the whole file through the data path."""
    t0 = time.perf_counter()
    samples = [s for row in iter_rows(path) for s in row_samples(row, cfg, tok, seq)]
    for i in range(0, len(samples) - 63, 64):  # global batches of 64 conversations
        packed_replica_micro_batches(samples[i:i + 64], dp, 1, seq)
    return len(samples), sum(len(s.tokens) for s in samples), time.perf_counter() - t0


def train_rate(repeats: int) -> float:
    """Tokens/s of a small_50m training step (fp32, 1 x 512, forward+backward+AdamW)."""
    from miles.train import losses
    from miles.train.batching import MicroBatch
    from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

    cfg = DeepSeekV4Config.small_50m()
    model = DeepSeekV4ForCausalLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, 513))
    mb = MicroBatch.lm(ids[:, :-1], ids[:, 1:])
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        _, res = losses.compute(model, mb)
        res.loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return 512 / statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000, help="conversations per dataset")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer()
    tmp = Path(tempfile.mkdtemp())
    bundled = (ROOT / "miles/data/bundled/chat_tiny/train.jsonl").read_text().splitlines()[:args.rows]
    (tmp / "tiny.jsonl").write_text("\n".join(bundled) + "\n")
    (tmp / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long_rows(args.rows)))
    seq = 4096
    results = {}
    for name, effort in (("tiny", "low"), ("long", "high")):
        cfg = DataConfig(source="chat", path=str(tmp / f"{name}.jsonl"), seq_len=seq, reasoning_effort=effort)
        runs = [data_path(tmp / f"{name}.jsonl", cfg, tok, seq) for _ in range(args.repeats)]
        n, tokens, _ = runs[0]
        secs = statistics.median(r[2] for r in runs)
        results[name] = (n, tokens, secs)
    base = train_rate(args.repeats)
    print(f"one core; {args.rows} conversations per dataset; medians of {args.repeats}\n")
    print("| dataset | tokens/conv | conv/s | tokens/s | vs small_50m train step (1 core) |")
    print("|---|---|---|---|---|")
    for name, (n, tokens, secs) in results.items():
        print(f"| {name} | {tokens / n:,.0f} | {n / secs:,.0f} | {tokens / secs:,.0f} | {tokens / secs / base:,.0f}x |")
    print(f"| small_50m train step, fp32, 1 x 512 | | | {base:,.1f} | 1x |")


if __name__ == "__main__":
    main()
