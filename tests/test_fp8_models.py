"""FP8 models end to end: checkpoints in the HF formats (made here), loading and its errors, the quant
fusion passes, and exported artifacts against the dequantized-weights HF model.

The tiny models have block-aligned packed shards (q 256, k/v 128, gate/up 256 rows) and a hidden
size of 192, so o_proj/down_proj outputs and qkv/gate_up inputs end in partial 128-blocks. They
use HF's default 0.02 init: random models with wider inits are chaotic enough that FP8 activation
noise alone flips a third of their greedy tokens (see `AGREEMENT`).
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import atom_compile as ac
from atom_compile.cli import main as compile_cli
from atom_compile.export import ExportOptions, trace_model_dir
from atom_compile.passes import run_passes
from atom_compile.reference import prompt_step
from atom_compile.trace import graph_arguments, model_weights
from atom_models import WeightLoadError, load_model
from atom_models.checkpoints import make_config_only, make_random_checkpoint
from atom_models.layers import Linear
from atom_models.ops.quant import FP8_DTYPE, dequantize_weight
from atom_models.quantization import LayerQuantConfig, QuantizationConfig
from atom_models.quantization.checkpoint import dequantized_state_dict, write_fp8_checkpoint
from atom_runtime import LLM, SamplingParams
from atom_runtime.engine_args import add_engine_args, create_engine_kwargs
from atom_runtime.loading import create_core
from tests.test_passes import ops

TINY = dict(
    hidden_size=192,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    initializer_range=0.02,
)
# Greedy tokens of the FP8 artifact that must equal the dequantized-weights HF model's choice, with the
# HF model fed the artifact's own tokens (teacher forcing, so one early flip does not decide the rest).
# The HF reference keeps its activations (and KV) unquantized; FP8 per-token activations perturb each
# linear layer's output by ~3-4 % (e4m3's 2^-4 rounding), which flips the argmax wherever the top two
# logits of a random model lie closer than that: 0-10 % of positions at this init (measured 90-100 %
# agreement), ~40 % at init 0.2. A wrong scale or shard layout gives about 1/vocab agreement.
AGREEMENT = 0.8


@pytest.fixture(scope="module")
def fp8_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def sources(fp8_root):
    return {
        "llama": make_random_checkpoint(fp8_root / "llama", "tiny-llama", seed=11, **TINY),
        "qwen3": make_random_checkpoint(fp8_root / "qwen3", "tiny-qwen3", seed=12, **TINY),
    }


@pytest.fixture(scope="module")
def block_llama(sources, fp8_root):
    """quant_method fp8, 128x128 weight blocks, dynamic activations (DeepSeek-V3 / Qwen3-FP8 style)."""
    return write_fp8_checkpoint(sources["llama"], fp8_root / "llama-fp8-block", "fp8-block")


@pytest.fixture(scope="module")
def channel_qwen3(sources, fp8_root):
    """compressed-tensors: per-channel weights, dynamic per-token activations, calibrated KV-cache scales."""
    spec = LayerQuantConfig("per_channel", "dynamic_per_token")
    return write_fp8_checkpoint(
        sources["qwen3"], fp8_root / "qwen3-ct-channel", "compressed-tensors", spec, kv_cache_scales=True
    )


@pytest.fixture(scope="module")
def static_llama(sources, fp8_root):
    """compressed-tensors: per-tensor weights, static per-tensor activations (calibrated input_scale)."""
    spec = LayerQuantConfig("per_tensor", "static_per_tensor")
    return write_fp8_checkpoint(sources["llama"], fp8_root / "llama-ct-static", "compressed-tensors", spec)


def dequantized_hf(model_dir):
    """The HF model with every FP8 weight multiplied out: the numbers FP8 inference approximates."""
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(dequantized_state_dict(model_dir), strict=not config.tie_word_embeddings)
    return model


def test_checkpoint_formats(block_llama, channel_qwen3, static_llama):
    block = load_file(block_llama / "model.safetensors")
    assert block["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    assert block["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)  # 256 x 192 in 128-blocks
    assert block["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 2)  # 192 x 256
    assert block["lm_head.weight"].dtype == torch.bfloat16
    config = json.loads((block_llama / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    channel = load_file(channel_qwen3 / "model.safetensors")
    assert channel["model.layers.1.mlp.up_proj.weight_scale"].shape == (256, 1)
    assert channel["model.layers.1.self_attn.k_scale"].numel() == 1
    static = load_file(static_llama / "model.safetensors")
    assert static["model.layers.0.mlp.gate_proj.weight_scale"].numel() == 1
    assert static["model.layers.0.mlp.gate_proj.input_scale"].numel() == 1


@pytest.mark.parametrize("which", ["block_llama", "channel_qwen3", "static_llama"])
def test_loaded_weights_are_the_checkpoints(which, request):
    """Every packed shard, scale and layout: our dequantized weights equal the checkpoint's, exactly."""
    model_dir = request.getfixturevalue(which)
    model = load_model(model_dir, dtype="float32", progress=False)
    reference = dequantized_state_dict(model_dir)
    layer = model.model.layers[1]
    sources = {
        layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
        layer.mlp.down_proj: ["mlp.down_proj"],
    }
    for linear, names in sources.items():
        assert linear.weight.dtype == FP8_DTYPE and linear.quant is not None
        got = dequantize_weight(linear.weight, linear.weight_scale, linear.quant.block_size)
        expected = torch.cat([reference[f"model.layers.1.{n}.weight"] for n in names])
        assert torch.equal(got, expected), names
    if which == "channel_qwen3":
        scales = load_file(model_dir / "model.safetensors")
        assert torch.equal(layer.self_attn.attn.k_scale, scales["model.layers.1.self_attn.k_scale"].reshape(1))
    if which == "static_llama":  # one input scale for q, k and v: the largest
        scales = load_file(model_dir / "model.safetensors")
        shards = [scales[f"model.layers.1.self_attn.{s}_proj.input_scale"] for s in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.input_scale, torch.stack(shards).max().reshape(1))


