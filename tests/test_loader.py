"""Weight-loading errors name the tensor and the shapes involved."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_models import UnsupportedModelError, WeightLoadError, load_model


@pytest.fixture
def broken(tmp_path, tiny_llama):
    """A writable copy of the tiny checkpoint and a function that rewrites its tensors."""
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    path = target / "model.safetensors"

    def edit(change) -> None:
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})

    return target, edit


def test_missing_tensor(broken):
    model_dir, edit = broken
    edit(lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"lacks model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(model_dir, progress=False)


def test_unexpected_tensor(broken):
    model_dir, edit = broken
    edit(lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(3)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor model\.layers\.0\.mlp\.extra\.weight \(3,\)"):
        load_model(model_dir, progress=False)


def test_wrong_shape(broken):
    model_dir, edit = broken
    edit(lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 100)))
    with pytest.raises(
        WeightLoadError,
        match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight: checkpoint shape \(64, 100\) "
        r"does not match parameter shape \(64, 128\)",
    ):
        load_model(model_dir, progress=False)


def test_wrong_shape_of_packed_shard(broken):
    model_dir, edit = broken
    edit(lambda t: t.__setitem__("model.layers.0.self_attn.v_proj.weight", torch.zeros(16, 64)))
    with pytest.raises(WeightLoadError, match=r"v_proj\.weight: checkpoint shape \(16, 64\) .* \(32, 64\)"):
        load_model(model_dir, progress=False)


def test_unsupported_architecture(broken):
    model_dir, _ = broken
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPTBigCodeForCausalLM.*supported: LlamaForCausalLM, Qwen3"):
        load_model(model_dir, progress=False)


def test_index_names_a_missing_file(tmp_path, make_checkpoint):
    target = tmp_path / "sharded"
    shutil.copytree(make_checkpoint("llama-sharded"), target)
    next(iter(sorted(target.glob("model-*.safetensors")))).unlink()
    with pytest.raises(WeightLoadError, match=r"model\.safetensors\.index\.json names model-00001-of-\d+"):
        load_model(target, progress=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_safetensors_file_is_named(broken, damage):
    model_dir, _ = broken
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"garbage\n" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match=rf"{path} is not a readable safetensors file"):
        load_model(model_dir, progress=False)


def test_dtype_choice(tiny_llama):
    assert load_model(tiny_llama, dtype="bfloat16", progress=False).lm_head.weight.dtype == torch.bfloat16
    assert load_model(tiny_llama, dtype="auto", progress=False).lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'half-ish'"):
        load_model(tiny_llama, dtype="half-ish", progress=False)


def test_tied_embeddings_share_storage(tiny_llama):
    model = load_model(tiny_llama, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
