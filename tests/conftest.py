"""Shared fixtures: tiny random HF checkpoints, written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before they are defined.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from atom_models.checkpoints import make_random_checkpoint  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))

# name -> (preset, overrides): together they cover GQA 1/2/4, explicit head_dim, tied and
# untied embeddings, llama3 rope scaling, Qwen3 q/k-norm and a sharded checkpoint.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 10000.0,
}
CHECKPOINTS = {
    "llama-gqa1": ("tiny-llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa2-tied": ("tiny-llama", dict(tie_word_embeddings=True)),
    "llama-gqa4-headdim-rope3": (
        "tiny-llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_parameters=LLAMA3_ROPE),
    ),
    "qwen3": ("tiny-qwen3", {}),
    "qwen3-headdim64": ("tiny-qwen3", dict(head_dim=64)),  # room for an FP8 cache's inline scales (4 x 16 <= 64)
    "llama-sharded": ("tiny-llama", dict(max_shard_size="40KB")),
}


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_checkpoint(checkpoint_root):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            preset, overrides = CHECKPOINTS[name]
            overrides = dict(overrides)
            shard = overrides.pop("max_shard_size", "5GB")
            # A wider init than HF's 0.02 gives peaked logits, so greedy ties are not decided by rounding.
            made[name] = make_random_checkpoint(
                checkpoint_root / name,
                preset,
                seed=len(made),
                max_shard_size=shard,
                initializer_range=0.2,
                **overrides,
            )
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_checkpoint) -> Path:
    return make_checkpoint("llama-gqa2-tied")


@pytest.fixture(scope="session")
def tiny_qwen3(make_checkpoint) -> Path:
    return make_checkpoint("qwen3")


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def llama_artifact(tiny_llama, artifact_root) -> Path:
    """The tiny Llama exported once at level 3 (Inductor, CPU) for the whole session."""
    import atom_compile

    atom_compile.export(tiny_llama, artifact_root / "llama", device="cpu", level=3)
    return artifact_root / "llama"


@pytest.fixture(scope="session")
def qwen3_artifact(tiny_qwen3, artifact_root) -> Path:
    import atom_compile

    atom_compile.export(tiny_qwen3, artifact_root / "qwen3", device="cpu", level=3)
    return artifact_root / "qwen3"
