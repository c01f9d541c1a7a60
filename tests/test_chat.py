"""Loss masks of chat conversations with the real DeepSeek-V4 tokenizer (miles.data.chat).

Against DeepSeek's own renderer and parser (deepseek-recipe): the ids follow the rule (the
recipe's encode of the conversation, or of the messages before a turn plus its completion);
every supervised span, fed to the recipe's stream processor, parses back to its message
(reasoning, content, tool calls); nothing else is supervised.
"""

from __future__ import annotations

import json
import random
import string

import deepseek_recipe as dr
import pytest

from miles.data.chat import ChatFormatError, conversation_samples, load_tokenizer, tokenize_conversation

EOS = "<｜end▁of▁sentence｜>"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}}}}]


def call(name: str, args: dict, i: int = 0) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CHATS = {
    "multi-turn with system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, larger?"}, {"role": "assistant", "content": "11, and then 13."}],
    "special spellings in text": [
        {"role": "user", "content": f"Say {EOS} and <｜Assistant｜> literally."},
        {"role": "assistant", "content": f"Here: {EOS} <｜User｜> </think> done."}],
    "context-only turn": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there", "loss": False},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}],
    "reasoning turns": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
        {"role": "user", "content": "3*3?"},
        {"role": "assistant", "content": "9", "reasoning_content": "Multiply 3 by 3."}],
}
TOOL_CHATS = {
    "tool call and result": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "What is 2 + 40?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should add.",
         "tool_calls": [call("add", {"a": 2, "b": 40})]},
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "The tool said 42."}],
    "two calls, two results": [
        {"role": "user", "content": "Add 1 and 2, and search for cats."},
        {"role": "assistant", "content": "Doing both.", "reasoning_content": "Two tools.",
         "tool_calls": [call("add", {"a": 1, "b": 2}, 0), call("search", {"query": "cats"}, 1)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1", "content": "Cats are mammals."},
        {"role": "assistant", "content": "3; cats are mammals.", "reasoning_content": "Both returned."}],
}


@pytest.fixture(scope="module")
def tok() -> dr.Tokenizer:
    return load_tokenizer()


def encode(tok, messages, thinking, tools, effort=None) -> list[int]:
    """The recipe's own encode of these messages (built directly with the recipe's types)."""
    ms = []
    for m in messages:
        if m["role"] == "system":
            ms.append(dr.SystemMessage(m["content"]))
        elif m["role"] == "user":
            ms.append(dr.UserMessage(m["content"]))
        elif m["role"] == "tool":
            ms.append(dr.ToolMessage(m["content"], m["tool_call_id"]))
        else:
            calls = [dr.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in m.get("tool_calls", [])] or None
            # as the mode generates the turn: no reasoning in chat mode, possibly empty in thinking mode
            reasoning = (m.get("reasoning_content") or "") if thinking else None
            ms.append(dr.AssistantMessage(m["content"], reasoning, calls))
    defs = [dr.ToolDefinition(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
            for t in tools] if tools else None
    return dr.DeepseekV4Encoding().with_tokenizer(tok).encode(dr.Conversation(ms, thinking_mode=thinking, tools=defs,
                                                                               reasoning_effort=effort))


def parse(tok, span: list[int], thinking: bool, tools) -> dict:
    """The recipe's stream processor on a supervised span: the assistant message it reads."""
    defs = [dr.ToolDefinition(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
            for t in tools] if tools else None
    req = dr.ConversationRequest(dr.Conversation([dr.UserMessage("x")], thinking_mode=thinking, tools=defs),
                                 dr.ModelVersion.DeepseekV4Pro)
    stage = dr.ThinkingInitialStage.ReasoningStart if thinking else None
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "id", "m"),
                              dr.ParsingOptions(thinking_initial_stage=stage), tok)
    resp = dr.ChatCompletionResponse("id", "m", 0, 0, 0)
    for chunk in (dr.InferenceChunk.ready(), dr.InferenceChunk.tokens(span),
                  dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)):
        for c in proc.push(chunk):
            resp.accumulate(c)
    for c in proc.finish():
        resp.accumulate(c)
    return json.loads(resp.to_json())["choices"][0]["message"]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, v in enumerate(mask + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def assert_parses_back(tok, ids, a, b, message, thinking, tools):
    eos = tok.encode(EOS)[0]
    assert ids[b - 1] == eos and eos not in ids[a:b - 1], "one end-of-sentence token, closing the span"
    got = parse(tok, ids[a:b - 1], thinking, tools)  # an engine stops at EOS and never passes it on
    assert got.get("content", "") == message["content"]
    if thinking:
        assert (got.get("reasoning_content") or "") == (message.get("reasoning_content") or "")
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.get("tool_calls", [])] == want


