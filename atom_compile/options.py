"""`atom-compile export`'s settings, without torch: both CLIs build their flags from these before anything heavy
imports."""

from __future__ import annotations

from dataclasses import dataclass

# `atom_models.loader.DTYPES`' names (a test keeps them equal), for the CLIs' --dtype.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings, which --dtype takes too


def dtype_name(value: str) -> str:
    """--dtype's value under its one name (argparse's `type`, so that `choices` then checks the name)."""
    return DTYPE_ALIASES.get(value, value)


LEVELS = (0, 3)  # 0: pieces run as eager FX code; 3: pieces compiled by Inductor (ATOM's levels)
WEIGHT_MODES = ("reference", "copy", "dummy")
# Tokens a KV-cache block holds unless told (vLLM's and ATOM's default). Our attention kernels compile for one block
# size, so an artifact ships them for the block size it was exported with, and serves only that one on a GPU.
DEFAULT_BLOCK_SIZE = 16
# `--quantization-exclude`, as both CLIs take it
QUANTIZATION_EXCLUDE_FLAG = {
    "action": "append",
    "default": [],
    "metavar": "PATTERN",
    "help": "a layer --quantization leaves unquantized (repeatable): a checkpoint module's name, fnmatch glob "
    "('model.layers.0.*') or 're:' regex; a packed projection by all its parts or by name (qkv_proj)",
}


@dataclass
class ExportOptions:
    device: str = "auto"
    dtype: str = "auto"
    passes: str | list[str] | None = None  # names, or "+name,-name" edits of the default pipeline
    level: int = 3
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    quantization: str | None = None
    # layer-name patterns (fnmatch glob, "re:" regex, or a name or dotted suffix) `quantization` leaves unquantized
    quantization_exclude: tuple[str, ...] = ()
    # "reference": the checkpoint, verified by fingerprint; "copy": the (packed, possibly quantized) weights
    # written into the artifact; "dummy": random weights at load (benchmarks without a checkpoint)
    weights: str = "reference"
    load_dummy: bool = False
    backend: str | None = None  # ops backend; default: the best one for the device

    def __post_init__(self) -> None:
        self.quantization_exclude = tuple(self.quantization_exclude)  # a list from a CLI or a manifest

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.load_dummy and self.weights == "reference":
            self.weights = "dummy"
        if self.weights == "dummy":
            self.load_dummy = True
