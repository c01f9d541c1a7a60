"""Write the bundled tiny chat data and its tokenizer (miles/data/bundled/), deterministically.

    python scripts/make_tiny_chat.py            # rewrite the files (they are committed)
    python scripts/make_tiny_chat.py --check    # exit 1 if a rerun would change them

The conversations are small arithmetic dialogues in every shape SFT must handle: a system
prompt, several turns that depend on earlier ones, thinking turns (`reasoning_content`),
tool definitions, tool calls and their results, and context-only turns (`loss: false`). A
tiny model learns their format and much of their arithmetic in a few hundred CPU steps.

The tokenizer is a byte-level BPE (the `tokenizers` library) of 512 ids trained on the
conversations as DeepSeek's recipe renders them, with V4's special tokens (every
`deepseek_recipe.SpecialToken`) as single ids, so the recipe encodes through it exactly as
through the real V4 tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import deepseek_recipe as dr
from bundled_files import write_or_check
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parent.parent / "miles" / "data" / "bundled"
VOCAB = 512
SPECIAL = [getattr(dr.SpecialToken, n).default_str() for n in (
    "Bos", "Eos", "User", "Assistant", "System", "ThinkingStart", "ThinkingEnd", "Dsml", "LatestReminder",
    "Image", "Box", "BoxEnd", "Point", "PointEnd", "Polygon", "PolygonEnd", "Ref", "RefEnd")]
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    for name, desc in (("add", "Add two integers."), ("mul", "Multiply two integers."))]
SYSTEMS = ["You are a careful calculator.", "Answer with the number and a short sentence.", "Be brief."]
OPS = {"+": ("add", lambda a, b: a + b, "plus"), "*": ("mul", lambda a, b: a * b, "times")}


def _question(r: random.Random) -> tuple[int, str, int]:
    a, b, op = r.randint(0, 20), r.randint(0, 20), r.choice("+*")
    return a, op, b


def chat(r: random.Random) -> dict:
    """Multi-turn: each follow-up applies an operation to the previous answer."""
    msgs = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.5 else []
    a, op, b = _question(r)
    value = OPS[op][1](a, b)
    msgs += [{"role": "user", "content": f"What is {a} {op} {b}?"},
             {"role": "assistant", "content": f"{a} {op} {b} = {value}."}]
    for _ in range(r.randint(0, 2)):
        op, k = r.choice("+*"), r.randint(1, 9)
        new = OPS[op][1](value, k)
        msgs += [{"role": "user", "content": f"And {OPS[op][2]} {k}?"},
                 {"role": "assistant", "content": f"{value} {op} {k} = {new}."}]
        value = new
    if len(msgs) > 3 and r.random() < 0.3:  # the first answer is context only
        msgs[[m["role"] for m in msgs].index("assistant")]["loss"] = False
    return {"messages": msgs}


def thinking(r: random.Random) -> dict:
    a, op, b = _question(r)
    value = OPS[op][1](a, b)
    reasoning = f"I need {a} {OPS[op][2]} {b}. {a} {op} {b} = {value}."
    return {"thinking": True, "messages": [
        {"role": "user", "content": f"Think, then answer: {a} {op} {b}?"},
        {"role": "assistant", "reasoning_content": reasoning, "content": f"The answer is {value}."}]}


def tool_use(r: random.Random) -> dict:
    a, op, b = _question(r)
    name, fn, word = OPS[op]
    value = fn(a, b)
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}
    msgs = [{"role": "system", "content": "Use the tools for arithmetic."},
            {"role": "user", "content": f"Use a tool: {a} {word} {b}."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
            {"role": "assistant", "content": f"The tool says {a} {op} {b} = {value}."}]
    row = {"tools": TOOLS, "messages": msgs}
    if r.random() < 0.5:  # thinking with tools: every turn keeps its reasoning
        row["thinking"] = True
        msgs[2]["reasoning_content"] = f"Call {name} with {a} and {b}."
        msgs[4]["reasoning_content"] = f"The tool returned {value}."
    return row


def conversations(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    return [r.choices([chat, thinking, tool_use], weights=[6, 3, 1])[0](r) for _ in range(n)]


def rendered(rows: list[dict]) -> list[str]:
    """The recipe's text of each conversation (for the tokenizer's merges)."""
    from miles.data.chat import to_messages, tool_definitions

    enc = dr.DeepseekV4Encoding()
    out = []
    for row in rows:
        msgs, _ = to_messages(row["messages"], row.get("thinking", False))
        conv = dr.Conversation(msgs, thinking_mode=row.get("thinking", False), tools=tool_definitions(row.get("tools")),
                               reasoning_effort="low")  # as jobs/sft_tiny.yaml renders them
        out.append(enc.render_conversation(conv).prompt)
    return out


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def files() -> dict[str, str]:
    train, evaluation = conversations(3000, seed=1), conversations(64, seed=2)
    jsonl = lambda rows: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    tok = train_tokenizer(rendered(train))
    return {"chat_tiny/train.jsonl": jsonl(train), "chat_tiny/eval.jsonl": jsonl(evaluation),
            "tiny_tokenizer.json": tok.to_str(pretty=True) + "\n"}


def main() -> None:
    write_or_check(__doc__, OUT, files, "scripts/make_tiny_chat.py")


if __name__ == "__main__":
    main()