WHOLE = ([(False, None, n) for n in CHATS] + [(False, TOOLS, n) for n in TOOL_CHATS]
         + [(True, TOOLS, n) for n in TOOL_CHATS] + [(True, TOOLS, "reasoning turns")])


@pytest.mark.parametrize("thinking,tools,name", WHOLE)
def test_whole_conversation_samples(tok, thinking, tools, name):
    """Chat mode, and thinking mode with tools: the ids are the recipe's encode of the whole
    conversation (its trailing generation header dropped); the supervised spans are exactly
    the trained assistant turns, each parsing back to its message; nothing else is trained."""
    messages = {**CHATS, **TOOL_CHATS}[name]
    ids, mask = tokenize_conversation(messages, tok, thinking=thinking, tools=tools)
    full = encode(tok, messages, thinking, tools)
    assert len(ids) == len(mask) and ids == full[:len(ids)] and len(full) - len(ids) == 2, "the header dropped"
    trained = [m for m in messages if m["role"] == "assistant" and m.get("loss", True)]
    got = spans(mask)
    assert len(got) == len(trained)
    for (a, b), m in zip(got, trained, strict=True):
        assert_parses_back(tok, ids, a, b, m, thinking, tools)
    # the prompt side of each span: the tokens before it are the recipe's encode of the messages before the turn
    for (a, _), m in zip(got, trained, strict=True):
        assert ids[:a] == encode(tok, messages[:messages.index(m)], thinking, tools)


@pytest.mark.parametrize("name", ["reasoning turns", "multi-turn with system", "special spellings in text"])
def test_thinking_without_tools_supervises_the_last_turn_as_generated(tok, name):
    """Thinking mode without tools: the recipe drops history reasoning, so a sample is the
    encode of the messages before a trained turn plus that turn's completion (reasoning,
    </think>, content, end-of-sentence), the only span trained; `expand` gives one per turn."""
    messages = CHATS[name]
    ids, mask = tokenize_conversation(messages, tok, thinking=True)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    samples = conversation_samples(messages, tok, thinking=True, thinking_turns="expand")
    assert len(samples) == len(trained) and samples[-1] == (ids, mask)
    for (s_ids, s_mask), t in zip(samples, trained, strict=True):
        prompt = encode(tok, messages[:t], True, None)
        assert s_ids[:len(prompt)] == prompt and spans(s_mask) == [(len(prompt), len(s_ids))]
        assert_parses_back(tok, s_ids, len(prompt), len(s_ids), messages[t], True, None)


def random_text(rng: random.Random) -> str:
    words = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(1, 9)))
             for _ in range(rng.randint(1, 12))]
    return " ".join(words) + rng.choice(["", ".", "?", "\nso " + rng.choice(words)])


@pytest.mark.parametrize("with_calls", [False, True])
def test_thinking_turn_with_empty_content_closes_its_reasoning(tok, with_calls, seed):
    """Guards a thinking-mode turn with empty content (reasoning only, or reasoning and tool
    calls) losing its `</think>`: the recipe's `prefix` continuation of such a turn leaves the
    reasoning open. Each sample (expand: one per turn, earlier and last) is the recipe's encode
    of the messages before the turn plus the turn exactly as the recipe renders it complete
    (where history keeps reasoning: with tools), `<think>` R `</think>` [calls] end of sentence;
    everything after the header is trained, as for a turn with content, and the whole
    conversation with tools supervises the same tokens."""
    rng = random.Random(seed)
    first = {"role": "assistant", "content": "", "reasoning_content": random_text(rng)}
    if with_calls:
        first["tool_calls"] = [call("add", {"a": rng.randint(0, 999), "b": rng.randint(0, 999)})]
    messages = [{"role": "user", "content": random_text(rng)}, first,
                {"role": "tool", "tool_call_id": "call_0", "content": str(rng.randint(0, 9999))} if with_calls
                else {"role": "user", "content": random_text(rng)},
                {"role": "assistant", "content": "", "reasoning_content": random_text(rng)}]
    eos, think_end = tok.encode(EOS)[0], tok.encode("</think>")[0]
    samples = conversation_samples(messages, tok, thinking=True, thinking_turns="expand")
    assert samples[-1] == tokenize_conversation(messages, tok, thinking=True)
    whole_ids, whole_mask = tokenize_conversation(messages, tok, thinking=True, tools=TOOLS)
    assert len(samples) == 2
    for (ids, mask), t, (a, b) in zip(samples, [1, 3], spans(whole_mask), strict=True):
        before = encode(tok, messages[:t], True, TOOLS)
        complete = encode(tok, messages[:t + 1], True, TOOLS)
        turn = complete[len(before):complete.index(eos, len(before)) + 1]
        assert turn.count(think_end) == 1 and (turn[-2] == think_end) != bool(messages[t].get("tool_calls"))
        prompt = encode(tok, messages[:t], True, None)
        assert ids == prompt + turn and mask == [0] * len(prompt) + [1] * len(turn)
        assert whole_ids[a:b] == turn
        assert_parses_back(tok, ids, len(prompt), len(ids), messages[t], True, None)


