"""`miles` command line: thin dispatch to the jobs."""

from __future__ import annotations

import sys

COMMANDS = {"demo": "miles.demo", "check-alignment": "miles.observe.alignment"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: miles {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
