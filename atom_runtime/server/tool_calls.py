"""Function calling: the constraints `tool_choice` puts on a chat completion, and the tool calls read from its text.

As vLLM does it: `tool_choice="required"` and a named function constrain the output with a JSON schema (a structured
output), so what the model writes is a call; `"auto"` lets the model choose, and a tool-call parser
(`--tool-call-parser`) finds the calls in its text, streamed or not:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Hermes, Qwen2.5 and Qwen3;
- `llama3_json`: a reply that is JSON calls, `{"name": ..., "parameters": {...}}` (several separated by `;`), as
  Llama 3.1-3.3 write them after `<|python_tag|>` or alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """`tool_choice="required"`: a JSON array of calls, each one of the tools by name with its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["name"]]},
                "parameters": tool.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[Call] | None:
    """The calls of a `required` completion (its JSON array), or None where the text is not one (cut by max_tokens)."""
    try:
        calls = json.loads(text)
        return [Call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return None


def _hermes_call(body: str) -> Call | None:
    try:
        call = json.loads(body)
        arguments = call.get("arguments", {})
        if not isinstance(call["name"], str):  # (a model's `"name": null`: not a call, as vLLM's parser has it)
            return None
        return Call(
            call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """(the text before the first call, or None if blank; the calls) of a completion. A call that is not valid
    JSON with a name leaves the whole text as content, as vLLM's parser does."""
    bodies = _HERMES_CALL.findall(text)
    calls = [_hermes_call(body) for body in bodies]
    if not bodies or None in calls:
        return text, []
    content = text[: text.index(_OPEN)].strip()
    return content or None, calls


class HermesStream:
    """`parse_hermes` over a stream of text deltas: text goes out as content until a call opens (a possible start of
    `<tool_call>` is held back until it is known), each call goes out whole once it closes."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """(content to send now, calls completed now)."""
        self.buffer += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(_CLOSE)
                if end < 0:
                    break
                call = _hermes_call(self.buffer[:end])
                if call is None:  # not a call after all: its text is content
                    content += _OPEN + self.buffer[: end + len(_CLOSE)]
                else:
                    calls.append(call)
                self.buffer = self.buffer[end + len(_CLOSE) :]
                self.in_call = False
            else:
                start = self.buffer.find(_OPEN)
                if start >= 0:
                    content += self.buffer[:start] if not self.calls and not calls else ""
                    self.buffer = self.buffer[start + len(_OPEN) :]
                    self.in_call = True
                    continue
                keep = partial_suffix(self.buffer, _OPEN)
                if not self.calls and not calls:  # text between or after calls is dropped, as in `parse_hermes`
                    content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[Call]]:
        """(content still held back at the end: an unclosed call, or a tail that looked like one's start; no calls)."""
        rest = (_OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest if not self.calls else "", []


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """(None, the calls) of a reply that is JSON calls (after an optional `<|python_tag|>`), else (the text, [])."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            call, at = decoder.raw_decode(body, at)
            arguments = call.get("parameters", call.get("arguments", {}))
            if not isinstance(call["name"], str):
                return text, []
            calls.append(Call(call["name"], json.dumps(arguments, ensure_ascii=False)))
            while at < len(body) and body[at] in " \t\n;":
                at += 1
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return (None, calls) if calls else (text, [])


class Llama3JsonStream:
    """`parse_llama3_json` over a stream: a reply that opens with `{` (or the python tag) is held until it ends and
    goes out as calls (or, if it is not calls after all, as content); any other streams as content."""

    def __init__(self) -> None:
        self.buffer = ""
        self.holding: bool | None = None  # undecided until the first character that is not whitespace
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.holding is False:
            return text, []
        self.buffer += text
        start = self.buffer.lstrip()
        if not start or (_PYTHON_TAG.startswith(start) and len(start) < len(_PYTHON_TAG)):
            return "", []  # nothing to decide on yet
        self.holding = start.startswith(("{", _PYTHON_TAG))
        if self.holding:
            return "", []
        content, self.buffer = self.buffer, ""
        return content, []

    def finish(self) -> tuple[str, list[Call]]:
        """At the end: the held reply's calls, or its text."""
        text, self.buffer = self.buffer, ""
        if not self.holding:
            return text, []
        content, self.calls = parse_llama3_json(text)
        return content or "", self.calls


TOOL_CALL_PARSERS = {"hermes": (parse_hermes, HermesStream), "llama3_json": (parse_llama3_json, Llama3JsonStream)}
