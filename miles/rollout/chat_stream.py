"""The text of a streamed chat completion, sent as it is decoded: each delta is what the text
so far adds to what was sent, held back where it could still change, so that the deltas
joined are the text the same request returns unstreamed.

Held back until the next token settles it: a last character still incomplete (the decoder
shows U+FFFD for the bytes of a partial UTF-8 character), a tail that could begin a stop
string (the finished text is cut before the stop string), and, in thinking mode, a tail
that could begin `</think>` (DeepSeek-V4's end of reasoning: the text before it streams as
`reasoning_content`, after it as `content`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

THINK_END = "</think>"


class TextStream:
    def __init__(self, stops: list[str] | tuple[str, ...] = (), thinking: bool = False):
        self.stops = list(stops)  # SamplingParams.stops: none empty
        self.thinking = thinking
        self.sent = ""  # the text the deltas so far add up to

    def deltas(self, text: str, final: bool = False) -> list[dict[str, str]]:
        """OpenAI delta objects ({"reasoning_content": ...} and/or {"content": ...}) for the
        completion's text so far; `final`: the finished text (already cut at its stop)."""
        if not final:
            text = self._settled(text)
        if not text.startswith(self.sent):  # a decoder never takes back text it settled
            if final:
                log.warning("a streamed answer's final text does not continue what was sent (%r... then %r...): "
                            "the rest is not sent", self.sent[-40:], text[len(self.sent) - 40:len(self.sent)])
            return []
        if len(text) == len(self.sent):
            return []
        old, new = self._split(self.sent), self._split(text)
        self.sent = text
        return [{key: b[len(a):]} for key, a, b in zip(("reasoning_content", "content"), old, new, strict=True)
                if len(b) > len(a)]

    def _settled(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:  # the engine finishes here: the final text is cut before the stop string
            text = text[:cut]
        # the stops' tail first, then </think>'s on what is left: holding a stop's first
        # characters can cut a "</think>" short ("b</think>" with the stop ">n" leaves
        # "b</think", reasoning until the next token says). What a cut leaves needs no second
        # look for stops: the text after it is known, and a stop through it would have been
        # the longer tail.
        text = text[:len(text) - _tail(text, self.stops)]
        if self.thinking and THINK_END not in text:
            text = text[:len(text) - _tail(text, [THINK_END])]
        return text

    def _split(self, text: str) -> tuple[str, str]:
        reasoning, answer = split_reasoning(text, self.thinking)
        return reasoning or "", answer


def _tail(text: str, marks: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `marks` (0: none)."""
    return max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a completion's text: in thinking mode the text before </think>
    and after it (all reasoning while no </think> has come); else (None, the text)."""
    if not thinking:
        return None, text
    reasoning, _, answer = text.partition(THINK_END)
    return reasoning, answer
