"""From a path to a running engine: model (HF directory now, artifact once compiled), tokenizer, KV cache."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import jinja2
import torch
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from atom_compile import is_artifact, load_artifact
from atom_compile.artifact import read_manifest
from atom_compile.options import DEFAULT_BLOCK_SIZE
from atom_models import load_config, resolve_device, resolve_dtype, resolve_max_model_len
from atom_models.loader import build_model, fill_dummy_weights, load_weights
from atom_models.ops import default_backend, set_backend
from atom_runtime.async_engine import AsyncEngine
from atom_runtime.config import EngineConfig
from atom_runtime.core_client import CoreProcess, CoreThread
from atom_runtime.engine_core import EngineCore
from atom_runtime.model_runner import LoadedModel, ModelRunner
from atom_runtime.sampler import Sampler
from atom_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What vLLM takes from a model's generation_config.json as its sampling defaults (`--generation-config auto`), under
# SamplingParams' names: the model maker's recommended settings, for requests that leave them out.
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",  # a cap on every request's, as vLLM's
}


def load_hf_model(
    model_dir: str | Path,
    dtype: str | torch.dtype,
    device: torch.device,
    quant: str | None,
    load_dummy: bool,
    quant_exclude: Sequence[str] = (),
) -> LoadedModel:
    config = load_config(model_dir)
    set_backend(default_backend(device))
    model = build_model(config, resolve_dtype(dtype, config), device, quant, quant_exclude)
    if load_dummy:
        fill_dummy_weights(model)
    else:
        load_weights(model, model_dir)
    return LoadedModel(model, config, resolve_dtype(dtype, config), device, str(model_dir))


def _refuse_overrides(path, **given) -> None:
    """Export settings given again to serve an artifact: what it was exported with passes (a vLLM user's habit of
    --dtype bfloat16), anything else is refused, as only a re-export changes it."""
    manifest = read_manifest(Path(path))
    options = manifest.get("export_options", {})
    exported = {
        "dtype": manifest.get("dtype"),
        "device": manifest.get("device"),
        "quantization": options.get("quantization"),
        "quantization_exclude": tuple(options.get("quantization_exclude", ())),
        "load_dummy": options.get("load_dummy", False),
    }
    unset = {"dtype": "auto", "device": "auto", "quantization": None, "quantization_exclude": (), "load_dummy": False}
    changed = [
        f"{name} {value!r} (exported with {exported[name]!r})"
        for name, value in given.items()
        if value != unset[name] and _one_spelling(name, value) != _one_spelling(name, exported[name])
    ]
    if changed:
        raise ValueError(
            f"{path} is a compiled artifact, its export settings fixed: {', '.join(changed)}; "
            "re-export with atom-compile to change them"
        )


def _one_spelling(name: str, value):
    """An export setting as one spelling of it: torch.bfloat16 as "bfloat16", "cuda" as "cuda:0"."""
    if name == "dtype":
        return str(value).removeprefix("torch.")
    if name == "device":
        return str(value) if ":" in str(value) else f"{value}:0"
    return value


def eos_token_ids(model_dir: str | Path, config: PretrainedConfig, tokenizer) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    if (Path(model_dir) / "generation_config.json").is_file():
        add(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    return ids


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto") -> dict:
    """The sampling settings a generation_config.json sets (GENERATION_DEFAULTS): the model's own with "auto", none
    with "vllm", or those of the file in the directory `generation_config` names."""
    if generation_config == "vllm":
        return {}
    source = Path(model_dir if generation_config == "auto" else generation_config)
    if not (source / "generation_config.json").is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {generation_config}: no generation_config.json in that directory")
    values = GenerationConfig.from_pretrained(source).to_diff_dict()
    defaults = {ours: values[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if values.get(theirs) is not None}
    SamplingParams(**defaults)  # refuse values no request could set
    return defaults


def read_chat_template(value: str) -> str:
    """vLLM's `--chat-template`: a file's path, or the Jinja template itself; checked to compile."""
    path = Path(value)
    if path.is_file():
        value = path.read_text()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template {str(path)!r}: no such file")
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template: {error.message} (line {error.lineno})") from None
    return value


def load_compiled_model(path: str | Path, rebuild: bool) -> tuple[LoadedModel, dict]:
    compiled = load_artifact(path, rebuild=rebuild)
    loaded = LoadedModel(compiled, compiled.config, compiled.dtype, compiled.device, str(compiled.path))
    return loaded, compiled.manifest


def served_block_size(requested: int | None, manifest: dict, artifact: str | Path) -> int:
    """The artifact's block size unless another is asked for, which only a CPU artifact can serve: on a GPU the
    attention kernels it ships are compiled for its block size (a constexpr), and serving compiles nothing."""
    exported = manifest.get("block_size", DEFAULT_BLOCK_SIZE)  # (artifacts before the field: the default)
    if requested is None:
        return exported
    if requested != exported and torch.device(manifest["device"]).type == "cuda":
        raise ValueError(
            f"block_size {requested}: {artifact} compiled its GPU kernels for block size {exported}; "
            f"serve it with that, or re-export it with --block-size {requested}"
        )
    return requested


def create_core(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    quantization: str | None = None,
    quantization_exclude: Sequence[str] = (),
    load_dummy: bool = False,
    rebuild: bool = False,
    config: EngineConfig | None = None,
) -> tuple[EngineCore, PreTrainedTokenizerBase]:
    """The engine core over an artifact or HF model directory, and the model's tokenizer."""
    config = config or EngineConfig()
    if is_artifact(model):
        _refuse_overrides(
            model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            quantization_exclude=tuple(quantization_exclude),
            load_dummy=load_dummy,
        )
        loaded, manifest = load_compiled_model(model, rebuild)
        if config.max_model_len is None:
            config.max_model_len = manifest["max_model_len"]
        config.block_size = served_block_size(config.block_size, manifest, model)
    else:
        loaded = load_hf_model(model, dtype, resolve_device(device), quantization, load_dummy, quantization_exclude)
        config.block_size = config.block_size or DEFAULT_BLOCK_SIZE
    config.max_model_len = resolve_max_model_len(config.max_model_len, loaded.config)
    tokenizer = AutoTokenizer.from_pretrained(loaded.model_dir)
    torch.manual_seed(config.seed)
    runner = ModelRunner(loaded, config, Sampler())
    eos = eos_token_ids(loaded.model_dir, loaded.config, tokenizer)
    return EngineCore(runner, config, eos, tokenizer), tokenizer


def create_engine(
    model: str | Path,
    *,
    served_model_name: str | None = None,
    engine_process: bool = False,
    generation_config: str = "auto",
    **core_args,
) -> AsyncEngine:
    """An engine over an artifact directory (compiled by atom-compile) or an HF model directory (eager).

    For an artifact, dtype, device and quantization come from its manifest; passing others is an error.
    `core_args` are `create_core`'s. With `engine_process`, the core loads and steps in a process of its
    own (what `atom-run serve` does, so HTTP work never holds the GIL that the step loop needs).
    `generation_config`: where requests' sampling defaults come from (`sampling_defaults`).
    """
    defaults = sampling_defaults(model, generation_config)
    if defaults:
        logger.warning(
            "sampling defaults from %s's generation_config.json for requests that leave them out: %s "
            "(--generation-config vllm for none)",
            model if generation_config == "auto" else generation_config,
            defaults,
        )
    if engine_process:
        core = CoreProcess(dict(model=model, **core_args))
        tokenizer = AutoTokenizer.from_pretrained(core.model_dir)
    else:
        engine_core, tokenizer = create_core(model, **core_args)
        core = CoreThread(engine_core)
    return AsyncEngine(core, tokenizer, served_model_name or Path(model).name, defaults)
