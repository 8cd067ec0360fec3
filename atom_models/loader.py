"""Build a model from an HF directory: config, dtype, device, quantization, and safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from atom_models.layers import Linear
from atom_models.quantization import QuantConfigError, QuantizationConfig
from atom_models.quantization.config import checkpoint_names, matches
from atom_models.registry import model_class_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint tensors that hold nothing the model needs (recomputed at build time).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoint name endings -> ours: KV-cache scales belong to the attention layer that writes the
# cache (compressed-tensors' names, and the older output_scale of k/v_proj); the fp8 format's
# `weight_scale_inv` multiplies the weight like every other `weight_scale`.
RENAMED_SUFFIXES = (
    (".self_attn.k_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_scale", ".self_attn.attn.v_scale"),
    (".self_attn.k_proj.output_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_proj.output_scale", ".self_attn.attn.v_scale"),
    (".weight_scale_inv", ".weight_scale"),
)


class WeightLoadError(ValueError):
    pass


def load_config(model_dir: str | Path) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not an HF model directory")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:  # not JSON (transformers says OSError), a field of the wrong type, ...: the user's file
        raise ValueError(f"{path / 'config.json'} could not be read: {str(error).partition(chr(10))[0]}") from None


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' is the GPU where torch sees one; a device that is not there is the user's error, named."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = str(device)
    try:
        device = torch.device(device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"no {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype from config.json (float32 if it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, found) if isinstance(found, str) else found
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_max_model_len(requested: int | None, config: PretrainedConfig) -> int:
    """The context a model is exported or served for: the model's max_position_embeddings unless less is asked."""
    if requested is None:
        return config.max_position_embeddings
    if requested > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    return requested


@contextmanager
def default_dtype_and_device(dtype: torch.dtype, device: torch.device):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantizationConfig | dict | str | None = None,
    quant_exclude: Sequence[str] = (),
) -> nn.Module:
    """The model with uninitialised weights, allocated directly on `device`.

    `quant`, `quant_exclude`: see `QuantizationConfig.resolve` (a checkpoint's own quantization_config always
    applies); an exclusion that names no projection of the model (ours or a checkpoint module it packs) is refused
    as the mistake it is (a misspelt name).
    """
    quant_config = QuantizationConfig.resolve(config, quant, quant_exclude)
    with default_dtype_and_device(dtype, device):
        model = model_class_for(config)(config, quant=quant_config).eval()
    names = {name for m in projections(model) for name in (m.prefix, *checkpoint_names(m.prefix, m.packed_from))}
    unmatched = [pattern for pattern in quant_exclude if not any(matches(pattern, name) for name in names)]
    if unmatched:
        raise QuantConfigError(f"--quantization-exclude {', '.join(map(repr, unmatched))}: no projection of the model")
    return model


def projections(model: nn.Module) -> list[Linear]:
    """The model's linear layers (quantized or not; the LM head is not one)."""
    return [module for module in model.modules() if isinstance(module, Linear)]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
        for file in files:
            if not file.is_file():
                raise WeightLoadError(f"{index.name} names {file.name}, which is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if (model_dir / "manifest.json").is_file():
            raise WeightLoadError(f"{model_dir} is an atom artifact, not a model directory (export from its source)")
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_checkpoint(model_dir: Path, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    handles = []
    for file in checkpoint_files(model_dir):
        try:
            handles.append(safe_open(str(file), framework="pt", device="cpu"))
        except Exception as error:  # safetensors' own error type is not importable on every version
            raise WeightLoadError(f"{file} is not a readable safetensors file: {error}") from error
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, handle.get_tensor(name)
                bar.update(1)


def parameter_name(model: nn.Module, checkpoint_name: str) -> tuple[str, str | int | None]:
    """Map a checkpoint tensor name onto (our parameter name, shard id)."""
    for suffix, ours in RENAMED_SUFFIXES:
        if checkpoint_name.endswith(suffix):
            checkpoint_name = checkpoint_name.removesuffix(suffix) + ours
    for source, (target, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{source}." in checkpoint_name:
            return checkpoint_name.replace(f".{source}.", f".{target}."), shard_id
    return checkpoint_name, None


def load_weights(model: nn.Module, model_dir: str | Path, progress: bool = True) -> None:
    """Copy every checkpoint tensor into its parameter; fail naming the first tensor that does not fit."""
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected = set()
    for name, param in params.items():
        if getattr(param, "weight_loader", None) is not None:
            shard_ids = getattr(param, "shard_ids", None) or [None]
            expected.update((name, shard_id) for shard_id in shard_ids)
    loaded = set()
    for checkpoint_name, tensor in iterate_checkpoint(model_dir, progress):
        if checkpoint_name.endswith(IGNORED_SUFFIXES) or (tied and checkpoint_name == "lm_head.weight"):
            continue
        name, shard_id = parameter_name(model, checkpoint_name)
        if (name, shard_id) not in expected:
            raise WeightLoadError(
                f"unexpected tensor {checkpoint_name} {tuple(tensor.shape)} in the checkpoint: "
                f"{type(model).__name__} has no parameter for it"
            )
        param = params[name]
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as error:
            raise WeightLoadError(f"tensor {checkpoint_name}: {error}") from None
        loaded.add((name, shard_id))
    missing = sorted(expected - loaded, key=str)
    if missing:
        shown = ", ".join(f"{n}[{s}]" if s is not None else n for n, s in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightLoadError(f"the checkpoint in {model_dir} lacks {shown}{more}")


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    quant: QuantizationConfig | dict | str | None = None,
    progress: bool = True,
) -> nn.Module:
    config = load_config(model_dir)
    model = build_model(config, resolve_dtype(dtype, config), torch.device(device), quant)
    load_weights(model, model_dir, progress)
    return model


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarking without a checkpoint (ATOM's --load_dummy).

    Quantized linear layers fill their FP8 weights and scales themselves; other scales
    (KV-cache ones) keep their defaults.
    """
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    filled = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.quant is not None:
            module.fill_dummy(generator, 0.02)
            filled.add(id(module.weight))
    for name, param in model.named_parameters():
        if id(param) in filled or getattr(param, "quant_scale", False):
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
