"""Sampling defaults from the model's generation_config.json, as vLLM's `--generation-config auto` applies them."""

from __future__ import annotations

import shutil

import pytest
from starlette.testclient import TestClient
from transformers import GenerationConfig

from atom_runtime import LLM, SamplingParams
from atom_runtime.cli import build_parser
from atom_runtime.engine_args import create_engine_kwargs
from atom_runtime.loading import create_engine, sampling_defaults
from atom_runtime.sampling_params import with_defaults
from atom_runtime.server.api_server import build_app

RECOMMENDED = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=5, eos_token_id=[2])


@pytest.fixture(scope="module")
def recommending(tiny_llama, tmp_path_factory):
    """The tiny Llama with a model maker's recommended sampling in its generation_config.json."""
    model = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_llama, model)
    GenerationConfig(**RECOMMENDED).save_pretrained(model)
    return model


def test_the_model_recommends_what_vllm_takes(recommending, tmp_path):
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert sampling_defaults(recommending) == expected  # do_sample and eos ids are not sampling defaults
    assert sampling_defaults(recommending, "vllm") == {}
    assert sampling_defaults(tmp_path) == {}  # a model without the file
    assert sampling_defaults(tmp_path, str(recommending)) == expected  # another directory's file
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(recommending, str(tmp_path))
    GenerationConfig(temperature=-1.0, do_sample=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(tmp_path)


def test_a_request_keeps_what_it_sets_and_max_tokens_is_capped():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    params = with_defaults(defaults, temperature=0.0, top_k=None, top_p=None, max_tokens=None)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 20, 1.0, 5)
    assert (
        with_defaults(defaults, max_tokens=3).max_tokens == 3 and with_defaults(defaults, max_tokens=9).max_tokens == 5
    )
    assert with_defaults({}, max_tokens=None).max_tokens is None  # to the end of the context
    assert with_defaults({}).max_tokens == SamplingParams.max_tokens


def test_llm_defaults_to_the_models_sampling(recommending):
    llm = LLM(recommending, device="cpu")
    try:
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_p, default.top_k, default.max_tokens) == (0.6, 0.95, 20, 5)
        (out,) = llm.generate("Hello", None)
        assert len(out.outputs[0].token_ids) <= 5
    finally:
        llm.shutdown()
    neutral = LLM(recommending, device="cpu", generation_config="vllm")
    try:
        assert neutral.get_default_sampling_params().temperature == SamplingParams.temperature
    finally:
        neutral.shutdown()


def test_server_requests_take_the_defaults_they_leave_out(recommending):
    """A chat without max_tokens stops at the model's max_new_tokens, and a completion's larger max_tokens is capped
    by it; what a request sets it keeps (greedy here)."""
    args = build_parser().parse_args(["serve", str(recommending), "--device", "cpu"])
    engine = create_engine(recommending, **create_engine_kwargs(args))
    try:
        with TestClient(build_app(engine, "m")) as client:
            chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
            body = client.post("/v1/chat/completions", json=chat).json()
            assert body["usage"]["completion_tokens"] == 5
            completion = {"prompt": "hi", "max_tokens": 50, "temperature": 0, "ignore_eos": True}
            assert client.post("/v1/completions", json=completion).json()["usage"]["completion_tokens"] == 5
    finally:
        engine.shutdown()
    assert engine.sampling_defaults["temperature"] == 0.6
    args = build_parser().parse_args(["serve", str(recommending), "--generation-config", "vllm"])
    assert create_engine_kwargs(args)["generation_config"] == "vllm"
