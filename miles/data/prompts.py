"""The RL prompt source: dataset rows -> rendered prompts with the label their reward checks.

A row holds its prompt as `prompt`: a string (one user message) or a list of messages
(DAPO-Math-17k's layout), and its label as `label` or `reward_model.ground_truth`. The
prompt is rendered as the model sees it before its answer: DeepSeek-V4's encoding (or the
tokenizer's chat template) ending in the assistant's header. Shuffling, the held-out split,
bad-row handling and the data position in checkpoints are the SFT source's (miles.data.sft).
"""

from __future__ import annotations

from dataclasses import dataclass

import deepseek_recipe as dr

from miles.data.chat import ChatFormatError, _encoding, to_messages, tool_definitions
from miles.data.dataset import Row
from miles.data.sft import SFTSource


@dataclass(frozen=True)
class Prompt:
    id: str  # "file:row", unique within a dataset (checkpoints and logs compare them)
    input_ids: list[int]
    label: str
    messages: list[dict]
    thinking: bool = False  # the mode it was rendered in (a row's own, else data.thinking)


def prompt_ids(messages: list[dict], tokenizer, template: str = "deepseek_v4", thinking: bool = False,
               reasoning_effort: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """The tokens of `messages` followed by the assistant's generation header; `tools`: the
    OpenAI schemas of the tools the model may call (rendered in the V4 system prompt)."""
    if template == "hf":
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, tools=tools))
    enc, _ = _encoding(tokenizer)
    msgs, _ = to_messages(messages + [{"role": "assistant", "content": "x"}], thinking)
    return enc.encode(dr.Conversation(msgs[:-1], thinking_mode=thinking, tools=tool_definitions(tools),
                                      reasoning_effort=reasoning_effort if thinking else None))


def row_prompt(row: Row, data, tokenizer, max_tokens: int, tools: list[dict] | None = None) -> Prompt:
    if row.error:
        raise row.bad(row.error)
    rec = row.record
    if not isinstance(rec, dict):
        raise row.bad(f"expected a JSON object, got {type(rec).__name__}")
    prompt = rec.get("prompt")
    if isinstance(prompt, str) and prompt:
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        messages = prompt
    else:
        raise row.bad(f"'prompt' must be a non-empty string or list of messages; the row has {sorted(rec)[:8]}")
    label = rec.get("label", (rec.get("reward_model") or {}).get("ground_truth")
                    if isinstance(rec.get("reward_model"), dict) else None)
    if isinstance(label, int | float) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str) or not label:
        raise row.bad("no label: 'label' or 'reward_model.ground_truth' must be a non-empty string")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") not in ("user", "tool"):
        raise row.bad("the prompt's last message must be a user (or tool) message")
    thinking = rec.get("thinking", data.thinking)
    if not isinstance(thinking, bool):
        raise row.bad(f"'thinking' must be true or false, got {thinking!r}")
    try:
        ids = prompt_ids(messages, tokenizer, data.template, thinking,
                         rec.get("reasoning_effort", data.reasoning_effort), tools)
    except ChatFormatError as e:
        raise row.bad(str(e)) from None
    if len(ids) > max_tokens:
        raise row.bad(f"the prompt has {len(ids)} tokens; rollout.max_len - rollout.max_new_tokens allows "
                      f"{max_tokens}")
    return Prompt(f"{row.file.rsplit('/', 1)[-1]}:{row.row}", ids, label, messages, thinking)


class PromptSource(SFTSource):
    """Prompts in a seeded streaming-shuffle order, epoch after epoch (`batch(step, n)`), the
    held-out prompts (`eval_samples()`), the data position (`state()` / `load_state()`)."""

    name = "prompts"

    def __init__(self, data, seed: int, max_tokens: int, run_dir=None, report=print, tools: list[dict] | None = None):
        """`tools`: the schemas of rollout.tools, rendered into every prompt."""
        self.max_tokens, self.tools = max_tokens, tools
        super().__init__(data, seed, run_dir, report)

    def row_items(self, row: Row) -> list[Prompt]:
        return [row_prompt(row, self.data, self.tokenizer, self.max_tokens, self.tools)]