@pytest.fixture
def edited(tmp_path, block_llama):
    """A writable copy of the block-FP8 checkpoint and a function that rewrites its tensors."""
    target = tmp_path / "model"
    shutil.copytree(block_llama, target)

    def edit(change) -> None:
        tensors = load_file(target / "model.safetensors")
        change(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})

    return target, edit


def test_scale_shape_that_does_not_fit(edited):
    model_dir, edit = edited
    edit(lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight_scale_inv", torch.ones(2, 2)))
    with pytest.raises(
        WeightLoadError,
        match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv: scale shape \(2, 2\) does not fit "
        r"a \[128, 192\] weight in 128x128 blocks: expected \(1, 2\)",
    ):
        load_model(model_dir, progress=False)


def test_unquantized_weight_where_fp8_is_expected(edited):
    model_dir, edit = edited
    edit(lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(256, 192, dtype=torch.bfloat16)))
    with pytest.raises(WeightLoadError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight: expected float8_e4m3fn"):
        load_model(model_dir, progress=False)


def test_missing_scale(edited):
    model_dir, edit = edited
    edit(lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(WeightLoadError, match=r"lacks model\.layers\.1\.mlp\.gate_up_proj\.weight_scale\[1\]"):
        load_model(model_dir, progress=False)


def test_fp8_weights_without_a_quantization_config(edited):
    model_dir, _ = edited
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        WeightLoadError, match=r"tensor model\.layers\.\d\.\S+\.weight: the checkpoint holds FP8 weights here"
    ):
        load_model(model_dir, progress=False)


def test_packed_shards_off_block_boundaries(edited):
    model_dir, _ = edited
    config = json.loads((model_dir / "config.json").read_text())
    config["head_dim"] = 48  # k and v shards of 96 rows
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj: output sizes \[192, 96, 96\]"):
        load_model(model_dir, progress=False)


def traced_logits(model, traced, caches_dtype=torch.float32):
    ids, positions, caches, meta, logits_indices = prompt_step(model.config, 13, torch.device("cpu"), torch.float32)
    caches = [c.to(caches_dtype) for c in caches]
    args = graph_arguments(traced.inputs, model_weights(model), ids, positions, caches, meta, logits_indices)
    with torch.inference_mode():
        return traced.graph_module(*args)[0], caches, ids


@pytest.mark.parametrize(
    "which,attention_pass", [("block_llama", "rope_cache"), ("channel_qwen3", "qk_norm_rope_cache")]
)
def test_quant_fusions_fire(which, attention_pass, request):
    model_dir = request.getfixturevalue(which)
    model, traced = trace_model_dir(model_dir, ExportOptions(device="cpu", dtype="float32"))
    layers = model.config.num_hidden_layers
    before = ops(traced.graph_module)
    assert before["atom.quant_fp8_per_token.default"] == 4 * layers
    logits, caches, ids = traced_logits(model, traced, FP8_DTYPE)
    records = run_passes(traced.graph_module, ["rms_norm_quant", "silu_mul_quant", attention_pass, "cleanup"])
    matches = {r.name: r.matches for r in records}
    assert matches["rms_norm_quant"] == 2 * layers and matches["silu_mul_quant"] == layers
    assert matches[attention_pass] == layers
    after = ops(traced.graph_module)
    # every quantization but o_proj's input went into a norm or the activation
    assert after["atom.quant_fp8_per_token.default"] == layers
    assert after["atom.fused_add_rms_norm_quant_fp8.default"] == 2 * layers - 1
    assert after["atom.silu_and_mul_quant_fp8.default"] == layers
    block = "atom.scaled_mm_blockwise.default" if which == "block_llama" else "atom.scaled_mm.default"
    assert after[block] == 4 * layers
    if which == "block_llama":  # activations get a scale per token and 128 columns (the weight blocks), fused too
        quants = [n for n in traced.graph_module.graph.nodes if "quant_fp8" in str(n.target)]
        assert len(quants) == 4 * layers and all(n.args[-1] == 128 for n in quants)
    if which == "channel_qwen3":  # the calibrated KV scales follow into the fused cache write
        fused = [n for n in traced.graph_module.graph.nodes if "qk_norm_rope_and_cache" in str(n.target)]
        assert all(len(n.args) == 12 for n in fused)
    # the fused ops' references compose the unfused ones: same logits and same FP8 caches
    fused_logits, fused_caches, _ = traced_logits(model, traced, FP8_DTYPE)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, fused_caches, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # and within FP8 tolerance of the dequantized-weights model (unquantized activations and cache)
    with torch.inference_mode():
        expected = dequantized_hf(model_dir)(ids[None]).logits[0]
    assert ((fused_logits - expected).norm() / expected.norm()).item() < 0.15


def teacher_forced_agreement(llm: LLM, hf, prompt: list[int], max_tokens: int = 48) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0].token_ids
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    predicted = logits[len(prompt) - 1 : -1].argmax(-1)
    return (predicted == torch.tensor(tokens)).float().mean().item()


