"""Reasoning models' thinking, apart from their answer (vLLM's `--reasoning-parser`): `reasoning_content` beside
`content` in chat completions, whole and streamed.

- `qwen3`: a reply that opens with `<think>` thinks until `</think>` (or its end); any other is all answer (Qwen3
  with enable_thinking=False writes no tags).
- `deepseek_r1`: the template opens the thinking, so the reply starts inside it (a `<think>` it writes again is
  dropped) and the answer follows `</think>`; a reply without one is all thinking, and a constrained one (a structured
  output or a tool call, which this server applies from the first token, not after the thinking) all answer.
"""

from __future__ import annotations

from atom_runtime.server.tool_calls import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_START, _END = "<think>", "</think>"


def split_reasoning(parser: str, text: str, constrained: bool) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply, None for an empty part."""
    if (parser == "qwen3" and not text.lstrip().startswith(_START)) or (parser == "deepseek_r1" and constrained):
        return None, text or None
    if parser == "qwen3":
        text = text.lstrip()
    head, _, answer = text.removeprefix(_START).partition(_END)
    return head or None, answer or None


class ReasoningStream:
    """`split_reasoning` over a stream of text deltas: each piece goes out as reasoning or answer as soon as it is
    known to be one (a possible start of a `<think>` or `</think>` is held back until it is known)."""

    def __init__(self, parser: str, constrained: bool):
        # qwen3 decides on the reply's first characters; deepseek_r1 starts inside the thinking
        self.state = "undecided" if parser == "qwen3" else ("content" if constrained else "opening")
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) to send now."""
        self.buffer += text
        reasoning = answer = ""
        if self.state in ("undecided", "opening"):
            start = self.buffer.lstrip() if self.state == "undecided" else self.buffer
            if _START.startswith(start) and len(start) < len(_START):
                return "", ""  # maybe the tag: wait
            if start.startswith(_START):
                self.buffer, self.state = start[len(_START) :], "thinking"
            else:
                self.state = "thinking" if self.state == "opening" else "content"
        if self.state == "thinking":
            head, closed, rest = self.buffer.partition(_END)
            if closed:
                reasoning, self.buffer, self.state = head, rest, "content"
            else:
                keep = partial_suffix(self.buffer, _END)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if self.state == "content":
            answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held back at the end, as the part it was in."""
        rest, self.buffer = self.buffer, ""
        # (a deepseek_r1 reply still "opening" is a start of `<think>` and nothing more: thinking, as whole)
        return (rest, "") if self.state in ("thinking", "opening") else ("", rest)
