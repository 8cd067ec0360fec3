"""QuantizationConfig: each HF format, each exclusion and override rule, and errors that name the key."""

from __future__ import annotations

import pytest

from atom_models.checkpoints import make_config
from atom_models.quantization import LayerQuantConfig, QuantConfigError, QuantizationConfig
from atom_models.quantization.config import matches

BLOCK = LayerQuantConfig("block", "dynamic_per_token", (128, 128))
FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}


def fp8_block(**extra) -> dict:
    """DeepSeek-V3 / Qwen3-FP8's quantization_config."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    } | extra


def compressed_tensors(weights: dict, inputs: dict | None, targets=("Linear",), **extra) -> dict:
    group = {"targets": list(targets), "weights": {**FP8_ARGS, **weights}, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    } | extra


def test_fp8_block_format():
    config = QuantizationConfig.from_hf(fp8_block(modules_to_not_convert=["model.layers.0.mlp.down_proj"]))
    assert config.method == "fp8" and config.default == BLOCK
    assert config.layer("model.layers.1.mlp.down_proj") == BLOCK
    assert config.layer("model.layers.0.mlp.down_proj") is None  # excluded
    assert config.layer("lm_head") is None  # always excluded


def test_fp8_per_tensor_and_static_activations():
    config = QuantizationConfig.from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    assert config.default == LayerQuantConfig("per_tensor", "static_per_tensor")


@pytest.mark.parametrize(
    "weights,inputs,expected",
    [
        (
            {"strategy": "tensor"},
            {**FP8_ARGS, "strategy": "tensor", "dynamic": False},
            ("per_tensor", "static_per_tensor"),
        ),
        (
            {"strategy": "channel"},
            {**FP8_ARGS, "strategy": "token", "dynamic": True},
            ("per_channel", "dynamic_per_token"),
        ),
        ({"strategy": "channel"}, None, ("per_channel", "none")),
        (
            {"strategy": "tensor"},
            {**FP8_ARGS, "strategy": "tensor", "dynamic": True},
            ("per_tensor", "dynamic_per_token"),
        ),
    ],
)
def test_compressed_tensors_schemes(weights, inputs, expected):
    config = QuantizationConfig.from_hf(compressed_tensors(weights, inputs))
    assert config.method == "compressed-tensors"
    assert (config.default.weights, config.default.activations) == expected
    assert not config.default.online and not config.kv_cache_scales


def test_compressed_tensors_block_and_kv_cache_scheme():
    inputs = {**FP8_ARGS, "strategy": "group", "group_size": 128, "dynamic": True}
    kv = {**FP8_ARGS, "strategy": "tensor", "dynamic": False}
    for block in ([128, 128], "128x128"):  # older releases wrote the string form
        hf = compressed_tensors({"strategy": "block", "block_structure": block}, inputs, kv_cache_scheme=kv)
        config = QuantizationConfig.from_hf(hf)
        assert config.default == BLOCK and config.kv_cache_scales


def test_overrides_and_exclusions_in_order():
    """Exclusions win over overrides, overrides over the default; the first matching override wins."""
    hf = compressed_tensors({"strategy": "channel"}, {**FP8_ARGS, "strategy": "token", "dynamic": True})
    hf["config_groups"]["attention"] = {
        "targets": ["re:.*self_attn\\.(q|k|v)_proj$", "*.o_proj"],
        "weights": {**FP8_ARGS, "strategy": "tensor"},
        "input_activations": {**FP8_ARGS, "strategy": "tensor", "dynamic": False},
    }
    hf["ignore"] = ["lm_head", "model.layers.0.self_attn.o_proj", "re:.*layers\\.3\\..*"]
    config = QuantizationConfig.from_hf(hf)
    per_tensor = LayerQuantConfig("per_tensor", "static_per_tensor")
    assert config.layer("model.layers.1.self_attn.k_proj") == per_tensor  # regex override
    assert config.layer("model.layers.1.self_attn.o_proj") == per_tensor  # fnmatch override
    assert config.layer("model.layers.0.self_attn.o_proj") is None  # exclusion beats the override
    assert config.layer("model.layers.3.mlp.up_proj") is None  # regex exclusion
    assert config.layer("model.layers.1.mlp.up_proj").weights == "per_channel"  # the default


def test_pattern_kinds():
    name = "model.layers.12.mlp.down_proj"
    assert matches(name, name) and matches("mlp.down_proj", name) and matches("down_proj", name)
    assert not matches("own_proj", name)  # a dotted suffix, not any substring
    assert matches("*.mlp.*", name) and matches("model.layers.1?.mlp.down_proj", name)
    assert matches("re:model\\.layers\\.\\d+\\.mlp", name) and not matches("re:mlp", name)


def test_packed_layers_ask_for_each_source():
    config = QuantizationConfig.from_hf(fp8_block())
    assert config.linear("model.layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")) == BLOCK
    partly = QuantizationConfig.from_hf(fp8_block(modules_to_not_convert=["model.layers.0.self_attn.k_proj"]))
    with pytest.raises(QuantConfigError, match=r"model\.layers\.0\.self_attn\.qkv_proj packs .*k_proj: unquantized"):
        partly.linear("model.layers.0.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))


def test_resolve():
    plain = make_config("tiny-llama")
    assert QuantizationConfig.resolve(plain, None) is None
    online = QuantizationConfig.resolve(plain, "fp8")
    assert online.default == LayerQuantConfig("per_channel", "dynamic_per_token", online=True)
    quantized = make_config("tiny-llama", quantization_config=fp8_block())
    assert QuantizationConfig.resolve(quantized, None).default == BLOCK  # the checkpoint's own config applies
    assert QuantizationConfig.resolve(quantized, "fp8").default == BLOCK
    with pytest.raises(QuantConfigError, match="unknown quantization 'int4'"):
        QuantizationConfig.resolve(plain, "int4")


def test_manifest_round_trip():
    config = QuantizationConfig.from_hf(fp8_block(modules_to_not_convert=["mlp.gate_proj"]))
    config.overrides.append(("*.o_proj", LayerQuantConfig("per_channel", "none")))
    again = QuantizationConfig.from_dict(config.to_dict())
    assert again == config and again.default.block_size == (128, 128)


@pytest.mark.parametrize(
    "hf,message",
    [
        ({"quant_method": "awq", "bits": 4}, r"quantization_config\.quant_method 'awq' is not supported"),
        ({"bits": 4}, r"quantization_config\.quant_method None is not supported"),
        (fp8_block(fmt="e5m2"), r"quantization_config\.fmt 'e5m2'"),
        (fp8_block(weight_block_size=[128]), r"quantization_config\.weight_block_size must be two positive integers"),
        (fp8_block(activation_scheme="static"), r"activation_scheme 'static' with weight_block_size"),
        (fp8_block(activation_scheme="sometimes"), r"quantization_config\.activation_scheme must be"),
        (fp8_block(modules_to_not_convert="lm_head"), r"quantization_config\.modules_to_not_convert must be a list"),
        (
            compressed_tensors({"strategy": "tensor", "num_bits": 4}, None),
            r"config_groups\.group_0\.weights: only 8-bit float",
        ),
        (compressed_tensors({"strategy": "group", "group_size": 128}, None), r"group_0\.weights\.strategy 'group'"),
        (compressed_tensors({"strategy": "tensor", "symmetric": False}, None), r"group_0\.weights\.symmetric"),
        (
            compressed_tensors({"strategy": "tensor"}, {**FP8_ARGS, "strategy": "token", "dynamic": False}),
            r"group_0\.input_activations: strategy 'token' with dynamic=False",
        ),
        (
            compressed_tensors({"strategy": "block", "block_structure": [128, 0]}, None),
            r"group_0\.weights\.block_structure must be two positive integers",
        ),
        (compressed_tensors({"strategy": "tensor"}, None, targets=[]), r"group_0\.targets must be a non-empty list"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, r"quantization_config\.config_groups"),
        (
            compressed_tensors({"strategy": "tensor"}, None, format="pack-quantized"),
            r"quantization_config\.format 'pack-quantized'",
        ),
        (
            compressed_tensors({"strategy": "tensor"}, None, kv_cache_scheme={**FP8_ARGS, "strategy": "head"}),
            r"quantization_config\.kv_cache_scheme must be static per tensor",
        ),
    ],
)
def test_malformed_configs_name_the_key(hf, message):
    with pytest.raises(QuantConfigError, match=message):
        QuantizationConfig.from_hf(hf)
