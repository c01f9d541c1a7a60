"""The built-in tool-use generate function (rollout.tools, miles/rollout/tool_use.py): tool
schemas from Python signatures, DSML tool calls parsed by deepseek-recipe's stream processor,
the loop of generation and tool results kept token in, token out."""

from __future__ import annotations

import asyncio

import pytest

from miles.data.chat import load_tokenizer
from miles.data.prompts import prompt_ids
from miles.data.sft import tokenizer_path
from miles.examples.calculator import calc
from miles.rollout import tool_use
from miles.rollout.multiturn import Client

CALC = "miles.examples.calculator:calc"
QUESTION = [{"role": "user", "content": "What is 12*7+5?"}]
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "function": {
    "name": "calc", "arguments": '{"expr": "12*7+5"}'}}]}


def test_a_tool_schema_comes_from_the_signature_and_docstring():
    (schema,) = tool_use.tool_schemas([CALC])
    fn = schema["function"]
    assert fn["name"] == "calc" and fn["description"].startswith("Evaluate an arithmetic expression")
    assert fn["parameters"] == {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}

    def untyped(x):
        return x

    with pytest.raises(ValueError, match="parameter 'x' needs an annotation"):
        tool_use.tool_schema(untyped)
    with pytest.raises(ValueError, match="rollout.tools entry 'miles.examples.calculator:nothing'"):
        tool_use.load_tools(("miles.examples.calculator:nothing",))


def test_the_calculator_computes_and_refuses_what_is_not_arithmetic():
    assert calc("12*7+5") == "89" and calc("(3 - 10) // 2") == "-4" and calc("7/2") == "3.5"
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "((9 ** 64) ** 64) ** 64"):  # the last: digits without end
        with pytest.raises(ValueError):
            calc(bad)
    out = tool_use.call_tool(tool_use.load_tools((CALC,)), {"function": {"name": "calc", "arguments": '{"expr": "x"}'}})
    assert out.startswith("error: ValueError: not arithmetic")
    assert tool_use.call_tool({}, {"function": {"name": "rm", "arguments": "{}"}}) == "error: no tool named 'rm'"


@pytest.mark.parametrize("tokenizer", ["tiny", None])  # the bundled BPE, DeepSeek-V4's own
def test_a_rendered_tool_call_parses_back_to_it(tokenizer):
    """The V4 encoding's ids of an assistant turn that calls a tool, as the policy would
    generate them, parse (deepseek-recipe's stream processor) to that call; a plain answer to
    no call."""
    tok = load_tokenizer(tokenizer_path(tokenizer))
    schemas = tool_use.tool_schemas([CALC])
    before = tool_use.render(QUESTION, tok, schemas, False, generation=True)
    turn = tool_use.render(QUESTION + [CALL], tok, schemas, False, generation=False)[len(before):]
    msg = tool_use.parse_turn(turn, tok, schemas, thinking=False)
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "calc" and call["function"]["arguments"] == '{"expr": "12*7+5"}'
    answer = tool_use.render(QUESTION + [{"role": "assistant", "content": "Answer: 89"}], tok, schemas, False,
                             generation=False)[len(before):]
    plain = tool_use.parse_turn(answer, tok, schemas, thinking=False)
    assert plain["content"] == "Answer: 89" and not plain.get("tool_calls")


def test_the_loop_runs_the_call_and_keeps_tokens_in_and_out():
    """Two turns: the policy calls the calculator, then answers. The transcript is the prompt,
    the call's ids as generated (trained, with the engine's log-probs), the tool result and the
    next assistant header as the V4 encoding renders them (not trained), the answer (trained);
    altogether the encoding of the whole conversation, the calculator's result included. The
    policy's turns are scripted here (a random model calls no tool); the engine's side of
    generate functions runs in tests/test_rl.py."""
    tok = load_tokenizer(tokenizer_path("tiny"))
    schemas = tool_use.tool_schemas([CALC])
    prompt = prompt_ids(QUESTION, tok, tools=schemas)
    assert prompt == tool_use.render(QUESTION, tok, schemas, False, generation=True)
    tool_turn = tool_use.render(QUESTION + [CALL], tok, schemas, False, generation=False)[len(prompt):]
    done = [{"role": "tool", "tool_call_id": "call_0", "content": "89"}, {"role": "assistant", "content": "Answer: 89"}]
    whole = tool_use.render(QUESTION + [CALL] + done, tok, schemas, False, generation=False)
    header = tool_use.render(QUESTION + [CALL, done[0]], tok, schemas, False, generation=True)
    answer = whole[len(header):]
    turns, asked = [tool_turn, answer], []

    async def post(body: dict) -> dict:
        asked.append(list(body["input_ids"]))
        out = turns[len(asked) - 1]
        return {"output_ids": out, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in out],
                                                 "finish_reason": {"type": "stop"}, "weight_version": 3}}

    sample = {"input_ids": prompt, "messages": QUESTION, "tools": [CALC], "tokenizer": tokenizer_path("tiny"),
              "thinking": False, "sampling_params": {"max_new_tokens": 64}}
    t = asyncio.run(tool_use.generate(Client(post), sample))
    assert t.ids == whole, "the transcript is not the encoding of the conversation with the tool's result"
    assert asked == [prompt, header], "the second turn did not see the tool's result"
    n_tool = len(header) - len(prompt) - len(tool_turn)
    assert t.loss_mask == [0] * len(prompt) + [1] * len(tool_turn) + [0] * n_tool + [1] * len(answer)
    assert t.logprobs[len(prompt)] == -0.5 and t.logprobs[len(prompt) + len(tool_turn)] == 0.0
    assert t.turns == 2 and t.weight_versions == {3}

    # rollout.max_len bounds the conversation: each turn asks for what is left at most, and a
    # tool turn that leaves no room to answer ends it, as a length stop
    asked.clear()
    short = sample | {"max_len": len(prompt) + len(tool_turn) + 3}
    bodies = []

    async def post_short(body: dict) -> dict:
        bodies.append(body)
        return await post(body)

    t = asyncio.run(tool_use.generate(Client(post_short), short))
    assert len(bodies) == 1 and bodies[0]["sampling_params"]["max_new_tokens"] == len(tool_turn) + 3
    assert t.ids == prompt + tool_turn and t.finish_reason["type"] == "length"


def test_the_example_job_validates_and_bad_tools_are_refused():
    """jobs/dapo_tools_tiny.yaml (run by hand: 1 rollout, 30 s on 2 cores) takes the built-in
    generate function; a tool that is no "module:function" is refused naming it."""
    from pathlib import Path

    from miles.config import JobConfigError, load_job

    job = Path(__file__).resolve().parents[1] / "jobs" / "dapo_tools_tiny.yaml"
    j = load_job(job, [])
    assert j.rollout.generate_fn == "miles.rollout.tool_use:generate" and j.rollout.tools == [CALC]
    assert not j.algo.routing_replay  # the experts of multi-turn transcripts are not carried yet
    with pytest.raises(JobConfigError, match="rollout.tools: 'calc' is not"):
        load_job(job, ["rollout.tools=[calc]"])
