"""JSON-lines record files of a run directory (metrics.jsonl, alignment.jsonl): read back
with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path

ROLLOUTS = "rollouts.jsonl"  # RL: per rollout, the prompt ids drawn and kept, and the sample rewards
FAILED = "failed.txt"  # why the run stopped, when it failed


def record_failure(run_dir: Path, why: str) -> Path | None:
    """<run_dir>/failed.txt: why a run stopped (the run directory alone said nothing: a config,
    an empty metrics.jsonl); only where the run got as far as making its directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    (run_dir / FAILED).write_text(why.rstrip() + "\n")
    return run_dir / FAILED


def read(path: Path, required: set[str], kind: str) -> list[dict]:
    """Every line of `path` as a dict holding the `required` keys, in order."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        missing = required - set(rec if isinstance(rec, dict) else {})
        if missing:
            raise ValueError(f"{path}:{i}: not {kind} (missing {sorted(missing)})")
        out.append(rec)
    return out


def truncate(path: Path, last_step: int) -> int:
    """Drop the records after `last_step` (a run resumed from that checkpoint redoes them; a
    torn last line from a killed run goes too). Returns how many were dropped."""
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
            keep.append(line)
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    tmp.replace(path)
    return dropped
