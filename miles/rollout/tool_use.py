"""The built-in generate function for DeepSeek-V4 tool use (`rollout.tools`).

Each turn the policy generates; its output is parsed with deepseek-recipe's stream processor
(reasoning, content and DSML tool calls, as DeepSeek's serving parses them); each call runs
the user's Python function of that name and its result goes back as a tool message, until a
turn calls no tool or `MAX_TURNS` turns are done. Token in, token out: the transcript holds
the generated ids as they came (loss mask 1, the engine's log-probs) and, between turns, the
ids the V4 encoding renders for the tool results and the next assistant header (loss mask 0),
taken as the difference between the conversation rendered with and without them.

A tool is a Python function with annotated parameters (str, int, float, bool) whose docstring
describes it; its JSON schema (tool_schema) is rendered into every prompt. It returns text
(anything else is shown as JSON); an exception becomes the tool's result, as "error: ...", and
so does a call still running after TOOL_TIMEOUT_S (tools run on threads, off the event loop
that carries every conversation's requests). The conversation fits rollout.max_len: each
turn may generate what is left of it, and a tool turn that would leave no room ends it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable

import deepseek_recipe as dr

from miles.rollout.multiturn import Client, Transcript
from miles.user_code import load_function

MAX_TURNS = 4  # generations per sample; the last one's tool calls are not run
TOOL_TIMEOUT_S = 30.0  # a call's result is an error past this (its thread is left to finish)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def tool_schema(fn: Callable) -> dict:
    """OpenAI's function schema of `fn`: its name, its docstring's first paragraph, its
    parameters' JSON types (from their annotations) and which have no default."""
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation if not isinstance(p.annotation, str) else {"str": str, "int": int, "float": float,
                                                                       "bool": bool}.get(p.annotation)
        if ann not in JSON_TYPES:
            raise ValueError(f"tool {fn.__name__}: parameter {name!r} needs an annotation of str, int, float or bool")
        props[name] = {"type": JSON_TYPES[ann]}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or fn.__name__).split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


@functools.lru_cache(maxsize=8)
def load_tools(paths: tuple[str, ...]) -> dict[str, Callable]:
    """'module:function' paths -> {name: function}; names must differ."""
    tools = {}
    for path in paths:
        fn = load_function(path, "rollout.tools entry")
        tool_schema(fn)  # refused early: a parameter without a usable annotation
        if fn.__name__ in tools:
            raise ValueError(f"rollout.tools: two tools are named {fn.__name__!r}")
        tools[fn.__name__] = fn
    return tools


def tool_schemas(paths: list[str]) -> list[dict] | None:
    """The schemas of rollout.tools (None without tools), as prompts render them."""
    return [tool_schema(fn) for fn in load_tools(tuple(paths)).values()] if paths else None


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str | None) -> dr.Tokenizer:
    from miles.data.chat import load_tokenizer

    return load_tokenizer(path)


def parse_turn(ids: list[int], tokenizer: dr.Tokenizer, schemas: list[dict], thinking: bool) -> dict:
    """A generated turn's ids (through its end-of-sentence, if any) as deepseek-recipe's stream
    processor parses them: the OpenAI message {"content", "reasoning_content", "tool_calls":
    [{"id", "function": {"name", "arguments"}}]} (keys it lacks left out)."""
    from miles.data.chat import _encoding

    eos = _encoding(tokenizer)[1]
    ids = ids[:ids.index(eos)] if eos in ids else ids
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "-"}], "tools": schemas or None,
            "thinking": {"type": "enabled" if thinking else "disabled"}}
    conv = dr.ChatCompletionRequest({k: v for k, v in body.items() if v is not None}).convert(
        dr.ConversionOptions(default_thinking_mode=thinking))
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, "turn", "miles"), conv.parsing_options,
                              tokenizer)
    chunks = proc.push(dr.InferenceChunk.ready()) + proc.push(dr.InferenceChunk.tokens(ids))
    chunks += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + proc.finish()
    resp = dr.ChatCompletionResponse("turn", "miles", 0, 0, 0)
    for c in chunks:
        resp.accumulate(c)
    return json.loads(resp.to_json())["choices"][0]["message"]


