"""Write the bundled arithmetic task of the RL demo (miles/data/bundled/arith/), deterministically.

    python scripts/make_arith.py            # rewrite the files (they are committed)
    python scripts/make_arith.py --check    # exit 1 if a rerun would change them

A verifiable task a tiny model can learn in minutes on a CPU: "Which is larger: 37 or 82?" or
"Which is smaller: ...?" (two different numbers in 0..19), answered "Answer: N" (DAPO's verifier
format). The answer is copied from the question, so a short SFT gets the format and part of the
comparison; RL has room to improve it.
- sft.jsonl: conversations for the short SFT warm start (jobs/dapo_tiny_sft.yaml);
- train.jsonl: RL prompts with their labels (`prompt`, `label`);
- eval.jsonl: held-out prompts, none of which appears in the other two files;
- sft_eval.jsonl: the same held-out prompts as conversations (the SFT stage's held-out loss).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bundled_files import write_or_check

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
    chat = lambda q, v: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"Answer: {v}"}]}
    sft, rl = [], []
    while len(sft) < 3000 or len(rl) < 3000:
        q, v = question(r)
        if q in held:
            continue
        if len(sft) < 3000:
            sft.append(chat(q, v))
        else:
            rl.append({"prompt": q, "label": str(v)})
    ev = [{"prompt": q, "label": str(v)} for q, v in held.items()]
    jsonl = lambda rows: "".join(json.dumps(x) + "\n" for x in rows)
    return {"sft.jsonl": jsonl(sft), "train.jsonl": jsonl(rl), "eval.jsonl": jsonl(ev),
            "sft_eval.jsonl": jsonl(chat(q, v) for q, v in held.items())}


def main() -> None:
    write_or_check(__doc__, OUT, files, "scripts/make_arith.py")


if __name__ == "__main__":
    main()
