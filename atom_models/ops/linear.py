"""The dense projection, `x @ weight^T + bias`, as an op of its own, and fused with the op in front of it.

A traced graph has one token count for every step, but the best kernel depends on it: a decode
step's few rows make the GEMM a weight read, which cuBLAS's tiles spread over too few
multiprocessors. As a custom op, the backend picks the kernel per call (see
`triton_kernels.gemm.linear`); the reference is `F.linear`.

The fused linears (what the `rms_norm_linear` and `silu_mul_linear` passes emit) put the RMSNorm,
with or without the residual add, or the SiLU·mul in front of a projection into the projection's
kernel for one token (a batch-1 decode step, latency-bound): one kernel, and one round trip of the
activations through memory, fewer. Their references are the two ops in a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from atom_models.ops.activation import silu_and_mul_reference
from atom_models.ops.backend import implementation, register_impl
from atom_models.ops.norm import fused_add_rms_norm_reference, rms_norm_reference


@torch.library.custom_op("atom::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return implementation("linear", x.device)(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_impl("linear", "torch")
def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


@torch.library.custom_op("atom::logits", mutates_args=())
def logits(x: Tensor, weight: Tensor) -> Tensor:
    """The LM head: `x @ weight^T` in x's dtype, as fp32 (what a step samples from), written by one kernel where the
    projection and the conversion were two."""
    return implementation("logits", x.device)(x, weight)


@logits.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@register_impl("logits", "torch")
def logits_reference(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight).float()


@torch.library.custom_op("atom::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    """linear(rms_norm(x, norm_weight, eps), weight, bias)."""
    return implementation("rms_norm_linear", x.device)(x, norm_weight, eps, weight, bias)


@rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_impl("rms_norm_linear", "torch")
def rms_norm_linear_reference(
    x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> Tensor:
    return F.linear(rms_norm_reference(x, norm_weight, eps), weight, bias)


@torch.library.custom_op("atom::fused_add_rms_norm_linear", mutates_args=())
def fused_add_rms_norm_linear(
    x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(linear(rms_norm(x + residual, norm_weight, eps), weight, bias), x + residual)."""
    return implementation("fused_add_rms_norm_linear", x.device)(x, residual, norm_weight, eps, weight, bias)


@fused_add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(x)


@register_impl("fused_add_rms_norm_linear", "torch")
def fused_add_rms_norm_linear_reference(
    x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


@torch.library.custom_op("atom::silu_and_mul_linear", mutates_args=())
def silu_and_mul_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """linear(silu_and_mul(x), weight, bias), x = [gate | up]."""
    return implementation("silu_and_mul_linear", x.device)(x, weight, bias)


@silu_and_mul_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_impl("silu_and_mul_linear", "torch")
def silu_and_mul_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(silu_and_mul_reference(x), weight, bias)
