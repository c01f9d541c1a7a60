"""JSON-lines record files of a run directory (metrics.jsonl, alignment.jsonl): read back
with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path


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
