"""Which layers are quantized, and how: parsed from an HF `quantization_config`, or chosen for online FP8.

Two classes, after ATOM's: `LayerQuantConfig` is the frozen spec of one linear layer (weight
scale granularity, activation scheme, whether the checkpoint already holds FP8 weights);
`QuantizationConfig` holds the model-wide default, per-layer overrides and exclusions, and
answers `linear(prefix)`: "how is module X quantized?" (None: not at all).

Formats read from config.json's `quantization_config`:

- `quant_method: "fp8"` (transformers' FP8 / DeepSeek-V3 / Qwen3-FP8): e4m3 weights, with
  `weight_block_size: [bn, bk]` one `weight_scale_inv` per block, without it one `weight_scale`
  per tensor; `activation_scheme` dynamic (per token; with blocks per token and `bk` columns)
  or static (per tensor, `input_scale`);
  exclusions in `modules_to_not_convert` / `ignored_layers`.
- `quant_method: "compressed-tensors"` (llm-compressor): `config_groups` whose `targets` are
  "Linear" (the default) or module patterns (overrides); FP8 weights per tensor, per channel
  or per block; input activations dynamic per token, static per tensor, or none (weight-only);
  exclusions in `ignore`; `kv_cache_scheme` for calibrated per-tensor KV-cache scales.

Layer names are the checkpoint's (`model.layers.0.self_attn.q_proj`). A pattern is an exact
name, a dotted suffix (`lm_head`, `mlp.down_proj`), an fnmatch glob (`*.mlp.*`), or a regex
after `re:`. Exclusions win over overrides, overrides over the default; `lm_head` is always
excluded (the LM head stays in the model dtype). Dynamic activation scales follow the weights:
with block weights (bn, bk) one a token and bk columns, as DeepSeek-V3 and vLLM quantize them (each
K tile of the GEMM then has one activation and one weight scale); otherwise one a token, whatever
granularity a compressed-tensors checkpoint names for its activations.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from transformers import PretrainedConfig

WEIGHT_SCHEMES = ("per_tensor", "per_channel", "block")
ACTIVATION_SCHEMES = ("dynamic_per_token", "static_per_tensor", "none")
SUPPORTED_METHODS = ("fp8", "compressed-tensors")
EXCLUSION_KEYS = ("ignore", "modules_to_not_convert", "ignored_layers", "exclude")
ALWAYS_EXCLUDED = ("lm_head",)


class QuantConfigError(ValueError):
    """The quantization config cannot be used; the message names the offending key."""


@dataclass(frozen=True)
class LayerQuantConfig:
    """How one linear layer is quantized.

    weights: one fp32 scale per tensor, per output channel, or per `block_size` (rows, cols) block.
    activations: dynamic per token, static per tensor (a calibrated `input_scale`), or none
    (weight-only: the fp8 weight is dequantized for a matmul in the model dtype).
    online: the checkpoint holds unquantized weights, quantized as they load.
    """

    weights: str
    activations: str = "dynamic_per_token"
    block_size: tuple[int, int] | None = None
    online: bool = False

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_SCHEMES:
            raise QuantConfigError(f"weight scheme {self.weights!r} is not one of {', '.join(WEIGHT_SCHEMES)}")
        if self.activations not in ACTIVATION_SCHEMES:
            raise QuantConfigError(
                f"activation scheme {self.activations!r} is not one of {', '.join(ACTIVATION_SCHEMES)}"
            )
        if (self.weights == "block") != (self.block_size is not None):
            raise QuantConfigError("a block_size goes with block weight scales, and only with them")
        if self.block_size is not None:
            object.__setattr__(self, "block_size", tuple(self.block_size))
        if self.weights == "block" and self.activations == "static_per_tensor":
            raise QuantConfigError("static activation scales with block-quantized weights are not supported")

    def describe(self) -> str:
        weights = f"block {self.block_size[0]}x{self.block_size[1]}" if self.block_size else self.weights
        source = "online" if self.online else "checkpoint"
        return f"fp8 weights {weights} ({source}), activations {self.activations}"


@dataclass
class QuantizationConfig:
    """The model-wide default, per-layer overrides (first matching pattern wins) and exclusions."""

    method: str
    default: LayerQuantConfig | None
    overrides: list[tuple[str, LayerQuantConfig | None]] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    kv_cache_scales: bool = False  # the checkpoint holds calibrated k_scale / v_scale per layer

    def __post_init__(self) -> None:
        self.exclude = list(dict.fromkeys([*self.exclude, *ALWAYS_EXCLUDED]))

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def online_fp8(
        cls,
        weights: str = "per_channel",
        activations: str = "dynamic_per_token",
        block_size: tuple[int, int] | None = None,
        exclude: Sequence[str] = (),
    ) -> QuantizationConfig:
        """`--quantization fp8` (per-channel weights, per-token activations): an unquantized checkpoint
        quantized as it loads, but for the layers `exclude` names; the other schemes serve accuracy studies."""
        for pattern in exclude:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as error:
                    message = f"--quantization-exclude {pattern!r} is not a regular expression: {error}"
                    raise QuantConfigError(message) from None
        return cls("fp8-online", LayerQuantConfig(weights, activations, block_size, online=True), exclude=list(exclude))

    @classmethod
    def from_hf(cls, hf_quant_config: dict) -> QuantizationConfig:
        """Parse config.json's `quantization_config`."""
        if not isinstance(hf_quant_config, dict):
            raise QuantConfigError(f"quantization_config must be a mapping, got {type(hf_quant_config).__name__}")
        method = hf_quant_config.get("quant_method")
        if method == "fp8":
            return _parse_fp8(hf_quant_config)
        if method == "compressed-tensors":
            return _parse_compressed_tensors(hf_quant_config)
        raise QuantConfigError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)}"
        )

    @classmethod
    def from_dict(cls, data: dict) -> QuantizationConfig:
        """Inverse of `to_dict` (an artifact's manifest)."""
        layer = lambda d: None if d is None else LayerQuantConfig(**d)
        return cls(
            data["method"],
            layer(data["default"]),
            [(pattern, layer(spec)) for pattern, spec in data["overrides"]],
            list(data["exclude"]),
            data["kv_cache_scales"],
        )

    @classmethod
    def resolve(
        cls, hf_config: PretrainedConfig, quant: QuantizationConfig | dict | str | None, exclude: Sequence[str] = ()
    ) -> QuantizationConfig | None:
        """The config a model is built with.

        A checkpoint's own `quantization_config` is always honoured (asking for "fp8" on an
        FP8 checkpoint changes nothing); "fp8" on an unquantized one quantizes it online, but for the layers
        `exclude` names (patterns, as a checkpoint's `ignore` list: `--quantization-exclude`); a dict
        is a manifest's record; None leaves an unquantized checkpoint unquantized.
        """
        if exclude and isinstance(quant, QuantizationConfig | dict):
            raise QuantConfigError("exclusions go with a quantization name ('fp8'), not with a built config")
        if isinstance(quant, QuantizationConfig):
            return quant
        if isinstance(quant, dict):
            return cls.from_dict(quant)
        if quant not in (None, "fp8"):
            raise QuantConfigError(f"unknown quantization {quant!r}; supported: fp8")
        hf_quant = getattr(hf_config, "quantization_config", None)
        if exclude and (quant is None or hf_quant is not None):
            raise QuantConfigError(
                "--quantization-exclude needs --quantization fp8"
                if hf_quant is None
                else "--quantization-exclude applies to quantizing an unquantized checkpoint; this one is quantized "
                "(its quantization_config's ignore list says what stays unquantized)"
            )
        if hf_quant is not None:
            return cls.from_hf(hf_quant)
        return cls.online_fp8(exclude=exclude) if quant == "fp8" else None

    # ---- queries --------------------------------------------------------------------------

    def layer(self, name: str) -> LayerQuantConfig | None:
        """The spec of the checkpoint module `name`: exclusions first, then overrides, then the default."""
        if any(matches(pattern, name) for pattern in self.exclude):
            return None
        for pattern, spec in self.overrides:
            if matches(pattern, name):
                return spec
        return self.default

    def linear(self, prefix: str, packed_from: Sequence[str] = ()) -> LayerQuantConfig | None:
        """The spec of our linear layer `prefix`; a packed one (qkv_proj) asks for each checkpoint module it packs,
        unless an exclusion names it whole."""
        if packed_from and any(matches(pattern, prefix) for pattern in self.exclude):
            return None
        names = checkpoint_names(prefix, packed_from)
        specs = {name: self.layer(name) for name in names}
        if len(set(specs.values())) > 1:
            found = "; ".join(f"{name}: {spec.describe() if spec else 'unquantized'}" for name, spec in specs.items())
            raise QuantConfigError(
                f"{prefix} packs modules that the quantization config treats differently ({found}): exclude all of "
                f"them, or {prefix.rpartition('.')[2]} itself"
            )
        return specs[names[0]]

    def to_dict(self) -> dict:
        """A JSON-able record (the manifest's `quantization`), readable by `from_dict`."""
        layer = lambda spec: None if spec is None else asdict(spec)
        return {
            "method": self.method,
            "default": layer(self.default),
            "overrides": [[pattern, layer(spec)] for pattern, spec in self.overrides],
            "exclude": self.exclude,
            "kv_cache_scales": self.kv_cache_scales,
        }


