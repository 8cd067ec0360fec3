"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

One `Linear` covers plain projections and packed ones: `output_sizes=[q, k, v]` stacks
several checkpoint tensors along the output dimension, each loaded by its shard id.
Loading goes through `weight_loader(param, tensor, shard_id)` on the parameter, as in
vLLM, so tensor-parallel sharding and quantized formats hook in at one place.

With a `LayerQuantConfig` the weight is e4m3 with fp32 `weight_scale`:

- per tensor: [1]; a packed layer keeps each shard's scale on its rows ([out, 1]), so shards
  quantized separately stay exact (the matmul is then row-wise scaled);
- per channel: [out, 1];
- per block (bn, bk): [cdiv(out, bn), cdiv(in, bk)]; packed shards must start on block rows. Dynamic
  activations then get a scale per token and bk columns (a power of two; else one a token).

Checkpoint FP8 weights and scales load as they are (the fp8 format's `weight_scale_inv` is the
same multiplier under another name, mapped by the loader); online quantization quantizes each
shard as it loads. Static activation schemes add `input_scale` [1]: the largest of the packed
shards' scales, since they all quantize the same input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from atom_models.ops.quant import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    quantize_fp8_static,
    quantize_weight,
)
from atom_models.quantization.config import LayerQuantConfig

# Static input scales of dummy weights cover activations up to this magnitude (normalised hidden states).
DUMMY_INPUT_RANGE = 16.0


def is_power_of_two(n: int) -> bool:
    """Block widths the grouped activation quantizers take; other widths keep one scale a token."""
    return n > 0 and not n & (n - 1)


def frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        output_sizes: int | Sequence[int],
        *,
        bias: bool = False,
        shard_ids: Sequence[str | int] | None = None,
        quant: LayerQuantConfig | None = None,
        prefix: str = "",
        packed_from: Sequence[str] = (),
    ):
        """`prefix`: the layer's name in the model, for error messages; `packed_from`: the checkpoint modules a packed
        layer holds (q_proj, k_proj, v_proj), as `QuantizationConfig.linear` takes them."""
        super().__init__()
        self.prefix = prefix
        self.packed_from = tuple(packed_from)
        self.in_features = in_features
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else None
        if self.shard_ids is not None and len(self.shard_ids) != len(self.output_sizes):
            raise ValueError("one shard id per output size")
        self.quant = quant
        self.weight = frozen(torch.empty(self.out_features, in_features, dtype=FP8_DTYPE if quant else None))
        self._loadable(self.weight)
        if quant is not None:
            self.weight_scale = frozen(torch.ones(self._scale_shape(), dtype=torch.float32))
            self.weight_scale.quant_scale = True
            if not quant.online:  # online scales are computed when the weight loads
                self._loadable(self.weight_scale)
            if quant.activations == "static_per_tensor":
                self.input_scale = frozen(torch.zeros(1, dtype=torch.float32))
                self.input_scale.quant_scale = True
                self._loadable(self.input_scale)
        self.bias = frozen(torch.empty(self.out_features)) if bias else None
        if bias:
            self._loadable(self.bias)

    def _scale_shape(self) -> tuple[int, ...]:
        spec, out, packed = self.quant, self.out_features, len(self.output_sizes) > 1
        if spec.weights == "block":
            bn, bk = spec.block_size
            if any(size % bn for size in self.output_sizes[:-1]):
                raise ValueError(
                    f"{self.prefix or 'a packed linear layer'}: output sizes {self.output_sizes} do not start on "
                    f"{bn}-row weight blocks; block-quantized shards must be whole blocks"
                )
            return -(-out // bn), -(-self.in_features // bk)
        if spec.weights == "per_channel" or packed:
            return out, 1
        return (1,)

    def _loadable(self, param: nn.Parameter) -> None:
        param.weight_loader = self.weight_loader
        param.shard_ids = self.shard_ids

    def _rows(self, shard_id: str | int | None) -> slice:
        if shard_id is None:
            if self.shard_ids is not None:
                raise ValueError(f"a packed parameter needs one of the shard ids {self.shard_ids}")
            return slice(0, self.out_features)
        index = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def weight_loader(self, param: nn.Parameter, loaded: Tensor, shard_id: str | int | None = None) -> None:
        rows = self._rows(shard_id)
        if param is self.weight:
            self._load_weight(rows, loaded)
        elif param is self.bias:
            self._check_shape(loaded, (rows.stop - rows.start,))
            param.data[rows].copy_(loaded)
        elif param is self.weight_scale:
            self._load_scale(rows, loaded)
        else:  # input_scale: one for the layer's input, whichever shard it came with
            if loaded.numel() != 1:
                raise ValueError(f"a per-tensor input scale has one element, got shape {tuple(loaded.shape)}")
            param.data.copy_(torch.maximum(param.data, loaded.reshape(1).to(param)))

    def _check_shape(self, loaded: Tensor, expected: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape {expected}")

    def _load_weight(self, rows: slice, loaded: Tensor) -> None:
        self._check_shape(loaded, (rows.stop - rows.start, self.in_features))
        is_fp8 = loaded.dtype == FP8_DTYPE
        if self.quant is None or self.quant.online:
            if is_fp8:
                raise ValueError(
                    "the checkpoint holds FP8 weights here but the layer is not set to load them; "
                    "config.json's quantization_config should name this format (or exclude the layer?)"
                )
            if self.quant is not None:
                loaded, scale = quantize_weight(
                    loaded.to(self.weight.device), self.quant.weights, self.quant.block_size
                )
                self._store_scale(rows, scale)
        elif not is_fp8:
            raise ValueError(
                f"expected float8_e4m3fn weights (the quantization config says this layer is quantized), "
                f"got {loaded.dtype}"
            )
        self.weight.data[rows].copy_(loaded)

    def _load_scale(self, rows: slice, loaded: Tensor) -> None:
        spec, n = self.quant, rows.stop - rows.start
        if spec.weights == "block":
            bn, bk = spec.block_size
            expected = (-(-n // bn), -(-self.in_features // bk))
            if tuple(loaded.shape) != expected:
                raise ValueError(
                    f"scale shape {tuple(loaded.shape)} does not fit a [{n}, {self.in_features}] weight in "
                    f"{bn}x{bk} blocks: expected {expected}"
                )
        elif spec.weights == "per_channel" and loaded.numel() != n:
            raise ValueError(
                f"per-channel scale shape {tuple(loaded.shape)} does not fit {n} output rows: expected ({n}, 1)"
            )
        elif spec.weights == "per_tensor" and loaded.numel() != 1:
            raise ValueError(f"per-tensor scale shape {tuple(loaded.shape)} has {loaded.numel()} elements, not 1")
        self._store_scale(rows, loaded)

    def _store_scale(self, rows: slice, scale: Tensor) -> None:
        """A shard's scale into `weight_scale`: its block rows, the layer's one scale, or its rows."""
        target = self.weight_scale.data
        if self.quant.weights == "block":
            start = rows.start // self.quant.block_size[0]
            target[start : start + scale.shape[0]].copy_(scale)
        elif target.shape[0] == 1:
            target.copy_(scale.reshape(1))
        else:  # per-channel scales, or a shard's per-tensor scale repeated on each of its rows
            target[rows].copy_(scale.reshape(-1, 1).expand(rows.stop - rows.start, 1))

    def fill_dummy(self, generator: torch.Generator, std: float) -> None:
        """Random weights (`--load-dummy`), each shard quantized as a checkpoint would hold it."""
        for shard_id in self.shard_ids or [None]:
            rows = self._rows(shard_id)
            shape = (rows.stop - rows.start, self.in_features)
            w = torch.randn(shape, generator=generator, device=self.weight.device) * std
            weight, scale = quantize_weight(w, self.quant.weights, self.quant.block_size)
            self.weight.data[rows].copy_(weight)
            self._store_scale(rows, scale)
        if self.quant.activations == "static_per_tensor":
            self.input_scale.data.fill_(DUMMY_INPUT_RANGE / FP8_MAX)

    def forward(self, x: Tensor) -> Tensor:
        spec = self.quant
        if spec is None:
            return torch.ops.atom.linear(x, self.weight, self.bias)
        if spec.activations == "none":  # weight-only: dequantize, multiply in the activation dtype
            weight = dequantize_weight(self.weight, self.weight_scale, spec.block_size).to(x.dtype)
            return torch.ops.atom.linear(x, weight, self.bias)
        if spec.activations == "static_per_tensor":
            x_q, x_scale = quantize_fp8_static(x, self.input_scale), self.input_scale
        elif spec.weights == "block" and is_power_of_two(spec.block_size[1]):
            # a scale per token and weight block of columns, as DeepSeek-V3 and vLLM quantize them
            x_q, x_scale = torch.ops.atom.quant_fp8_per_token(x, spec.block_size[1])
        else:
            x_q, x_scale = torch.ops.atom.quant_fp8_per_token(x)
        if spec.weights == "block":
            bn, bk = spec.block_size
            return torch.ops.atom.scaled_mm_blockwise(
                x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype, bn, bk
            )
        return torch.ops.atom.scaled_mm(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)

    def extra_repr(self) -> str:
        quant = self.quant.describe() if self.quant else None
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, quant={quant}"
