"""RMSNorm, alone and with the residual add fused in front of it (over all rows, or the ones a step samples)."""

from __future__ import annotations

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl


@torch.library.custom_op("atom::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return implementation("rms_norm", x.device)(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("atom::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the sum is the next residual."""
    return implementation("fused_add_rms_norm", x.device)(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("atom::fused_add_rms_norm_rows", mutates_args=())
def fused_add_rms_norm_rows(x: Tensor, residual: Tensor, weight: Tensor, eps: float, rows: Tensor) -> Tensor:
    """rms_norm(x[rows] + residual[rows]): a model's final norm over the rows whose logits a step computes (the
    `final_norm_rows` pass), so the rows are gathered by the norm's kernel and not by a kernel of their own."""
    return implementation("fused_add_rms_norm_rows", x.device)(x, residual, weight, eps, rows)


@fused_add_rms_norm_rows.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, rows: Tensor) -> Tensor:
    return x.new_empty((rows.shape[0], x.shape[-1]))


@register_impl("rms_norm", "torch")
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Same order of roundings as HF's LlamaRMSNorm: normalise in fp32, cast, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@register_impl("fused_add_rms_norm", "torch")
def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@register_impl("fused_add_rms_norm_rows", "torch")
def fused_add_rms_norm_rows_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float, rows: Tensor) -> Tensor:
    return fused_add_rms_norm_reference(x.index_select(0, rows), residual.index_select(0, rows), weight, eps)[0]
