"""Each model family against HF transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from atom_models import load_model
from atom_runtime import LLM, SamplingParams
from tests.conftest import CHECKPOINTS
from tests.helpers import prefill_logits


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, make_checkpoint):
    return make_checkpoint(request.param)


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1] :].tolist()


def test_logits_match_hf(checkpoint):
    ours = load_model(checkpoint, dtype="float32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.randint(0, ours.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
    got = prefill_logits(ours, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_greedy_tokens_match_hf_generate(checkpoint):
    llm = LLM(checkpoint, dtype="float32", device="cpu")
    prompt = llm.tokenizer.encode("The quick brown fox")
    out = llm.generate(
        prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    )[0]
    llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 32)
    assert out.outputs[0].finish_reason == "length"


def test_sharded_checkpoint_has_several_files(make_checkpoint):
    files = list(make_checkpoint("llama-sharded").glob("*.safetensors"))
    assert len(files) >= 2