def call_tool(tools: dict[str, Callable], call: dict) -> str:
    """Run one parsed call; what goes back to the model as its result."""
    fn = tools.get(call["function"]["name"])
    if fn is None:
        return f"error: no tool named {call['function']['name']!r}"
    try:
        args = json.loads(call["function"].get("arguments") or "{}")
        out = fn(**args)
    except Exception as e:  # noqa: BLE001 - the model sees what went wrong, as a tool would tell it
        return f"error: {type(e).__name__}: {e}"
    return out if isinstance(out, str) else json.dumps(out)


def render(messages: list[dict], tokenizer: dr.Tokenizer, schemas: list[dict], thinking: bool,
           generation: bool) -> list[int]:
    """The V4 encoding's ids of `messages` with the tools' schemas: with `generation`, followed
    by the assistant header the next turn starts after; without, through the last message's
    end-of-sentence (a conversation that ends with an assistant turn)."""
    from miles.data.chat import _encoding, to_messages, tool_definitions
    from miles.data.prompts import prompt_ids

    if generation:  # what a prompt is
        return prompt_ids(messages, tokenizer, thinking=thinking, tools=schemas)
    enc, eos = _encoding(tokenizer)
    msgs, _ = to_messages(messages, thinking)
    ids = enc.encode(dr.Conversation(msgs, tools=tool_definitions(schemas), thinking_mode=thinking))
    if eos not in ids:
        raise ValueError("the conversation has no finished assistant turn")
    return ids[:len(ids) - ids[::-1].index(eos)]


async def generate(client: Client, sample: dict) -> Transcript:
    """rollout.tools' generate function: turns of generation and tool calls (module docstring).
    `sample` holds the rollout's keys plus `tools` (the "module:function" paths), `tokenizer`
    (the tokenizer.json), `thinking` (the prompt's mode) and `max_len` (the transcript's
    bound, rollout.max_len)."""
    tools = load_tools(tuple(sample["tools"]))
    schemas = [tool_schema(fn) for fn in tools.values()]
    tok, thinking = _tokenizer(sample.get("tokenizer")), bool(sample.get("thinking", False))
    max_len = int(sample.get("max_len") or 1 << 62)
    params = dict(sample.get("sampling_params") or {})
    messages = list(sample["messages"])
    t = Transcript.start(sample["input_ids"])
    for turn in range(MAX_TURNS):
        room = max_len - len(t.ids)
        result = await client.generate(t.request(params | {"max_new_tokens": min(params.get("max_new_tokens", room),
                                                                                 room)}))
        t.add_generated(result)
        message = await asyncio.to_thread(parse_turn, result["output_ids"], tok, schemas, thinking)
        calls = message.get("tool_calls") or []
        if not calls or turn == MAX_TURNS - 1 or result["meta_info"]["finish_reason"]["type"] == "length":
            break
        said = {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}
        if thinking:
            said["reasoning_content"] = message.get("reasoning_content") or ""
        before = render(messages + [said], tok, schemas, thinking, generation=False)
        messages += [said] + [{"role": "tool", "tool_call_id": c.get("id"), "content": await run_tool(tools, c)}
                              for c in calls]
        after = render(messages, tok, schemas, thinking, generation=True)
        if after[:len(before)] != before:
            raise ValueError("the V4 encoding rendered the conversation with the tool results differently from "
                             "the conversation before them: the tool turn's ids cannot be appended")
        if len(t.ids) + len(after) - len(before) >= max_len:  # no room to answer after the results
            t.finish_reason = {"type": "length", "length": len(t.ids) - t.prompt_len}
            break
        t.add_environment(after[len(before):])
    return t


async def run_tool(tools: dict[str, Callable], call: dict) -> str:
    """call_tool on a thread, bounded by TOOL_TIMEOUT_S."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(call_tool, tools, call), TOOL_TIMEOUT_S)
    except TimeoutError:
        return f"error: {call['function']['name']} took longer than {TOOL_TIMEOUT_S:.0f} s"