def checkpoint_names(prefix: str, packed_from: Sequence[str] = ()) -> list[str]:
    """The checkpoint modules our linear layer `prefix` holds: itself, or the ones it packs (q_proj, k_proj, v_proj)."""
    parent = prefix.rpartition(".")[0]
    return [f"{parent}.{source}" if parent else source for source in packed_from] or [prefix]


def matches(pattern: str, name: str) -> bool:
    """A layer-name pattern: `re:` regex (matched from the start), fnmatch glob, exact name or dotted suffix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def _exclusions(config: dict) -> list[str]:
    found = []
    for key in EXCLUSION_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise QuantConfigError(
                f"quantization_config.{key} must be a list of layer names or patterns, got {value!r}"
            )
        found.extend(value)
    return found


def _parse_fp8(config: dict) -> QuantizationConfig:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"quantization_config.fmt {fmt!r} is not supported; only e4m3")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantConfigError(f"quantization_config.activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
    activations = "dynamic_per_token" if scheme == "dynamic" else "static_per_tensor"
    block = config.get("weight_block_size")
    if block is None:
        spec = LayerQuantConfig("per_tensor", activations)
    else:
        block = _block_size(block, "quantization_config.weight_block_size")
        if scheme == "static":
            raise QuantConfigError(
                "quantization_config.activation_scheme 'static' with weight_block_size is not supported"
            )
        spec = LayerQuantConfig("block", activations, block)
    return QuantizationConfig("fp8", spec, exclude=_exclusions(config))


def _parse_compressed_tensors(config: dict) -> QuantizationConfig:
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise QuantConfigError(
            f"quantization_config.format {fmt!r} is not supported; FP8 checkpoints are float-quantized"
        )
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError("quantization_config.config_groups must be a non-empty mapping of scheme groups")
    default, overrides = None, []
    for name, group in groups.items():
        key = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantConfigError(f"{key} must be a mapping, got {group!r}")
        spec = _compressed_tensors_group(group, key)
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise QuantConfigError(f"{key}.targets must be a non-empty list of strings, got {targets!r}")
        for target in targets:
            if target == "Linear":
                default = spec
            else:
                overrides.append((target, spec))
    kv = config.get("kv_cache_scheme")
    if kv is not None:
        _check_fp8_args(kv, "quantization_config.kv_cache_scheme")
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic", False):
            raise QuantConfigError(
                "quantization_config.kv_cache_scheme must be static per tensor (strategy 'tensor', dynamic false); "
                f"got {kv!r}"
            )
    return QuantizationConfig("compressed-tensors", default, overrides, _exclusions(config), kv is not None)


def _block_size(value, key: str) -> tuple[int, int]:
    """[rows, cols] of a weight scale block; older compressed-tensors releases wrote "128x128"."""
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value.lower()):
        value = [int(b) for b in value.lower().split("x")]
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(b, int) and b > 0 for b in value)):
        raise QuantConfigError(f"{key} must be two positive integers, got {value!r}")
    return tuple(value)


def _check_fp8_args(args: dict, key: str) -> None:
    if not isinstance(args, dict):
        raise QuantConfigError(f"{key} must be a mapping, got {args!r}")
    if args.get("num_bits") != 8 or args.get("type", "float") != "float":
        raise QuantConfigError(
            f"{key}: only 8-bit float (FP8) is supported, got num_bits={args.get('num_bits')!r}, "
            f"type={args.get('type')!r}"
        )
    if not args.get("symmetric", True):
        raise QuantConfigError(f"{key}.symmetric: asymmetric FP8 (with zero points) is not supported")


def _compressed_tensors_group(group: dict, key: str) -> LayerQuantConfig:
    weights = group.get("weights")
    if weights is None:
        raise QuantConfigError(f"{key}.weights is missing: activation-only quantization is not supported")
    _check_fp8_args(weights, f"{key}.weights")
    if weights.get("dynamic", False):
        raise QuantConfigError(f"{key}.weights.dynamic: weights must have static scales")
    strategy = weights.get("strategy")
    block = None
    if strategy == "tensor":
        weight_scheme = "per_tensor"
    elif strategy == "channel":
        weight_scheme = "per_channel"
    elif strategy == "block":
        weight_scheme, block = "block", _block_size(weights.get("block_structure"), f"{key}.weights.block_structure")
    else:
        raise QuantConfigError(f"{key}.weights.strategy {strategy!r} is not supported; use tensor, channel or block")
    inputs = group.get("input_activations")
    if inputs is None:
        activations = "none"
    else:
        _check_fp8_args(inputs, f"{key}.input_activations")
        strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic", False)
        if dynamic and strategy in ("token", "tensor", "group"):
            activations = "dynamic_per_token"
        elif not dynamic and strategy == "tensor":
            activations = "static_per_tensor"
        else:
            raise QuantConfigError(
                f"{key}.input_activations: strategy {strategy!r} with dynamic={dynamic} is not supported; "
                "use dynamic token/tensor/group or static tensor"
            )
    try:
        return LayerQuantConfig(weight_scheme, activations, block)
    except QuantConfigError as error:
        raise QuantConfigError(f"{key}: {error}") from None
