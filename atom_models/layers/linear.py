"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

One `Linear` covers plain projections and packed ones: `output_sizes=[q, k, v]` stacks
several checkpoint tensors along the output dimension, each loaded by its shard id.
Loading goes through `weight_loader(param, tensor, shard_id)` on the parameter, as in
vLLM, so tensor-parallel sharding and quantized formats hook in at one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from atom_models.ops.quant import FP8_DTYPE, quantize_weight_per_channel

QUANT_METHODS = ("fp8",)


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
        quant: str | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else None
        if self.shard_ids is not None and len(self.shard_ids) != len(self.output_sizes):
            raise ValueError("one shard id per output size")
        if quant is not None and quant not in QUANT_METHODS:
            raise ValueError(f"unknown quantization {quant!r}; supported: {', '.join(QUANT_METHODS)}")
        self.quant = quant
        weight_dtype = FP8_DTYPE if quant == "fp8" else None
        self.weight = frozen(torch.empty(self.out_features, in_features, dtype=weight_dtype))
        self._loadable(self.weight)
        if quant == "fp8":
            # Filled when the weight loads (online per-channel quantization).
            self.weight_scale = frozen(torch.empty(self.out_features, 1, dtype=torch.float32))
        self.bias = frozen(torch.empty(self.out_features)) if bias else None
        if bias:
            self._loadable(self.bias)

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
        expected = (rows.stop - rows.start, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape {expected}")
        if param is self.weight and self.quant == "fp8" and loaded.dtype != FP8_DTYPE:
            weight, scale = quantize_weight_per_channel(loaded.to(param.device))
            self.weight_scale.data[rows].copy_(scale)
            loaded = weight
        param.data[rows].copy_(loaded)

    def forward(self, x: Tensor) -> Tensor:
        if self.quant == "fp8":
            x_q, x_scale = torch.ops.atom.quant_fp8_per_token(x)
            return torch.ops.atom.scaled_mm(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, quant={self.quant}"
