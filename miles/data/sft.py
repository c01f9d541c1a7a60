"""The SFT data source: dataset rows -> tokenized, loss-masked samples, shuffled, streamed.

    rows (miles.data.dataset) -> row_samples (miles.data.chat) -> shuffle buffer -> batch(step, n)

A row holds a conversation as `messages` (OpenAI-style; see miles.data.chat) or as `prompt`
and `response` (plus an optional `system`), and may set its own `thinking`, `tools` and
`reasoning_effort` (else the job's data.* settings apply). A row that cannot be a sample
(malformed JSON, no messages, an unknown role, an empty assistant turn, longer than
data.seq_len, ...) is reported with its file, row number and reason, written to
<run_dir>/skipped_rows.jsonl and counted (data/skipped_rows), or, with data.on_bad_row:
error, fails the job.

The held-out split: the rows of data.eval_path, or else the first data.eval_size usable rows
of the training data (which training then never sees).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

from miles.data.chat import (
    ChatFormatError,
    ReasoningEffort,
    conversation_samples,
    hf_conversation_sample,
    load_hf_tokenizer,
    load_tokenizer,
    v4_tokenizer_file,
)
from miles.data.dataset import BadRow, DataError, Row, iter_rows
from miles.data.sample import Sample

REASONING_EFFORTS = get_args(ReasoningEffort)
BUNDLED = Path(__file__).resolve().parent / "bundled"


def tokenizer_path(name: str | None) -> str | None:
    """data.tokenizer: None (DeepSeek-V4's own), "tiny" (the bundled 512-id BPE) or a tokenizer.json."""
    return str(BUNDLED / "tiny_tokenizer.json") if name == "tiny" else name


def copy_tokenizer(name: str | None, template: str, out: Path) -> Path | None:
    """The job's tokenizer into an HF directory `out` as tokenizer.json (data.tokenizer: the
    bundled tiny one, a file, DeepSeek-V4's by default; a transformers directory with template
    hf: its tokenizer files), so the weights serve text without the job. Returns the file."""
    import shutil

    src = Path(tokenizer_path(name)) if name is not None else v4_tokenizer_file()
    if src.is_dir():  # template hf: a transformers tokenizer directory
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (src / f).is_file():
                shutil.copyfile(src / f, Path(out) / f)
        return Path(out) / "tokenizer.json" if (src / "tokenizer.json").is_file() else None
    shutil.copyfile(src, Path(out) / "tokenizer.json")
    return Path(out) / "tokenizer.json"


def vocab_size(path: str | None, template: str = "deepseek_v4") -> int:
    """Ids the tokenizer can produce (its added tokens included)."""
    if template == "hf":
        return len(load_hf_tokenizer(path))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path or v4_tokenizer_file())).get_vocab_size(with_added_tokens=True)


def row_messages(row: Row) -> list[dict]:
    rec = row.record
    if not isinstance(rec, dict):
        raise row.bad(f"expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        return rec["messages"]
    if "prompt" in rec or "response" in rec:
        for key in ("prompt", "response") + (("system",) if "system" in rec else ()):
            if not isinstance(rec.get(key), str) or not rec[key]:
                raise row.bad(f"'{key}' must be a non-empty string")
        system = [{"role": "system", "content": rec["system"]}] if "system" in rec else []
        return system + [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["response"]}]
    raise row.bad(f"no 'messages' column (nor 'prompt' and 'response'); the row has {sorted(rec)[:8]}")


def row_samples(row: Row, data, tokenizer, max_positions: int) -> list[Sample]:
    """The samples of one row under the job's data settings; BadRow if it cannot be one."""
    if row.error:
        raise row.bad(row.error)
    messages = row_messages(row)
    rec = row.record
    thinking = rec.get("thinking", data.thinking)
    effort = rec.get("reasoning_effort", data.reasoning_effort)
    if not isinstance(thinking, bool):
        raise row.bad(f"'thinking' must be true or false, got {thinking!r}")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise row.bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise row.bad(f"'tools' must be a list of tool definitions, got {type(tools).__name__}")
    try:
        if data.template == "hf":
            pairs = [hf_conversation_sample(messages, tokenizer, thinking, tools)]
        else:
            pairs = conversation_samples(messages, tokenizer, thinking, tools, data.thinking_turns, effort)
    except ChatFormatError as e:
        raise row.bad(str(e)) from None
    out = []
    for k, (ids, mask) in enumerate(pairs):
        if len(ids) - 1 > max_positions:
            raise row.bad(f"{len(ids)} tokens, longer than data.seq_len={max_positions} positions (+1)")
        out.append(Sample(ids, mask, origin=f"{Path(row.file).name}:{row.row}" + (f"#{k}" if len(pairs) > 1 else "")))
    return out


