"""The demo model shipped in atom_models/demo: HF and atom agree on it, its chat template serves, and
`atom-run` without a model argument runs it from the cached default artifact.

The artifact is exported once for the module (Inductor, CPU) into a temporary cache directory,
through `default_artifact`, the same path `atom-run` takes.
"""

from __future__ import annotations

import json
import os
import subprocess

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from atom_runtime import LLM, SamplingParams
from atom_runtime.default_model import DEMO_DIR, DEMO_NAME, artifact_key, default_artifact
from atom_runtime.loading import create_engine
from atom_runtime.server.api_server import build_app
from tests.test_server import ServerThread

TOKENS = 64
PROMPTS = [
    "The json module",
    "In Python, all exceptions must be instances of a class",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat does os.getcwd() do?<|im_end|>\n<|im_start|>assistant\n",
]
QUESTION = [{"role": "user", "content": "What does json.dumps() do?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("atom-cache")


@pytest.fixture(scope="module")
def demo_artifact(cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("ATOM_CACHE_DIR", str(cache_dir))
    return default_artifact("cpu")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def hf_greedy() -> list[list[int]]:
    """HF transformers' greedy tokens for PROMPTS, EOS ignored, one forward pass per token."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    results = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            for _ in range(TOKENS):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            results.append(ids[-TOKENS:])
    return results


def atom_greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


def test_demo_files():
    names = {p.name for p in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert (DEMO_DIR / "model.safetensors").stat().st_size <= 30 * 2**20
    assert "chat_template" in json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    readme = (DEMO_DIR / "README.md").read_text()
    assert "Held-out perplexity" in readme and "PSF" in readme


def test_cache_key_names_a_block_size_other_than_the_default():
    """Caches exported before the block size was an export option stay valid; another block size is its own."""
    cpu = torch.device("cpu")
    assert "block_size" not in artifact_key(cpu, "auto", None) and artifact_key(cpu, "auto", None, (), 16) == (
        artifact_key(cpu, "auto", None)
    )
    assert artifact_key(cpu, "auto", None, (), 32)["block_size"] == 32


def test_eager_matches_hf(hf_greedy):
    llm = LLM(DEMO_DIR, device="cpu")
    try:
        assert atom_greedy(llm) == hf_greedy
    finally:
        llm.shutdown()


def test_artifact_matches_hf(demo_artifact, hf_greedy):
    llm = LLM(demo_artifact)
    try:
        assert atom_greedy(llm) == hf_greedy
    finally:
        llm.shutdown()


def test_chat_completions(demo_artifact):
    engine = create_engine(demo_artifact, served_model_name=DEMO_NAME)
    server = ServerThread(build_app(engine, DEMO_NAME))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=DEMO_NAME, messages=QUESTION, max_tokens=TOKENS, temperature=0)
    finally:
        server.stop()
        engine.shutdown()
    llm = LLM(demo_artifact)
    try:
        prompt = llm.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
        expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=TOKENS))[0].outputs[0]
    finally:
        llm.shutdown()
    (choice,) = reply.choices
    assert choice.message.content == expected.text and choice.message.content.strip()
    assert choice.finish_reason == "stop"  # the model ends its reply with <|im_end|>


def test_cli_uses_cached_default(demo_artifact, cache_dir):
    env = dict(os.environ, ATOM_CACHE_DIR=str(cache_dir))
    run = subprocess.run(
        ["atom-run", "generate", "--prompt", PROMPTS[0], "--max-tokens", "16", "--temperature", "0", "--json",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "exporting" not in run.stderr  # reused, not exported again
    assert [p.name for p in cache_dir.iterdir()] == [demo_artifact.name]
    llm = LLM(demo_artifact)
    try:
        expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    finally:
        llm.shutdown()
    assert json.loads(run.stdout)["token_ids"] == expected.token_ids