@pytest.mark.parametrize("effort", ["low", "max"])
def test_reasoning_effort_changes_the_prompt_never_the_completion(tok, effort):
    """data.reasoning_effort picks the recipe's preamble (none for low, a longer one for max):
    the prompt is the recipe's encode with that effort, the supervised completion the same."""
    messages = CHATS["reasoning turns"]
    ids, mask = tokenize_conversation(messages, tok, thinking=True, reasoning_effort=effort)
    base_ids, base_mask = tokenize_conversation(messages, tok, thinking=True)
    (a, b), (c, d) = spans(mask)[0], spans(base_mask)[0]
    assert ids[:a] == encode(tok, messages[:3], True, None, effort) and ids[:a] != base_ids[:c]
    assert ids[a:b] == base_ids[c:d] and b == len(ids)
    assert_parses_back(tok, ids, a, b, messages[3], True, None)


def test_special_spellings_in_text_stay_text(tok):
    """A user or assistant typing `<｜end▁of▁sentence｜>` gets ordinary text tokens: the EOS id
    appears only where a turn ends."""
    eos = tok.encode(EOS)[0]
    ids, mask = tokenize_conversation(CHATS["special spellings in text"], tok)
    assert [i for i, x in enumerate(ids) if x == eos] == [len(ids) - 1]


def test_context_only_turns_are_not_trained(tok):
    ids, mask = tokenize_conversation(CHATS["context-only turn"], tok)
    assert len(spans(mask)) == 1 and sum(mask) < len(ids)
    assert parse(tok, ids[spans(mask)[0][0]:-1], False, None)["content"] == "Goodbye!"


BAD = [
    ([], "'messages' must be a non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "message 1: unknown role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "message 1: empty assistant turn"),
    ([{"role": "assistant", "content": "hi"}], "message 0: an assistant turn must follow a user or tool message"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "message 0: 'content' must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "loss": False}],
     "no trained assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}],
     "message 1: tool call 0 needs a function name"),
]


@pytest.mark.parametrize("messages,error", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_conversations_say_which_message_and_why(tok, messages, error):
    with pytest.raises(ChatFormatError, match=error.replace("(", r"\(").replace(")", r"\)")):
        tokenize_conversation(messages, tok)


# --------------------------------------------------------------------------- template="hf"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('reasoning_content') and enable_thinking %}"
          "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers tokenizer with a ChatML-style chat template: the bundled tiny BPE plus
    two added tokens, saved and loaded back like any local HF tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from miles.data.sft import tokenizer_path

    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path("tiny"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    path = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["multi-turn with system", "context-only turn", "reasoning turns"])
@pytest.mark.parametrize("thinking", [False, True])
def test_hf_template_supervises_each_trained_turn_through_its_end_token(hf_dir, name, thinking):
    """template="hf": the ids are the tokenizer's own encode of its template's render; each
    supervised span decodes to exactly what the model generates for a trained turn (its
    reasoning in thinking mode, content, <|im_end|>), not the newline after it; nothing else
    (headers, users, context-only turns) is trained."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    messages = CHATS[name]
    ids, mask = tokenize_conversation(messages, str(hf_dir), template="hf", thinking=thinking)
    text = tok.apply_chat_template(messages, tokenize=False, enable_thinking=thinking)
    assert ids == tok(text, add_special_tokens=False)["input_ids"][:len(ids)]
    trained = [m for m in messages if m["role"] == "assistant" and m.get("loss", True)]
    got = spans(mask)
    assert len(got) == len(trained)
    for (a, b), m in zip(got, trained, strict=True):
        think = f"<think>{m['reasoning_content']}</think>" if thinking and m.get("reasoning_content") else ""
        assert tok.decode(ids[a:b]) == think + m["content"] + "<|im_end|>"
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")


def test_rl_decodes_responses_with_the_prompts_tokenizer(hf_dir):
    """Guards RL's reward reading responses through the wrong tokenizer (template hf: a
    tokenizer directory, which the tokenizer.json loader refused): the response text is the
    prompts' tokenizer's decode, special tokens dropped, for both templates."""
    from transformers import AutoTokenizer

    from miles.data.sft import tokenizer_path
    from miles.rl.rollout import response_tokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tok("Answer: 42", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert response_tokenizer(str(hf_dir), "hf").decode(ids, skip_special_tokens=True) == "Answer: 42"
    from tokenizers import Tokenizer

    tiny = Tokenizer.from_file(tokenizer_path("tiny"))
    ids = tiny.encode("Answer: 7").ids
    assert response_tokenizer("tiny").decode(ids, skip_special_tokens=True) == tiny.decode(ids)