@pytest.mark.parametrize("which", ["block_llama", "channel_qwen3", "static_llama"])
def test_artifact_generates_like_dequantized_hf(which, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    manifest = ac.export(model_dir, tmp_path / "artifact", device="cpu", level=0, dtype="float32")
    quantization = manifest["quantization"]
    assert quantization["method"] == ("fp8" if which == "block_llama" else "compressed-tensors")
    assert QuantizationConfig.from_dict(quantization) == QuantizationConfig.resolve(
        AutoConfig.from_pretrained(model_dir), None
    )
    fused = {p["name"]: p["matches"] for p in manifest["passes"]}
    dynamic = which != "static_llama"
    assert fused["rms_norm_quant"] == (4 if dynamic else 0) and fused["silu_mul_quant"] == (2 if dynamic else 0)
    # per-token quantizers and their GEMMs (each layer's four); block scales keep scaled_mm_blockwise
    assert fused["fp8_linear"] == (8 if which == "channel_qwen3" else 0)
    assert manifest["kv_cache_scales"] == (
        "per-tensor, from the checkpoint" if which == "channel_qwen3" else "per-tensor, 1.0"
    )
    hf = dequantized_hf(model_dir)
    prompt = list(range(40, 72))
    for kv_cache_dtype in ("auto", "fp8", "fp8_per_token_head"):
        llm = LLM(tmp_path / "artifact", kv_cache_dtype=kv_cache_dtype, max_model_len=128)
        runner = llm.engine.core.runner
        caches = runner.kv_caches  # what the KV budget counts is what is allocated, the inline scales' slot too
        assert runner.block_bytes * runner.num_blocks == sum(c.numel() * c.element_size() for c in caches)
        try:
            agreement = teacher_forced_agreement(llm, hf, prompt)
        finally:
            llm.shutdown()
        assert agreement >= AGREEMENT, (kv_cache_dtype, agreement)


def fp8_projections(named_weights) -> dict[str, bool]:
    """Projection weight name -> whether it is FP8."""
    return {name: w.dtype == FP8_DTYPE for name, w in named_weights if name.endswith("proj.weight")}


def test_online_fp8_leaves_excluded_layers_unquantized(tiny_llama, block_llama, tmp_path, capsys):
    """`--quantization fp8 --quantization-exclude 'model.layers.0.*'`: the first layer's projections stay in the
    model dtype (the FP8 accuracy study's recipe for 97% top-1), the manifest records the exclusion and the served
    model is built with it. Refused with a one-line error, nothing written: without --quantization, a pattern that
    names no projection (even beside one that does), a bad regex, half of a packed projection, and a checkpoint
    that is quantized already (its own ignore list decides)."""
    base = ["export", str(tiny_llama), "--device", "cpu", "--level", "0", "--dtype", "float32"]
    artifact = tmp_path / "artifact"
    exported = [*base, "-o", str(artifact), "--quantization", "fp8", "--quantization-exclude", "model.layers.0.*"]
    assert compile_cli(exported) == 0
    assert "4 of 8 projections left unquantized (model.layers.0.*)" in capsys.readouterr().err
    assert "model.layers.0.*" in json.loads((artifact / "manifest.json").read_text())["quantization"]["exclude"]
    llm = LLM(artifact, max_model_len=64)
    try:
        fp8 = fp8_projections(llm.engine.core.runner.model.forward.weights.items())  # built from the manifest
        assert len(fp8) == 8 and all(quantized != name.startswith("model.layers.0.") for name, quantized in fp8.items())
        out = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match=r"quantization_exclude \('model.layers.1.\*',\) \(exported with"):
            create_core(artifact, quantization_exclude=("model.layers.1.*",))
    finally:
        llm.shutdown()
    excluding = lambda *patterns: ["--quantization", "fp8", *(f"--quantization-exclude={p}" for p in patterns)]
    for i, (edit, error) in enumerate(
        [
            (["--quantization-exclude", "model.layers.0.*"], "needs --quantization fp8"),
            (excluding("model.layers.0.*", "model.layer.1.*"), "'model.layer.1.*': no projection of the model"),
            (excluding("re:model.layers.[0"), "'re:model.layers.[0' is not a regular expression"),
            (excluding("*.q_proj"), "exclude all of them, or qkv_proj itself"),
        ]
    ):
        assert compile_cli([*base, "-o", str(tmp_path / str(i)), *edit]) == 2
        assert error in capsys.readouterr().err
        assert not (tmp_path / str(i)).exists()
    quantized = ["export", str(block_llama), "-o", str(tmp_path / "q"), "--device", "cpu", *excluding("lm_head")]
    assert compile_cli(quantized) == 2
    assert "this one is quantized" in capsys.readouterr().err


