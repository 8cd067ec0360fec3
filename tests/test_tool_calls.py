"""Tool calls (hermes, llama3_json) and reasoning (qwen3, deepseek_r1) read from a completion's text, whole and
streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest

from atom_runtime.server.reasoning import ReasoningStream, split_reasoning
from atom_runtime.server.tool_calls import TOOL_CALL_PARSERS, parse_required, required_schema

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES = {
    "plain text": ("Just text, < and <tool but no call.", "Just text, < and <tool but no call.", []),
    "one call": (CALL, None, [("get_weather", {"city": "Paris"})]),
    "text, then calls": (
        "Let me check. " + CALL + "\n" + CALL.replace("Paris", "Rome"),
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
    ),
    "arguments as a string": (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [("f", {"x": 1})],
    ),
    "not a call": ("<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
    "unclosed": ('Hm <tool_call>{"name": "f"', 'Hm <tool_call>{"name": "f"', []),
    "a name that is not a string": ('<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
}


LLAMA3_JSON = {
    "plain text": ("The weather is fine.", "The weather is fine.", []),
    "one call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "after the python tag": (
        '<|python_tag|>{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", {"x": 1}), ("g", {})],
    ),
    "JSON that is not a call": ('{"answer": 42}', '{"answer": 42}', []),
    "cut short": ('{"name": "f", "parameters": {"x"', '{"name": "f", "parameters": {"x"', []),
    "a name that is not a string": ('{"name": null, "parameters": {}}', '{"name": null, "parameters": {}}', []),
}
CASES = [("hermes", name) for name in HERMES] + [("llama3_json", name) for name in LLAMA3_JSON]


@pytest.mark.parametrize(("parser", "case"), CASES, ids=[f"{p}: {c}" for p, c in CASES])
def test_calls_whole_and_streamed(parser, case):
    text, content, calls = (HERMES if parser == "hermes" else LLAMA3_JSON)[case]
    parse, stream_of = TOOL_CALL_PARSERS[parser]
    found_content, found = parse(text)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    for size in (1, 2, 5, len(text)):  # streamed in pieces of every size: the same calls, the same content
        stream, streamed, called = stream_of(), "", []
        for start in range(0, len(text), size):
            piece, made = stream.feed(text[start : start + size])
            streamed += piece
            called += made
        piece, made = stream.finish()
        streamed, called = streamed + piece, called + made
        assert [(c.name, json.loads(c.arguments)) for c in called] == calls
        assert streamed.strip() == (content or "")


def test_required_calls_schema_and_parse():
    tools = [{"name": "a", "parameters": {"type": "object"}}, {"name": "b"}]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert "maxItems" not in required_schema(tools, parallel=True)
    (call,) = parse_required('[{"name": "a", "parameters": {"k": [1, 2]}}]')
    assert (call.name, json.loads(call.arguments)) == ("a", {"k": [1, 2]})
    assert parse_required('[{"name": "a", "param') is None  # cut short by max_tokens


# (parser, reply, constrained): (reasoning, answer)
REPLIES = {
    ("qwen3", "<think>\nhmm</think>\n\nyes", False): ("\nhmm", "\n\nyes"),
    ("qwen3", "  <think>cut short", False): ("cut short", None),
    ("qwen3", "no thinking", False): (None, "no thinking"),
    ("qwen3", "a</think>b", False): (None, "a</think>b"),  # thinking opens the reply, or there is none
    ("qwen3", "<thin", False): (None, "<thin"),
    ("deepseek_r1", "hmm</think>yes", False): ("hmm", "yes"),
    ("deepseek_r1", "<think>hmm</think>", False): ("hmm", None),
    ("deepseek_r1", "cut short", False): ("cut short", None),
    ("deepseek_r1", "<thi", False): ("<thi", None),  # cut short inside a `<think>` it writes again: thinking
    ("deepseek_r1", '{"a": 1}', True): (None, '{"a": 1}'),  # constrained from its first token: all answer
}


@pytest.mark.parametrize("case", REPLIES, ids=[f"{p}: {r!r}" for p, r, _ in REPLIES])
def test_reasoning_whole_and_streamed(case):
    parser, text, constrained = case
    assert split_reasoning(parser, text, constrained) == REPLIES[case]
    for size in (1, 2, 3, len(text)):
        stream, reasoning, answer = ReasoningStream(parser, constrained), "", ""
        for start in range(0, len(text), size):
            thought, said = stream.feed(text[start : start + size])
            reasoning, answer = reasoning + thought, answer + said
        thought, said = stream.finish()
        assert (reasoning + thought or None, answer + said or None) == REPLIES[case]
