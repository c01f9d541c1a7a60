"""Rows of a dataset on disk, streamed one at a time: JSONL or Parquet, given as a file, a
directory of shards, or a glob. Nothing is loaded whole.

Parquet is read with pyarrow, a record batch at a time (a `messages` or `tools` column may be
a list of structs or a JSON string). JSONL is read a line at a time and each line parsed on
its own: a malformed line is then one bad row with its line number, where pyarrow's JSON
reader would reject its whole block and force one schema on nested chat data (tool
arguments and JSON schemas differ from row to row).

Every row carries its file and 1-based row number (the line number for JSONL), so whatever
rejects it later can say where it is.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".parquet")
JSON_COLUMNS = ("messages", "tools")  # Parquet may hold these as JSON text


class DataError(ValueError):
    """The data cannot feed the job (a bad row under on_bad_row: error, nothing usable left)."""


class BadRow(DataError):
    """A row that cannot be a training sample: its file, row number and why."""

    def __init__(self, file: str, row: int, reason: str):
        super().__init__(f"{file}:{row}: {reason}")
        self.file, self.row, self.reason = file, row, reason

    def record(self) -> dict:
        return {"file": self.file, "row": self.row, "reason": self.reason}


@dataclass(frozen=True)
class Row:
    file: str
    row: int  # 1-based (the line number in a JSONL file)
    record: Any  # the parsed row (a dict, unless the file holds something else)
    error: str | None = None  # set when the row could not even be parsed

    def bad(self, reason: str) -> BadRow:
        return BadRow(self.file, self.row, reason)


def dataset_files(spec: str | Path) -> list[Path]:
    """The shards of a dataset, in a fixed (sorted) order: the file itself, the .jsonl and
    .parquet files of a directory, or the matches of a glob."""
    text = str(spec)
    path = Path(text)
    if path.is_file():
        found = [path]
    elif path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
        if not found:
            raise FileNotFoundError(f"{spec}: a directory with no .jsonl or .parquet files")
    elif glob.has_magic(text):
        found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"{spec}: the pattern matches no files")
    else:
        raise FileNotFoundError(f"{spec}: no such file or directory")
    odd = [str(p) for p in found if p.suffix not in SUFFIXES]
    if odd:
        raise ValueError(f"{spec}: {', '.join(odd[:3])}: not .jsonl or .parquet")
    return found


def iter_rows(spec: str | Path, batch_rows: int = 1024) -> Iterator[Row]:
    """Every row of the dataset, shard by shard, in order."""
    for path in dataset_files(spec):
        yield from (_jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path, batch_rows))


def _jsonl_rows(path: Path) -> Iterator[Row]:
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Row(str(path), n, json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield Row(str(path), n, None, f"malformed JSON ({e})")


def _parquet_rows(path: Path, batch_rows: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses for broken files
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    n = 0
    batches = reader.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a corrupt page or column chunk past the footer
            raise DataError(f"{path}: Parquet data unreadable after row {n} ({type(e).__name__}: {e})") from None
        if batch is None:
            return
        for rec in batch.to_pylist():
            n += 1
            try:
                yield Row(str(path), n, {k: _from_parquet(k, v) for k, v in rec.items()})
            except json.JSONDecodeError as e:
                yield Row(str(path), n, None, f"malformed JSON in a column ({e})")


def _from_parquet(column: str, value: Any) -> Any:
    """Parquet structs have every field of the column's schema: drop the absent (null) ones,
    so a message reads as the JSON object it was written from."""
    if column in JSON_COLUMNS and isinstance(value, str):
        return json.loads(value)
    return _drop_nulls(value)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value
