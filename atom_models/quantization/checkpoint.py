"""FP8 checkpoints in the HF formats, written from an unquantized one, and their dequantized weights.

There is no model hub here: tests and benchmarks make the formats people publish themselves.

    python -m atom_models.quantization.checkpoint SRC DST --format fp8-block
    python -m atom_models.quantization.checkpoint SRC DST --format compressed-tensors --weights per_tensor \
        --activations static_per_tensor --kv-cache-scales

`write_fp8_checkpoint` quantizes every linear layer (lm_head and `ignore` excluded) as the
format stores it: `fp8` with `weight_block_size` (e4m3 weights + `weight_scale_inv` per block,
DeepSeek-V3 / Qwen3-FP8), or compressed-tensors (`weight_scale` per tensor, channel or block,
`input_scale` for static activations, `k_scale`/`v_scale` with a `kv_cache_scheme`). Static
scales are calibrated on random prompts: the largest input of each layer (and the largest key
and value) over them, divided by 448. `dequantized_state_dict` reads such a checkpoint back as
float weights: the reference model that FP8 inference should match.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from atom_models.ops.quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    dequantize_weight,
    quantize_weight,
)
from atom_models.quantization.config import LayerQuantConfig, QuantizationConfig

FORMATS = ("fp8-block", "compressed-tensors")
CALIBRATION_PROMPTS, CALIBRATION_LEN = 4, 64
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".k_scale", ".v_scale")
# How far a rotation can stretch a key element: RoPE turns (x_i, x_j) pairs, so |x'_i| <= sqrt(2) max|x|.
ROPE_GROWTH = math.sqrt(2.0)


def _hf_quantization_config(fmt: str, spec: LayerQuantConfig, ignore: list[str], kv_cache_scales: bool) -> dict:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(spec.block_size),
            "modules_to_not_convert": ignore,
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    strategy = {"per_tensor": "tensor", "per_channel": "channel", "block": "block"}[spec.weights]
    weights = {**fp8, "strategy": strategy, "dynamic": False}
    if spec.block_size:
        weights["block_structure"] = list(spec.block_size)
    token = {"strategy": "token"}
    if spec.weights == "block":  # as llm-compressor's FP8_BLOCK scheme writes it
        token = {"strategy": "group", "group_size": spec.block_size[1]}
    inputs = {
        "dynamic_per_token": {**fp8, **token, "dynamic": True},
        "static_per_tensor": {**fp8, "strategy": "tensor", "dynamic": False},
        "none": None,
    }[spec.activations]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
        "ignore": ignore,
        "kv_cache_scheme": {**fp8, "strategy": "tensor", "dynamic": False} if kv_cache_scales else None,
    }


@torch.no_grad()
def _calibrate(model: nn.Module, vocab_size: int, seed: int) -> tuple[dict[str, float], dict[str, float]]:
    """Largest |input| of every linear layer, and largest |key| / |value| (as cached) of every attention."""
    inputs: dict[str, float] = {}
    outputs: dict[str, float] = {}

    def record(table: dict[str, float], name: str, value: Tensor) -> None:
        table[name] = max(table.get(name, 0.0), value.abs().max().item())

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: record(inputs, n, a[0])))
        if name.endswith(("k_proj", "v_proj", "k_norm")):  # keys are cached after Qwen3's k_norm
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: record(outputs, n, o)))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (CALIBRATION_PROMPTS, CALIBRATION_LEN), generator=generator)
    model(ids)
    for hook in hooks:
        hook.remove()
    return inputs, outputs


def write_fp8_checkpoint(
    source: str | Path,
    target: str | Path,
    fmt: str = "fp8-block",
    spec: LayerQuantConfig | None = None,
    *,
    ignore: list[str] | None = None,
    kv_cache_scales: bool = False,
    seed: int = 0,
) -> Path:
    """Quantize the checkpoint in `source` into `target` in format `fmt` (see the module docstring).

    `spec` defaults to 128x128 blocks with dynamic activations for fp8-block and per-channel
    weights for compressed-tensors; the fp8 format has only block weights here.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 checkpoint format {fmt!r}; choose one of {', '.join(FORMATS)}")
    spec = spec or LayerQuantConfig(
        "block" if fmt == "fp8-block" else "per_channel", block_size=(128, 128) if fmt == "fp8-block" else None
    )
    if fmt == "fp8-block" and (spec.weights != "block" or spec.activations != "dynamic_per_token" or kv_cache_scales):
        raise ValueError("the fp8-block format holds block weights with dynamic activations and no KV-cache scales")
    source, target = Path(source), Path(target)
    ignore = list(ignore or ["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    needs_calibration = spec.activations == "static_per_tensor" or kv_cache_scales
    input_amax, kv_amax = _calibrate(model, model.config.vocab_size, seed) if needs_calibration else ({}, {})
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    excluded = QuantizationConfig("writer", spec, exclude=ignore)
    tensors: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in linears and excluded.layer(module) is not None:
            weight, scale = quantize_weight(tensor, spec.weights, spec.block_size)
            tensors[name] = weight
            tensors[f"{module}.weight_scale_inv" if fmt == "fp8-block" else f"{module}.weight_scale"] = scale
            if spec.activations == "static_per_tensor":
                tensors[f"{module}.input_scale"] = _scale(input_amax[module])
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    if kv_cache_scales:
        for module in {n.rpartition(".")[0] for n in kv_amax}:
            keys = kv_amax.get(f"{module}.k_norm", kv_amax[f"{module}.k_proj"])
            tensors[f"{module}.k_scale"] = _scale(keys * ROPE_GROWTH)
            tensors[f"{module}.v_scale"] = _scale(kv_amax[f"{module}.v_proj"])
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _hf_quantization_config(fmt, spec, ignore, kv_cache_scales)
    config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(file, target / file.name)
    return target


def _scale(amax: float) -> Tensor:
    return torch.tensor([max(amax / FP8_MAX, MIN_SCALE)], dtype=torch.float32)


def dequantized_state_dict(model_dir: str | Path) -> dict[str, Tensor]:
    """The checkpoint's tensors with every FP8 weight multiplied out to fp32 and the scales dropped."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    block = config.get("quantization_config", {}).get("weight_block_size")
    for group in config.get("quantization_config", {}).get("config_groups", {}).values():
        block = group["weights"].get("block_structure", block)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
    out = {}
    for name, tensor in tensors.items():
        if tensor.dtype == FP8_DTYPE:
            module = name.removesuffix(".weight")
            scale = tensors.get(f"{module}.weight_scale_inv", tensors.get(f"{module}.weight_scale"))
            rows, cols = tensor.shape
            is_block = block is not None and tuple(scale.shape) == (-(-rows // block[0]), -(-cols // block[1]))
            out[name] = dequantize_weight(tensor, scale, tuple(block) if is_block else None)
        elif not name.endswith(SCALE_SUFFIXES):
            out[name] = tensor.float()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write an FP8 checkpoint in an HF format from an unquantized one.")
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--format", default="fp8-block", choices=FORMATS)
    parser.add_argument("--weights", default=None, choices=["per_tensor", "per_channel", "block"])
    parser.add_argument(
        "--activations", default="dynamic_per_token", choices=["dynamic_per_token", "static_per_tensor", "none"]
    )
    parser.add_argument("--block-size", type=int, nargs=2, default=[128, 128])
    parser.add_argument("--kv-cache-scales", action="store_true", help="calibrate k_scale/v_scale (compressed-tensors)")
    args = parser.parse_args()
    weights = args.weights or ("block" if args.format == "fp8-block" else "per_channel")
    block = tuple(args.block_size) if weights == "block" else None
    spec = LayerQuantConfig(weights, args.activations, block)
    write_fp8_checkpoint(args.source, args.target, args.format, spec, kv_cache_scales=args.kv_cache_scales)
    print(f"wrote {args.format} ({spec.describe()}) to {args.target}")


if __name__ == "__main__":
    main()
