"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

One server (uvicorn in a thread, on a free port) serves the module; the preemption test
has its own with a KV pool that fits one request. The tiny model writes random bytes,
so where outputs must be equal the tests compare token ids (the `return_token_ids`
extension), not text.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import atom_models
from atom_runtime.config import EngineConfig
from atom_runtime.core_client import _picklable
from atom_runtime.loading import create_engine
from atom_runtime.server.api_server import build_app

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
MAX_NUM_SEQS = 64
REPO = Path(__file__).resolve().parents[1]


class ServerThread:
    """uvicorn on 127.0.0.1, on a port the OS picks, in a daemon thread."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = create_engine(  # in its own process, as `atom-run serve` runs it
        tiny_llama,
        device="cpu",
        served_model_name=MODEL,
        engine_process=True,
        config=EngineConfig(block_size=4, max_num_seqs=MAX_NUM_SEQS),
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(engine, profile_dir, tiny_llama):
    app = build_app(engine, MODEL, api_key=API_KEY, torch_profiler_dir=profile_dir, model_path=str(tiny_llama))
    server = ServerThread(app)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        yield http


def greedy_ids(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> list[int]:
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return out.choices[0].token_ids


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Until no sequence holds a KV block, as the core last reported (aborts reach it asynchronously)."""
    deadline = time.monotonic() + timeout
    while (stats := engine.stats).kv_usage or stats.num_running or stats.num_waiting:
        assert time.monotonic() < deadline, f"{stats.kv_usage:.0%} of the KV cache still held"
        time.sleep(0.02)


# ---- the openai client ------------------------------------------------------------------


