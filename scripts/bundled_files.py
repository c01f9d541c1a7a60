"""The command line both bundled-data scripts share: write the files, or --check that the
committed ones are what a rerun would write."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def write_or_check(doc: str, out: Path, files: Callable[[], dict[str, str]], script: str) -> None:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed files differ from a rerun")
    args = ap.parse_args()
    stale = []
    for name, text in files().items():
        path = out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path} ({len(text):,} bytes)")
    if stale:
        print(f"out of date (rerun {script}): " + ", ".join(stale), file=sys.stderr)
        raise SystemExit(1)
