"""A gated MLP's second half as one op: residual add + RMSNorm, the gate_up projection, SiLU·mul, the down projection.

What the `gated_mlp` pass makes of `fused_add_rms_norm[_fp8]_linear` followed by `silu_and_mul[_fp8]_linear`. For
one token (a batch-1 decode step) the fused linears computed SiLU(gate)·up in the down projection's prologue,
in every one of its programs (Llama-3-8B's down_proj: 512 programs, each the SiLU of all 14,336 columns); here
the gate_up GEMV's programs each hold matching gate and up rows and write the activation once. For more tokens it
runs what the two ops run. Either projection may be FP8 (a scale given: the fp8_linear ops' weight-only and
`scaled_mm` paths) or not; the reference is the two ops in a row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl
from atom_models.ops.linear import fused_add_rms_norm_linear_reference, silu_and_mul_linear_reference
from atom_models.ops.quant import fused_add_rms_norm_fp8_linear_reference, silu_and_mul_fp8_linear_reference


@torch.library.custom_op("atom::fused_add_rms_norm_mlp", mutates_args=())
def fused_add_rms_norm_mlp(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_up_weight: Tensor,
    gate_up_scale: Tensor | None,
    gate_up_bias: Tensor | None,
    down_weight: Tensor,
    down_scale: Tensor | None,
    down_bias: Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """(down(silu_and_mul(gate_up(rms_norm(x + residual, norm_weight, eps)))), x + residual); a projection with a
    scale is an fp8_linear of its FP8 weight into `out_dtype`, one without a plain linear (its input's dtype)."""
    return implementation("fused_add_rms_norm_mlp", x.device)(
        x,
        residual,
        norm_weight,
        eps,
        gate_up_weight,
        gate_up_scale,
        gate_up_bias,
        down_weight,
        down_scale,
        down_bias,
        out_dtype,
    )


@fused_add_rms_norm_mlp.register_fake
def _(
    x,
    residual,
    norm_weight,
    eps,
    gate_up_weight,
    gate_up_scale,
    gate_up_bias,
    down_weight,
    down_scale,
    down_bias,
    out_dtype,
):
    dtype = out_dtype if down_scale is not None else out_dtype if gate_up_scale is not None else x.dtype
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]), dtype=dtype), torch.empty_like(x)


@register_impl("fused_add_rms_norm_mlp", "torch")
def fused_add_rms_norm_mlp_reference(
    x,
    residual,
    norm_weight,
    eps,
    gate_up_weight,
    gate_up_scale,
    gate_up_bias,
    down_weight,
    down_scale,
    down_bias,
    out_dtype,
) -> tuple[Tensor, Tensor]:
    if gate_up_scale is None:
        gate_up, summed = fused_add_rms_norm_linear_reference(
            x, residual, norm_weight, eps, gate_up_weight, gate_up_bias
        )
    else:
        gate_up, summed = fused_add_rms_norm_fp8_linear_reference(
            x, residual, norm_weight, eps, gate_up_weight, gate_up_scale, gate_up_bias, out_dtype
        )
    if down_scale is None:
        return silu_and_mul_linear_reference(gate_up, down_weight, down_bias), summed
    return silu_and_mul_fp8_linear_reference(gate_up, down_weight, down_scale, down_bias, out_dtype), summed