def test_models(client, tiny_llama, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].root == str(tiny_llama)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert httpx.get(f"{server.url}/version").json() == {"version": atom_models.__version__}
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_completion(client, engine):
    prompt = "The quick brown fox"
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason == "length" and len(choice.token_ids) == 10
    assert choice.text == engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    prompt_len = len(engine.tokenizer.encode(prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_len,
        10,
        prompt_len + 10,
    )


def test_chat(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = out.choices
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    template = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_len = len(engine.tokenizer.encode(template, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_len,
        8,
        prompt_len + 8,
    )


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Streaming works", max_tokens=16, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**kwargs, extra_body=extra)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    )
    *deltas, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    assert [t for c in deltas for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert usage_chunk.choices == []
    counts = lambda usage: (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert counts(usage_chunk.usage) == counts(whole.usage)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit


IGNORE_EOS = {"ignore_eos": True}


def test_continuous_usage_stats(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, prompt="Counting", max_tokens=6, temperature=0, stream=True, stream_options=options)
    *deltas, last = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_token_ids": True})
    generated = 0
    for chunk in deltas:  # every chunk carries the usage so far
        generated += len(chunk.choices[0].token_ids)
        assert chunk.usage.completion_tokens == generated and chunk.usage.prompt_tokens == last.usage.prompt_tokens
    assert last.choices == [] and last.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=OK_CHAT, max_tokens=4, stream=True, stream_options=options, extra_body=IGNORE_EOS
    )
    assert [c.usage.completion_tokens for c in chat if c.choices and c.choices[0].finish_reason] == [4]


def test_stream_chunks_share_created_and_carry_usage(http, monkeypatch):
    """As OpenAI's: every chunk of a stream has the same `created`; with continuous usage stats (vLLM's), every chunk
    has the usage so far, the chat's opening role chunks too (the prompt's, no completion tokens yet)."""
    from atom_runtime.server import protocol

    ticks = iter(range(10**6))
    monkeypatch.setattr(protocol, "time", type("Clock", (), {"time": staticmethod(lambda: 1e9 + next(ticks))}))
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in [(COMPLETIONS, {"prompt": "Ticking"}), (CHAT, {"messages": OK_CHAT, "n": 2})]:
        body |= {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "stream": True, "stream_options": options}
        with http.stream("POST", path, json=body | {"return_token_ids": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 2 and len({chunk["created"] for chunk in chunks}) == 1, path
        prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
        assert all(chunk["usage"]["prompt_tokens"] == prompt_tokens for chunk in chunks), path
        # return_token_ids: the prompt's ids once, on the first chunk (a completion's choice, a chat's chunk), as vLLM's
        if path == COMPLETIONS:
            ids = [c["choices"][0].get("prompt_token_ids") for c in chunks if c["choices"]]
        else:
            ids = [c.get("prompt_token_ids") for c in chunks]
        assert len(ids[0]) == prompt_tokens and ids[1:] == [None] * (len(ids) - 1), path


def test_chat_continues_the_final_message(http, engine):
    """An assistant turn of the history without content, and a last message the model continues (vLLM's
    `continue_final_message`): the prompt is the history up to inside that message."""
    history = [*OK_CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "more"}]
    assert http.post(CHAT, json={"model": MODEL, "messages": history, "max_tokens": 2}).status_code == 200
    messages = [*OK_CHAT, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    response = http.post(CHAT, json={"model": MODEL, **body, "max_tokens": 2, "return_token_ids": True})
    assert response.status_code == 200, response.text
    expected = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert expected.endswith("The answer is")
    ids = engine.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert response.json()["prompt_token_ids"] == ids == http.post("/tokenize", json=body).json()["tokens"]


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 == whole.usage.completion_tokens


def test_n2(client):
    out = client.completions.create(
        model=MODEL, prompt="Two samples", n=2, max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=6, stream=True, seed=3
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Log", max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Log"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)


def test_stop_string_across_tokens(client):
    """Every byte is a token, so a two-character stop string spans two tokens."""
    for prompt in ["Once upon", "a b c d", "Hello there", "xyz", "0123", "The end"]:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        text = out.choices[0].text
        at = next((i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2]), None)
        if at is not None:
            break
    else:
        pytest.skip("the random model wrote no two printable characters in a row")
    stop = text[at : at + 2]
    kwargs = dict(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    out = client.completions.create(**kwargs)
    assert out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    def sample(seed: int) -> list[int]:
        out = client.completions.create(
            model=MODEL,
            prompt="Random",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return out.choices[0].token_ids

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_token_id_prompt_and_batch(client, engine):
    ids = engine.tokenizer.encode("Same prompt")
    by_text = greedy_ids(client, "Same prompt")
    out = client.completions.create(
        model=MODEL,
        prompt=[ids, ids],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == [by_text, by_text]
    other = greedy_ids(client, "Other prompt")
    stream = client.completions.create(
        model=MODEL,
        prompt=["Same prompt", "Other prompt"],
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream:
        streamed[chunk.choices[0].index] += chunk.choices[0].token_ids
    assert streamed == {0: by_text, 1: other}


def test_tokenize_and_detokenize(http, engine):
    text = "Hello there, tokens"
    response = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert response.status_code == 200, response.text
    body = response.json()
    tokens = engine.tokenizer(text)["input_ids"]
    assert body == {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = http.post("/tokenize", json={"messages": OK_CHAT}).json()["tokens"]
    templated = engine.tokenizer.apply_chat_template(OK_CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == engine.tokenizer(templated, add_special_tokens=False)["input_ids"]
    history = http.post("/tokenize", json={"messages": OK_CHAT, "add_generation_prompt": False}).json()["tokens"]
    templated = engine.tokenizer.apply_chat_template(OK_CHAT, add_generation_prompt=False, tokenize=False)
    assert history == engine.tokenizer(templated, add_special_tokens=False)["input_ids"] and history != chat
    named = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert named["token_strs"] == engine.tokenizer.convert_ids_to_tokens(tokens)
    assert http.post("/detokenize", json={"tokens": bare}).json() == {"prompt": engine.tokenizer.decode(bare)}
    for path, bad, param in [
        ("/tokenize", {"prompt": "x", "messages": OK_CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ]:
        response = http.post(path, json=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


def test_chat_template_kwargs_reach_the_template(http, engine):
    tokenizer = engine.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{% if shout %}LOUD {% endif %}" + template
    try:
        plain = http.post("/tokenize", json={"messages": OK_CHAT}).json()["tokens"]
        loud = http.post("/tokenize", json={"messages": OK_CHAT, "chat_template_kwargs": {"shout": True}}).json()
        assert loud["tokens"] == tokenizer("LOUD ", add_special_tokens=False)["input_ids"] + plain
        body = {"messages": OK_CHAT, "max_tokens": 2, "chat_template_kwargs": {"shout": True}}
        usage = http.post(CHAT, json=body).json()["usage"]
        assert usage["prompt_tokens"] == loud["count"]
    finally:
        tokenizer.chat_template = template


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("Echo me")
    streamed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed).startswith("Echo me")


def test_echo_with_logprobs(client, http):
    """As OpenAI's legacy completions did: the echoed prompt's tokens lead the logprobs, the first with none; the
    others are the prompt_logprobs vLLM returns (`prompt_logprobs` field), and streaming sends the same."""
    kwargs = dict(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0, echo=True, logprobs=2)
    out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    logprobs, text = out.choices[0].logprobs, out.choices[0].text
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Echo me"}).json()["tokens"]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == text and text.startswith("Echo me")
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(
        lp <= 0 and 1 <= len(top) <= 3
        for lp, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    )
    body = {"model": MODEL, "prompt": "Echo me", "max_tokens": 1, "prompt_logprobs": 1}
    scores = http.post(COMPLETIONS, json=body).json()["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(prompt_ids) and scores[0] is None
    for token, entry, echoed in zip(
        prompt_ids[1:], scores[1:], logprobs.token_logprobs[1 : len(prompt_ids)], strict=True
    ):
        assert list(entry)[0] == str(token) and len(entry) <= 2  # the prompt's token, then the top 1
        assert entry[str(token)]["logprob"] == pytest.approx(echoed, abs=1e-5)
        assert entry[str(token)]["rank"] >= 1
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    chat = {"model": MODEL, "messages": OK_CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    chat_scores = http.post(CHAT, json=chat).json()["prompt_logprobs"]
    assert chat_scores[0] is None and all(len(entry) == 1 for entry in chat_scores[1:])


def test_echo_with_max_tokens_0_scores_the_prompt(client, http):
    """lm-evaluation-harness's loglikelihood requests (echo, logprobs, max_tokens 0): the prompt and its logprobs,
    nothing generated, the same scores as an echo that generates."""
    kwargs = dict(model=MODEL, prompt="Echo me", temperature=0, echo=True, logprobs=1)
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Echo me"}).json()["tokens"]
    scored = client.completions.create(**kwargs, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == "Echo me" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids) and choice.logprobs.token_logprobs[0] is None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(prompt_ids), 0)
    generated = client.completions.create(**kwargs, max_tokens=3, extra_body={"ignore_eos": True})
    assert choice.logprobs.token_logprobs == generated.choices[0].logprobs.token_logprobs[: len(prompt_ids)]
    streamed = list(client.completions.create(**kwargs, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "Echo me"
    assert streamed[-1].choices[0].finish_reason == "length"
    refused = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "Echo me", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"  # only echo scores


def test_bad_words(http):
    letters = http.post("/tokenize", json={"model": MODEL, "prompt": "xyz", "add_special_tokens": False}).json()
    body = {"model": MODEL, "prompt": "Words", "max_tokens": 30, "seed": 1, "ignore_eos": True, "n": 3}
    body |= {"allowed_token_ids": letters["tokens"], "bad_words": ["x", "yz"]}
    for choice in http.post(COMPLETIONS, json=body).json()["choices"]:
        assert "x" not in choice["text"] and "yz" not in choice["text"] and len(choice["text"]) == 30


def test_truncate_prompt_tokens(http):
    """The request runs (and reports) its prompt's last 3 tokens: usage, return_token_ids, and echo with logprobs."""
    body = {"model": MODEL, "prompt": "A long prompt, cut short", "max_tokens": 2, "truncate_prompt_tokens": 3}
    body |= {"return_token_ids": True, "echo": True, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": body["prompt"]}).json()["tokens"]
    answer = http.post(COMPLETIONS, json=body).json()
    choice = answer["choices"][0]
    assert answer["usage"]["prompt_tokens"] == 3 and choice["prompt_token_ids"] == ids[-3:]
    assert len(choice["logprobs"]["tokens"]) == 3 + 2 and choice["text"].startswith("ort")
    chat = {"model": MODEL, "messages": OK_CHAT, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    assert len(http.post(CHAT, json=chat).json()["prompt_token_ids"]) == 4


def test_logit_bias_and_allowed_token_ids(http):
    """OpenAI's logit_bias (+100: that token every time) and vLLM's allowed_token_ids (only those, even sampling)."""
    (x,) = http.post("/tokenize", json={"model": MODEL, "prompt": "x", "add_special_tokens": False}).json()["tokens"]
    body = {"model": MODEL, "prompt": "Bias", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True}
    biased = http.post(COMPLETIONS, json=body | {"logit_bias": {str(x): 100}}).json()["choices"][0]
    assert biased["token_ids"] == [x] * 6 and biased["text"] == "x" * 6
    allowed = [x, x + 1]
    body |= {"temperature": 1.0, "seed": 1, "n": 3, "allowed_token_ids": allowed}
    for choice in http.post(COMPLETIONS, json=body).json()["choices"]:
        assert set(choice["token_ids"]) <= set(allowed)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def assert_call(name: str, arguments: str) -> None:
    """A call of WEATHER or CLOCK with arguments its schema allows."""
    value = json.loads(arguments)
    assert (name, value) in [("get_weather", {"city": c}) for c in ("Paris", "Rome")] + [
        ("get_time", {"zone": z}) for z in ("UTC", "CET")
    ], (name, arguments)


def streamed_calls(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed choice 0, from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: its id, type and name
                    assert call.type == "function" and call.index not in calls
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_choice_named_and_required(client):
    """A named function and tool_choice "required" constrain the output to a call (as vLLM does, a JSON schema):
    the response carries tool_calls, whole or streamed (a named call's arguments as they come)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=300, seed=1)
    chat = client.chat.completions.create(**kwargs, tool_choice=named)
    message = chat.choices[0].message
    assert message.content is None and chat.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.function.name == "get_time"
    assert_call(call.function.name, call.function.arguments)
    content, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, tool_choice=named, stream=True))
    assert content == "" and finish == "stop" and [name for name, _ in calls] == ["get_time"]
    assert_call(*calls[0])
    chat = client.chat.completions.create(**kwargs, tool_choice="required", n=2, parallel_tool_calls=False)
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    # (a random model under a JSON schema writes whitespace freely: room for it)
    streamed = list(client.chat.completions.create(**kwargs | {"max_tokens": 900}, tool_choice="required", stream=True))
    content, calls, finish = streamed_calls(iter(streamed))
    assert content == "" and finish == "tool_calls" and calls
    # the call's JSON is held back until it ends: no empty chunk stands for each held token (the role's opens)
    assert all(c.choices[0].delta.tool_calls or c.choices[0].finish_reason for c in streamed[1:])
    for call in calls:
        assert_call(*call)


@pytest.fixture(scope="module")
def parsing_http(engine):
    """A server on the same engine started with `--enable-auto-tool-choice --tool-call-parser P` or
    `--reasoning-parser P`, by its options."""
    servers: dict[tuple, tuple[ServerThread, httpx.Client]] = {}

    def serve(**parsers: str) -> httpx.Client:
        key = tuple(sorted(parsers.items()))
        if key not in servers:
            server = ServerThread(build_app(engine, MODEL, api_key=API_KEY, **parsers))
            servers[key] = server, httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
        return servers[key][1]

    yield serve
    for server, http in servers.values():
        http.close()
        server.stop()


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
LLAMA3_CALL = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
# parser: (a regex for a reply with text and a call, the text the parser leaves, one for two calls)
AUTO_REPLIES = {
    "hermes": ("Sure[.] " + HERMES_CALL, "Sure.", HERMES_CALL + HERMES_CALL),
    "llama3_json": (LLAMA3_CALL, None, LLAMA3_CALL + "; " + LLAMA3_CALL),
}


@pytest.mark.parametrize("parser", AUTO_REPLIES)
def test_tool_choice_auto_leaves_a_call_without_a_name_as_content(parsing_http, parser):
    """A reply shaped as a call whose name is not a string is the model's content (as vLLM's parsers leave it), not
    a 400 blaming the request."""
    http = parsing_http(tool_call_parser=parser)
    reply = {"hermes": '<tool_call>{"name": 5, "arguments": {}}</tool_call>', "llama3_json": '{"name": null}'}[parser]
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 60, "guided_choice": [reply]}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": reply, "tool_calls": []}
    with http.stream("POST", CHAT, json=body | {"stream": True}) as response:
        lines = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "error" not in lines[-1], lines[-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in lines if c["choices"]) == reply


@pytest.mark.parametrize("parser", AUTO_REPLIES)
def test_tool_choice_auto_reads_calls(parsing_http, parser):
    """With tool_choice "auto" the model may call: the server's parser finds the calls in its text (forced here with
    a regex, as a random model never writes one), whole and streamed, and leaves text without one as content."""
    http = parsing_http(tool_call_parser=parser)
    one, content, two = AUTO_REPLIES[parser]
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 200, "seed": 3}
    answer = http.post(CHAT, json=body | {"guided_regex": one}).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    (made,) = choice["message"]["tool_calls"]
    assert made["type"] == "function" and made["id"].startswith("chatcmpl-tool-")
    assert_call(made["function"]["name"], made["function"]["arguments"])
    with http.stream("POST", CHAT, json=body | {"guided_regex": two, "stream": True}) as response:
        chunks = [
            openai.types.chat.ChatCompletionChunk(**json.loads(line[6:]))
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    content, calls, finish = streamed_calls(chunks)
    assert content == "" and finish == "tool_calls" and len(calls) == 2
    for made in calls:
        assert_call(*made)
    plain = http.post(CHAT, json=body | {"guided_choice": ["no call needed"]}).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no call needed", "tool_calls": []}
    assert plain["finish_reason"] == "stop"


def chat_parts(http: httpx.Client, body: dict) -> list[tuple[str | None, str | None]]:
    """[(reasoning_content, content)] of a chat completion, whole, then streamed (its deltas joined)."""
    message = http.post(CHAT, json=body).json()["choices"][0]["message"]
    with http.stream("POST", CHAT, json=body | {"stream": True}) as response:
        deltas = [json.loads(line[6:])["choices"] for line in response.iter_lines() if line.startswith("data: {")]
    parts = ["".join(c[0]["delta"].get(field) or "" for c in deltas if c) for field in ("reasoning_content", "content")]
    return [(message.get("reasoning_content"), message["content"]), tuple(part or None for part in parts)]


def test_reasoning_parsers(parsing_http):
    """`--reasoning-parser`: the thinking comes back as reasoning_content, apart from the answer, whole and streamed;
    qwen3's opens with <think> (forced here with a regex), deepseek_r1's opens the reply (a random model never closes
    it: all thinking), unless a constraint shaped the reply from its first token (then all answer)."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "seed": 5}
    qwen3 = parsing_http(reasoning_parser="qwen3")
    for parts in chat_parts(qwen3, body | {"guided_regex": "<think>[a-c]{4}</think>(Paris|Rome)"}):
        assert re.fullmatch("[a-c]{4}", parts[0]) and parts[1] in ("Paris", "Rome")
    assert chat_parts(qwen3, body | {"guided_choice": ["no thinking"]}) == [(None, "no thinking")] * 2
    deepseek = parsing_http(reasoning_parser="deepseek_r1")
    for reasoning, content in chat_parts(deepseek, body | {"max_tokens": 8}):
        assert reasoning and content is None
    assert chat_parts(deepseek, body | {"guided_choice": ["yes"]}) == [(None, "yes")] * 2


def test_tools_and_tool_history_reach_the_chat_template(http, engine, monkeypatch):
    """The offered tools, an assistant turn's calls (their arguments as an object) and tool answers are the chat
    template's to write, as vLLM gives them."""
    template = (
        "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tokens = http.post(
        "/tokenize", json={"messages": history, "tools": [WEATHER, CLOCK], "add_generation_prompt": False}
    )
    expected = "get_weather;get_time;user:Weather in Paris?|assistant:[get_weather Paris]|tool:sunny(c1)|"
    assert tokens.json()["tokens"] == engine.tokenizer(expected, add_special_tokens=False)["input_ids"]
    chat = http.post(CHAT, json={"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["tool_calls"] == []


def test_structured_outputs(client, http, monkeypatch):
    """OpenAI's response_format (a JSON schema, any JSON object) and vLLM's structured_outputs / guided_* fields: a
    random model's sampled output still matches (seeded: each run draws the same). The server checks each constraint
    by compiling it off its event loop (a large vocabulary's schema takes ~0.1 s)."""
    import threading

    from atom_runtime import structured_outputs

    compiled_on = set()
    compile_grammar = structured_outputs.Grammars.compile

    def compile_and_note(grammars, params):
        compiled_on.add(threading.current_thread().name.split("_")[0])
        return compile_grammar(grammars, params)

    monkeypatch.setattr(structured_outputs.Grammars, "compile", compile_and_note)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A color and a digit, as JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
        max_tokens=300,
        seed=1,
        n=2,
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content)
        assert set(value) == {"color", "n"} and value["color"] in ("red", "blue") and 0 <= value["n"] <= 9
    body = {"model": MODEL, "prompt": "Pick", "max_tokens": 40, "seed": 2, "n": 3}
    for field, constraint, check in [
        ("guided_choice", ["yes", "no", "maybe so"], lambda text: text in ("yes", "no", "maybe so")),
        ("guided_regex", r"[0-9]{3}-[a-z]{2}", lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        ("structured_outputs", {"choice": ["left", "right"]}, lambda text: text in ("left", "right")),
        ("response_format", {"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    ]:
        answer = http.post(COMPLETIONS, json=body | {field: constraint, "max_tokens": 300}).json()
        assert all(c["finish_reason"] == "stop" and check(c["text"]) for c in answer["choices"]), (field, answer)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream a choice"}],
        stream=True,
        seed=3,
        max_tokens=40,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) in ("alpha", "beta")
    assert compiled_on == {"atom-tokenizer"}


def test_64_concurrent_streams_equal_serial(client, server):
    prompts = [f"Request number {i}: " for i in range(64)]
    serial = [greedy_ids(client, p, max_tokens=10) for p in prompts]
    async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def stream(prompt: str) -> list[int]:
        chunks = await async_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return [t async for c in chunks for t in c.choices[0].token_ids]

    async def all_at_once() -> list[list[int]]:
        try:
            return await asyncio.gather(*(stream(p) for p in prompts))
        finally:
            await async_client.close()

    assert asyncio.run(all_at_once()) == serial


def test_prefix_cache_hits_in_metrics(client, server):
    shared = "A long shared system prompt that many requests start with, " * 2
    before = metric(server.url, "atom:prefix_cache_hits_total")
    client.completions.create(model=MODEL, prompt=shared + "first", max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=shared + "second", max_tokens=2)
    assert metric(server.url, "atom:prefix_cache_hits_total") - before >= len(shared) // 4 * 4 - 4
    assert second.usage.prompt_tokens_details.cached_tokens >= len(shared) // 4 * 4 - 4
    assert 0 < metric(server.url, "atom:prefix_cache_hit_rate") <= 1


def aborted_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "atom:request_success_total" and s.labels["finished_reason"] == "abort"
    )


def test_stream_disconnect_frees_blocks(server, engine, http):
    wait_until_idle(engine)
    aborted = aborted_requests(server.url)
    http.post(COMPLETIONS, json={"prompt": "to the end", "max_tokens": 3})
    http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 5000})  # refused: beyond the context
    assert aborted_requests(server.url) == aborted  # neither counts as aborted
    body = {"model": MODEL, "prompt": "Talk forever", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
        assert engine.stats.kv_usage > 0
    wait_until_idle(engine)
    deadline = time.monotonic() + 5
    while metric(server.url, "atom:kv_cache_usage_perc") != 0 or metric(server.url, "atom:num_requests_running"):
        assert time.monotonic() < deadline, "/metrics still shows the aborted request"
        time.sleep(0.05)
    assert aborted_requests(server.url) == aborted + 1  # counted as vLLM counts it


def test_non_stream_disconnect_frees_blocks(server, engine):
    wait_until_idle(engine)
    body = {"model": MODEL, "prompt": "Talk forever", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    wait_until_idle(engine)


# ---- bad input ----------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
TOOL_CALL_NOT_JSON = {"name": "f", "arguments": "{not json"}
BAD_REQUESTS = {
    "malformed json": (COMPLETIONS, b'{"prompt": "hi",', 400, None),
    "not an object": (COMPLETIONS, b"[1, 2]", 400, None),
    "invalid utf-8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    "NaN": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "missing prompt": (COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    "missing messages": (CHAT, {"max_tokens": 4}, 400, "messages"),
    "max_tokens is a string": (COMPLETIONS, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    "messages is a string": (CHAT, {"messages": "hi"}, 400, "messages"),
    "unknown model": (COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    "unknown model (chat)": (CHAT, {"model": "gpt-9", "messages": OK_CHAT}, 404, "model"),
    "prompt beyond context": (COMPLETIONS, {"prompt": "a" * 1100}, 400, "prompt"),
    "messages beyond context": (CHAT, {"messages": [{"role": "user", "content": "a" * 1100}]}, 400, "messages"),
    "max_tokens 0": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": (COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    "max_tokens beyond context": (COMPLETIONS, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    "max_tokens 0, streamed": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0, "stream": True}, 400, "max_tokens"),
    "chat max_tokens beyond context": (CHAT, {"messages": OK_CHAT, "max_tokens": 5000}, 400, "max_tokens"),
    "temperature < 0": (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    "top_p 0": (COMPLETIONS, {"prompt": "hi", "top_p": 0.0}, 400, "top_p"),
    "top_p > 1": (CHAT, {"messages": OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    "top_k < -1": (COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    "n beyond the limit": (COMPLETIONS, {"prompt": "hi", "n": MAX_NUM_SEQS + 1}, 400, "n"),
    "n 0": (CHAT, {"messages": OK_CHAT, "n": 0}, 400, "n"),
    "logprobs beyond the limit": (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    "top_logprobs beyond the limit": (
        CHAT,
        {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    "top_logprobs without logprobs": (CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    "empty prompt list": (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    "empty token ids in a batch": (COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt"),
    "empty messages": (CHAT, {"messages": []}, 400, "messages"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    "image content": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
    ),
    "token id beyond vocab": (COMPLETIONS, {"prompt": [1, 2, 320]}, 400, "prompt"),
    "negative token id": (COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    "prompt_logprobs with stream": (
        COMPLETIONS,
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    "prompt_logprobs beyond the limit": (CHAT, {"messages": OK_CHAT, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    "negative prompt_logprobs": (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    "stream_options without stream": (
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    "min_tokens > max_tokens": (COMPLETIONS, {"prompt": "hi", "min_tokens": 10, "max_tokens": 4}, 400, "min_tokens"),
    "repetition_penalty 0": (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    "repetition_penalty 1e39": (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e39}, 400, "repetition_penalty"),
    # tools: "auto" (the default with tools) needs a server started with --enable-auto-tool-choice
    "tools": (CHAT, {"messages": OK_CHAT, "tools": [TOOL]}, 400, "tool_choice"),
    "tools, auto": (CHAT, {"messages": OK_CHAT, "tools": [TOOL], "tool_choice": "auto"}, 400, "tool_choice"),
    "tool_choice required without tools": (CHAT, {"messages": OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    "tool_choice an unknown function": (
        CHAT,
        {"messages": OK_CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    "tool_choice and response_format": (
        CHAT,
        {"messages": OK_CHAT, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        400,
        "tool_choice",
    ),
    "a tool call's arguments not JSON": (
        CHAT,
        {
            "messages": [
                *OK_CHAT,
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": TOOL_CALL_NOT_JSON}]},
            ]
        },
        400,
        "messages",
    ),
    # known features this server does not implement: refused by name, never silently ignored
    "legacy functions": (CHAT, {"messages": OK_CHAT, "functions": [TOOL["function"]]}, 400, "functions"),
    "legacy function_call": (CHAT, {"messages": OK_CHAT, "function_call": {"name": "f"}}, 400, "function_call"),
    "template kwargs that are arguments": (
        CHAT,
        {"messages": OK_CHAT, "chat_template_kwargs": {"tokenize": True}},
        400,
        "chat_template_kwargs",
    ),
    "template kwargs that are the template's messages": (
        CHAT,
        {"messages": OK_CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    "max_completion_tokens beyond context": (
        CHAT,
        {"messages": OK_CHAT, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
    ),
    "generation prompt and continuing": (
        CHAT,
        {"messages": OK_CHAT, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    "tool message without content": (
        CHAT,
        {"messages": [*OK_CHAT, {"role": "tool", "tool_call_id": "c"}]},
        400,
        "messages",
    ),
    "user message without content": (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    "max_completion_tokens 0": (CHAT, {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    "empty stop string": (COMPLETIONS, {"prompt": "hi", "stop": ["x", ""]}, 400, "stop"),
    "seed beyond 64 bits": (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    "temperature beyond float32": (COMPLETIONS, {"prompt": "hi", "temperature": 1e39}, 400, "temperature"),
    "chat echo": (CHAT, {"messages": OK_CHAT, "echo": True}, 400, "echo"),
    "beam search": (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    "an empty bad word": (COMPLETIONS, {"prompt": "hi", "bad_words": ["x", " "]}, 400, "bad_words"),
    "two structured output constraints": (
        COMPLETIONS,
        {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]},
        400,
        "guided_choice",
    ),
    "invalid guided_regex": (COMPLETIONS, {"prompt": "hi", "guided_regex": "(a"}, 400, "guided_regex"),
    "invalid json schema": (
        CHAT,
        {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        400,
        "response_format",
    ),
    "json_schema without a schema": (
        CHAT,
        {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),
    "unknown response_format": (
        CHAT,
        {"messages": OK_CHAT, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    "unknown structured_outputs key": (
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"yaml": "x"}},
        400,
        "structured_outputs",
    ),
    "empty guided_choice": (COMPLETIONS, {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    "empty structured_outputs": (COMPLETIONS, {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
    "a regex not a string": (
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"regex": 5}},
        400,
        "structured_outputs",
    ),
    "choice not a list": (
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"choice": "abc"}},
        400,
        "structured_outputs",
    ),
    "json_object not a bool": (
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"json_object": "yes"}},
        400,
        "structured_outputs",
    ),
    "json_schema not an object": (
        CHAT,
        {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": "x"}},
        400,
        "response_format",
    ),
    "guided_whitespace_pattern": (
        COMPLETIONS,
        {"prompt": "hi", "guided_json": {}, "guided_whitespace_pattern": " "},
        400,
        "guided_whitespace_pattern",
    ),
    "truncate_prompt_tokens beyond the context": (
        COMPLETIONS,
        {"prompt": "hi", "truncate_prompt_tokens": 100000},
        400,
        "truncate_prompt_tokens",
    ),
    "truncate_prompt_tokens 0": (
        COMPLETIONS,
        {"prompt": "hi", "truncate_prompt_tokens": 0},
        400,
        "truncate_prompt_tokens",
    ),
    "logit_bias key not a token id": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 100}}, 400, "logit_bias"),
    "logit_bias beyond vocab": (CHAT, {"messages": OK_CHAT, "logit_bias": {"320": 1}}, 400, "logit_bias"),
    "empty allowed_token_ids": (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    "allowed_token_ids beyond vocab": (
        COMPLETIONS,
        {"prompt": "hi", "allowed_token_ids": [1, 999]},
        400,
        "allowed_token_ids",
    ),
    "suffix": (COMPLETIONS, {"prompt": "hi", "suffix": "xyz"}, 400, "suffix"),
    "best_of above n": (COMPLETIONS, {"prompt": "hi", "n": 1, "best_of": 3}, 400, "best_of"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request(http, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert_still_serving(http)


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


NO_OP_FIELDS = {
    "tool_choice auto, no tools": (CHAT, {"messages": OK_CHAT, "tool_choice": "auto", "tools": []}),
    "tools, none": (CHAT, {"messages": OK_CHAT, "tools": [TOOL], "tool_choice": "none"}),
    "text response_format": (CHAT, {"messages": OK_CHAT, "response_format": {"type": "text"}}),
    "empty logit_bias": (COMPLETIONS, {"prompt": "hi", "logit_bias": {}}),
    "best_of n": (COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 2}),
    "empty suffix": (COMPLETIONS, {"prompt": "hi", "suffix": ""}),
    "repetition_penalty above 2 (vLLM's range)": (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 2.5}),
    "OpenAI's fields without effect here": (CHAT, {"messages": OK_CHAT, "user": "me", "store": False, "metadata": {}}),
    "template kwargs": (CHAT, {"messages": OK_CHAT, "chat_template_kwargs": {"enable_thinking": False}}),
    "an unknown field": (COMPLETIONS, {"prompt": "hi", "no_such_field": 1}),
}


@pytest.mark.parametrize("case", NO_OP_FIELDS, ids=list(NO_OP_FIELDS))
def test_unimplemented_fields_pass_where_they_change_nothing(http, case, caplog):
    path, body = NO_OP_FIELDS[case]
    with caplog.at_level(logging.WARNING, logger="atom_runtime.server.api_server"):
        response = http.post(path, json={**body, "max_tokens": 2})
    assert response.status_code == 200, response.text
    logged = "ignored fields the server does not know: 'no_such_field'" in caplog.text
    assert logged == (case == "an unknown field")


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/no/such/route", 404), ("GET", COMPLETIONS, 405)])
def test_bad_route(http, method, path, status):
    response = http.request(method, path)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(http)


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=OK_CHAT)


# ---- API key, health, metrics, profiling ------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", COMPLETIONS),
        ("POST", CHAT),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
    ],
)
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_enforced(server, method, path, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "hi"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_api_key_with_openai_client(server, client):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # /health needs no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # nor /metrics (a Prometheus scraper), as in vLLM
    assert client.models.list().data


def test_metrics(client, server):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, extra_body={"ignore_eos": True})
    for name in [
        "atom:num_requests_running",
        "atom:num_requests_waiting",
        "atom:prompt_tokens_total",
        "atom:generation_tokens_total",
        "atom:time_to_first_token_seconds_count",
        "atom:time_per_output_token_seconds_count",
        "atom:e2e_request_latency_seconds_count",
        "atom:kv_cache_usage_perc",
        "atom:prefix_cache_hit_rate",
        "atom:num_preemptions_total",
    ]:
        assert metric(server.url, name) >= 0
    assert metric(server.url, "atom:generation_tokens_total") >= 3


def test_profile(http, profile_dir):
    assert http.post("/stop_profile").status_code == 400  # nothing recording
    assert http.post("/start_profile").status_code == 200
    assert http.post("/start_profile").status_code == 400  # already recording
    http.post(COMPLETIONS, json={"prompt": "profile me", "max_tokens": 4})
    response = http.post("/stop_profile")
    assert response.status_code == 200
    trace = Path(response.json()["trace"])
    assert trace.parent == profile_dir
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the core thread's ops were recorded


def test_a_response_the_server_fails_to_build_is_a_500(server, monkeypatch):
    """Only a request body that does not parse is the client's fault (400): a model the server builds wrong is its
    own (500), though pydantic raises the same error for both."""
    from atom_runtime.server import serving

    monkeypatch.setattr(serving, "_usage", lambda finals: serving.Usage(prompt_tokens="many", completion_tokens=0))
    # (a fresh connection: after a 500 the server closes the one it answered on)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 500 and response.json()["error"]["type"] == "internal_server_error"


def test_profile_off(engine):
    with TestClient(build_app(engine, MODEL)) as test_client:
        response = test_client.post("/start_profile")
    assert response.status_code == 400
    assert "--torch-profiler-dir" in response.json()["error"]["message"]


def test_benchmark_serving(server, tiny_llama, tmp_path):
    result = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "benchmarks" / "benchmark_serving.py")]
    command += ["--backend", "openai", "--base-url", server.url, "--model", MODEL, "--tokenizer", str(tiny_llama)]
    command += ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8"]
    command += ["--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm"]
    command += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    command += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", result.name]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": API_KEY})
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout
    saved = json.loads(result.read_text())
    assert saved["completed"] == 8 and saved["total_output_tokens"] == 64
    assert saved["mean_ttft_ms"] > 0 and saved["p99_e2el_ms"] >= saved["median_e2el_ms"]


# ---- a server of its own ----------------------------------------------------------------------


def test_preemption_with_tiny_kv_pool(tiny_llama, client):
    """A pool that fits one request: four at once must preempt, and still all finish, unchanged."""
    prompts = ["Preempt me", "And me too", "Me as well", "Last one!!"]
    max_tokens = 22  # 10 prompt + 22 tokens = 8 blocks of 4
    expected = [greedy_ids(client, p, max_tokens) for p in prompts]
    small = create_engine(
        tiny_llama, device="cpu", served_model_name=MODEL, config=EngineConfig(block_size=4, num_kvcache_blocks=9)
    )
    server = ServerThread(build_app(small, MODEL))
    try:
        tight = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str) -> list[int]:
            out = await tight.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return out.choices[0].token_ids

        async def all_at_once() -> list[list[int]]:
            try:
                return await asyncio.gather(*(one(p) for p in prompts))
            finally:
                await tight.close()

        assert asyncio.run(all_at_once()) == expected
        assert metric(server.url, "atom:num_preemptions_total") > 0
    finally:
        server.stop()
        small.shutdown()


def test_health_503_when_engine_stopped(tiny_llama):
    engine = create_engine(tiny_llama, device="cpu", config=EngineConfig(block_size=4, max_num_seqs=2))
    engine.shutdown()
    with TestClient(build_app(engine, MODEL)) as test_client:
        assert test_client.get("/health").status_code == 503
        response = test_client.post(COMPLETIONS, json={"prompt": "hi"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"


def test_engine_process_exit_is_reported(tiny_llama):
    """The core's process dies: /health and new requests answer 503, a waiting request fails, nothing hangs."""
    engine = create_engine(tiny_llama, device="cpu", engine_process=True, config=EngineConfig(block_size=4))
    try:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):  # refused here, not lost on the way
            asyncio.run(engine.call_in_core(lambda core: core.limits))
        with TestClient(build_app(engine, MODEL)) as test_client:
            assert test_client.get("/health").status_code == 200
            engine._core._process.kill()
            deadline = time.monotonic() + 10
            while engine.is_healthy:
                assert time.monotonic() < deadline, "the engine still reports healthy"
                time.sleep(0.05)
            assert test_client.get("/health").status_code == 503
            assert test_client.post(COMPLETIONS, json={"prompt": "hi"}).status_code == 503
    finally:
        engine.shutdown()


def test_engine_process_startup_error_is_raised_here(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        create_engine(tiny_llama, device="cpu", engine_process=True, config=EngineConfig(max_model_len=10**7))


class _NeedsTwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_core_messages_that_would_not_unpickle_are_replaced():
    """An exception that cannot be rebuilt in the server would kill its reader thread and leave requests waiting."""
    dead = _picklable(("dead", _NeedsTwoArguments(1, 2)))
    assert isinstance(dead[1], RuntimeError) and "_NeedsTwoArguments: 1 and 2" in str(dead[1])
    called = _picklable(("called", 7, None, lambda: None))
    assert called[:2] == ("called", 7) and isinstance(called[2], RuntimeError) and called[3] is None
    fine = ("rejected", "r-1", ValueError("no"))
    assert _picklable(fine) is fine
