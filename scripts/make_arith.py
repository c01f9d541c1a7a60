"""Write the bundled arithmetic task of the RL demo (miles/data/bundled/arith/), deterministically.

    python scripts/make_arith.py            # rewrite the files (they are committed)
    python scripts/make_arith.py --check    # exit 1 if a rerun would change them

A verifiable task a tiny model can learn in minutes on a CPU: "Which is larger: 37 or 82?" or
"Which is smaller: ...?" (two different numbers in 0..19), answered "Answer: N" (DAPO's verifier
format). The answer is copied from the question, so a short SFT gets the format and part of the
comparison; RL has room to improve it.
- sft.jsonl: conversations for the short SFT warm start (jobs/dapo_tiny_sft.yaml);
- train.jsonl: RL prompts with their labels (`prompt`, `label`);
- eval.jsonl: held-out prompts, none of which appears in the other two files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "miles" / "data" / "bundled" / "arith"
WORDS = {"larger": max, "smaller": min}


def question(r: random.Random) -> tuple[str, int]:
    a, b = r.sample(range(20), 2)
    word = r.choice(sorted(WORDS))
    return f"Which is {word}: {a} or {b}?", WORDS[word](a, b)


def files() -> dict[str, str]:
    r = random.Random(0)
    held = {}
    while len(held) < 64:
        q, v = question(r)
        held[q] = v
    sft, rl = [], []
    while len(sft) < 3000 or len(rl) < 3000:
        q, v = question(r)
        if q in held:
            continue
        if len(sft) < 3000:
            sft.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"Answer: {v}"}]})
        else:
            rl.append({"prompt": q, "label": str(v)})
    ev = [{"prompt": q, "label": str(v)} for q, v in held.items()]
    jsonl = lambda rows: "".join(json.dumps(x) + "\n" for x in rows)
    return {"sft.jsonl": jsonl(sft), "train.jsonl": jsonl(rl), "eval.jsonl": jsonl(ev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed files differ from a rerun")
    args = ap.parse_args()
    stale = []
    for name, text in files().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path} ({len(text):,} bytes)")
    if stale:
        print("stale (rerun scripts/make_arith.py): " + ", ".join(stale), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
