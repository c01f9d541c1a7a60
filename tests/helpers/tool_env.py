"""A toy multi-turn environment for RL tests (rollout.generate_fn=tests.helpers.tool_env:tool_turn):
the policy speaks, a tool answers with fixed ids (loss mask 0), the policy speaks again, all
within the sample's max_new_tokens."""

from __future__ import annotations

from miles.rollout.multiturn import Transcript

TOOL_IDS = [7, 8, 9]


async def tool_turn(client, sample: dict) -> Transcript:
    params = dict(sample["sampling_params"])
    params["max_new_tokens"] = (params["max_new_tokens"] - len(TOOL_IDS)) // 2  # per turn: both fit the budget
    params["ignore_eos"] = True  # turns of a known length
    t = Transcript.start(sample["input_ids"])
    t.add_generated(await client.generate(t.request(params)))
    t.add_environment(TOOL_IDS)
    t.add_generated(await client.generate(t.request(params)))
    return t