def test_served_hf_model_leaves_excluded_layers_unquantized(tiny_llama):
    """`atom-run serve DIR --quantization fp8 --quantization-exclude ...` on an HF directory (eager): a packed
    projection excluded by our name for it (qkv_proj) as well as by its checkpoint modules' names."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--quantization", "fp8", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64"]
    exclude = ["--quantization-exclude", "*.qkv_proj", "--quantization-exclude", "re:.*layers\\.1\\.mlp\\.(gate|up)"]
    engine_kwargs = create_engine_kwargs(parser.parse_args([*flags, *exclude]))
    assert engine_kwargs["quantization_exclude"] == ("*.qkv_proj", "re:.*layers\\.1\\.mlp\\.(gate|up)")
    del engine_kwargs["generation_config"]  # the front end's (create_engine), not the core's
    core, _ = create_core(tiny_llama, **engine_kwargs)
    fp8 = fp8_projections(core.runner.model.forward.named_parameters())
    unquantized = {name for name, quantized in fp8.items() if not quantized}
    assert unquantized == {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in (0, 1)} | {
        "model.layers.1.mlp.gate_up_proj.weight"
    }


@pytest.mark.slow
def test_compiled_artifact_matches_eager(static_llama, tmp_path):
    """Inductor compiles the FP8 pieces (static quantization is plain torch ops it fuses) to the same numbers."""
    ac.export(static_llama, tmp_path / "artifact", device="cpu", level=3, dtype="float32")
    result = ac.compare(tmp_path / "artifact")
    assert result["argmax_equal"] and result["max_rel_diff"] < 1e-4, result


def test_dummy_weights_for_fp8_configs(tmp_path):
    """--load-dummy (benchmarks) on an FP8 config: random FP8 weights with sane scales, finite logits."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model_dir = make_config_only(tmp_path / "config", "tiny-llama", quantization_config=quant, **TINY)
    llm = LLM(model_dir, device="cpu", load_dummy=True, dtype="float32")
    try:
        model = llm.engine.core.runner.model.forward
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.weight.dtype == FP8_DTYPE and (m.weight_scale > 0).all() for m in linears)
        out = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
