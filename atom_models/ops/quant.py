"""FP8 (e4m3) activation quantization, scaled matmul, and the norm/activation ops fused with it.

Activations are quantized dynamically per token: each row gets the scale amax / 448.
The fused ops' references are the unfused compositions, so a fusion pass changes the
kernels that run, never the function computed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_models.ops.activation import silu_and_mul_reference
from atom_models.ops.backend import implementation, register_impl
from atom_models.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# Floor on scales so an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _fp8_like(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("atom::quant_fp8_per_token", mutates_args=())
def quant_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (x_fp8, scale[..., 1]) with x ≈ x_fp8 * scale."""
    return implementation("quant_fp8_per_token", x.device)(x)


@quant_fp8_per_token.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return _fp8_like(x)


@torch.library.custom_op("atom::scaled_mm", mutates_args=())
def scaled_mm(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias; w_q is [out, in], w_scale [out, 1] or [1]."""
    return implementation("scaled_mm", x_q.device)(x_q, x_scale, w_q, w_scale, bias, out_dtype)


@scaled_mm.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    return x_q.new_empty((*x_q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


@torch.library.custom_op("atom::rms_norm_quant_fp8", mutates_args=())
def rms_norm_quant_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return implementation("rms_norm_quant_fp8", x.device)(x, weight, eps)


@rms_norm_quant_fp8.register_fake
def _(x, weight, eps):
    return _fp8_like(x)


@torch.library.custom_op("atom::fused_add_rms_norm_quant_fp8", mutates_args=())
def fused_add_rms_norm_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (normed_fp8, scale, x + residual)."""
    return implementation("fused_add_rms_norm_quant_fp8", x.device)(x, residual, weight, eps)


@fused_add_rms_norm_quant_fp8.register_fake
def _(x, residual, weight, eps):
    return (*_fp8_like(x), torch.empty_like(x))


@torch.library.custom_op("atom::silu_and_mul_quant_fp8", mutates_args=())
def silu_and_mul_quant_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    return implementation("silu_and_mul_quant_fp8", x.device)(x)


@silu_and_mul_quant_fp8.register_fake
def _(x):
    return _fp8_like(x.new_empty(*x.shape[:-1], x.shape[-1] // 2))


@register_impl("quant_fp8_per_token", "torch")
def quant_fp8_per_token_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@register_impl("scaled_mm", "torch")
def scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor:
    x = x_q.float() * x_scale
    w = w_q.float() * w_scale.reshape(-1, 1) if w_scale.numel() > 1 else w_q.float() * w_scale
    out = x @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@register_impl("rms_norm_quant_fp8", "torch")
def rms_norm_quant_fp8_reference(x, weight, eps):
    return quant_fp8_per_token_reference(rms_norm_reference(x, weight, eps))


@register_impl("fused_add_rms_norm_quant_fp8", "torch")
def fused_add_rms_norm_quant_fp8_reference(x, residual, weight, eps):
    normed, summed = fused_add_rms_norm_reference(x, residual, weight, eps)
    return (*quant_fp8_per_token_reference(normed), summed)


@register_impl("silu_and_mul_quant_fp8", "torch")
def silu_and_mul_quant_fp8_reference(x):
    return quant_fp8_per_token_reference(silu_and_mul_reference(x))


def quantize_weight_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float weight -> (fp8 weight, fp32 scale [out, 1]); one scale per output row."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