class SFTSource:
    """Training samples in a seeded streaming-shuffle order, epoch after epoch; a held-out
    split for data.eval_size / data.eval_path. `report(text)` shows each skipped row."""

    name = "sft"

    def __init__(self, data, seed: int, run_dir: Path | None = None, report: Callable[[str], None] = print):
        """`data`: a validated DataConfig (the job's validation checked the tokenizer's ids
        against the model's vocabulary)."""
        self.data, self.seed, self.report = data, seed, report
        path = tokenizer_path(data.tokenizer)
        self.tokenizer = load_hf_tokenizer(path) if data.template == "hf" else load_tokenizer(path)
        self.skipped, self.seen = 0, set()  # bad rows reported (each once, whatever the epoch)
        self.skip_path = run_dir / "skipped_rows.jsonl" if run_dir is not None else None
        self.skip_log = None  # opened at the first skipped row
        self.held_out = self._eval_samples()
        self.epoch, self._stream, self._epoch_used = 0, self._shuffled(0), False
        self.consumed = 0  # samples drawn from this epoch's stream

    # ------------------------------------------------------------------ rows -> samples
    def row_items(self, row: Row) -> list:
        """What one row gives (BadRow if nothing): its training samples."""
        return row_samples(row, self.data, self.tokenizer, self.data.seq_len)

    def _samples(self, spec: str, skip_rows: int = 0) -> Iterator[tuple[Row, list[Sample]]]:
        usable = 0
        for row in iter_rows(spec):
            try:
                samples = self.row_items(row)
            except BadRow as e:
                self._bad(e)
                continue
            usable += 1
            if usable > skip_rows:
                yield row, samples

    def _bad(self, e: BadRow) -> None:
        if self.data.on_bad_row == "error":
            raise e
        if (e.file, e.row) in self.seen:
            return
        self.seen.add((e.file, e.row))
        self.skipped += 1
        self.report(f"skipped row {e}")
        if self.skip_path is not None:
            self.skip_log = self.skip_log or self.skip_path.open("a")
            self.skip_log.write(json.dumps(e.record()) + "\n")
            self.skip_log.flush()

    def _eval_samples(self) -> list[Sample]:
        d = self.data
        if d.eval_path:
            rows = self._samples(d.eval_path)
        elif d.eval_size:
            rows = self._samples(d.path)
        else:
            return []
        take = d.eval_size or None
        out = [s for _, samples in itertools.islice(rows, take) for s in samples]
        if not out:
            raise DataError(f"{d.eval_path or d.path}: no usable rows for the held-out split")
        return out

    def _shuffled(self, epoch: int) -> Iterator[Sample]:
        """One epoch's samples: a buffer of data.shuffle_buffer samples, each drawn at a
        seeded random slot (0: file order)."""
        held = 0 if self.data.eval_path else self.data.eval_size
        stream = (s for _, samples in self._samples(self.data.path, skip_rows=held) for s in samples)
        size = self.data.shuffle_buffer
        if size <= 1:
            yield from stream
            return
        rng = random.Random(self.seed * 1_000_003 + epoch)
        buf: list[Sample] = []
        for s in stream:
            if len(buf) < size:
                buf.append(s)
                continue
            i = rng.randrange(size)
            buf[i], s = s, buf[i]
            yield s
        rng.shuffle(buf)
        yield from buf

    # ------------------------------------------------------------------ the source's interface
    def batch(self, step: int, n: int) -> list[Sample]:
        """The next `n` training samples (the next epoch begins when one runs out)."""
        out: list[Sample] = []
        while len(out) < n:
            s = next(self._stream, None)
            if s is not None:
                out.append(s)
                self._epoch_used, self.consumed = True, self.consumed + 1
                continue
            if not self._epoch_used:  # a whole epoch without one sample would loop forever
                held = "" if self.data.eval_path or not self.data.eval_size else \
                    f" after the {self.data.eval_size} held out"
                raise DataError(f"{self.data.path}: no usable training rows{held} ({self.skipped} skipped)")
            self.epoch += 1
            self._stream, self._epoch_used, self.consumed = self._shuffled(self.epoch), False, 0
        return out

    def state(self) -> dict:
        """The data position, for a checkpoint: epoch, samples drawn in it, shuffle seed, and
        the bad rows already reported (so a resume neither repeats nor re-counts them)."""
        return {"source": self.name, "seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "epoch_used": self._epoch_used, "skipped": self.skipped, "seen": sorted(self.seen)}

    def load_state(self, state: dict) -> None:
        """Continue where `state` was taken: the same epoch's shuffle, its first `consumed`
        samples drawn again and dropped (streaming sources cannot seek)."""
        if state.get("source") != self.name or state.get("seed") != self.seed:
            raise DataError(f"the checkpoint's data position is for source {state.get('source')!r} with seed "
                            f"{state.get('seed')!r}; this job has {self.name!r} with train.seed {self.seed}")
        self.skipped, self.seen = state["skipped"], {tuple(x) for x in state["seen"]}
        self.epoch, self._stream = state["epoch"], self._shuffled(state["epoch"])
        for i in range(state["consumed"]):
            if next(self._stream, None) is None:
                raise DataError(f"{self.data.path}: the checkpoint was {state['consumed']} samples into epoch "
                                f"{self.epoch}, the data now has {i}: it changed since the checkpoint")
        self.consumed, self._epoch_used = state["consumed"], state["epoch_used"]

    def metrics(self) -> dict[str, float]:
        return {"data/skipped_rows": float(self.skipped), "data/epoch": float(self.epoch)}

    def eval_samples(self) -> list[Sample]:
        return self.held_out

    def close(self) -> None:
        if self.skip_log is not None:
            self.skip_log.close()
