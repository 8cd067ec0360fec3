"""RMSNorm; given a residual it adds it first and returns the new residual too."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from atom_models.layers.linear import frozen


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = frozen(torch.empty(dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return torch.ops.atom.rms_norm(x, self.weight, self.eps)
        return torch.ops.atom.fused_add_rms_norm(x, residual, self.weight, self.eps)


def default_weight_loader(param: nn.Parameter, loaded: Tensor, shard_id: None = None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)
