"""A gated MLP's second half as one op: residual add + RMSNorm, the gate_up projection, SiLU·mul, the down projection.

What the `gated_mlp` pass makes of `fused_add_rms_norm[_fp8]_linear` followed by `silu_and_mul[_fp8]_linear`. For
one token (a batch-1 decode step) the fused linears computed SiLU(gate)·up in the down projection's prologue,
in every one of its programs (Llama-3-8B's down_proj: 512 programs, each the SiLU of all 14,336 columns); here
the gate_up GEMV's programs each hold matching gate and up rows and write the activation once. For more tokens it
runs what the two ops run. Either projection may be FP8 (a scale given: the fp8_linear ops' weight-only and
`scaled_mm` paths) or not; the reference is the two ops in a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
def _(x, residual, norm_weight, eps, w1, s1, b1, w2, s2, b2, out_dtype):
    dtype = out_dtype if s2 is not None or s1 is not None else x.dtype
    return x.new_empty((*x.shape[:-1], w2.shape[0]), dtype=dtype), torch.empty_like(x)


@dataclass(frozen=True)
class Projections:
    """The four fused projections the op stands for, as some backend runs them."""

    norm_linear: Callable  # fused_add_rms_norm_linear
    norm_fp8_linear: Callable  # fused_add_rms_norm_fp8_linear
    silu_linear: Callable  # silu_and_mul_linear
    silu_fp8_linear: Callable  # silu_and_mul_fp8_linear

    def __call__(self, x, residual, norm_weight, eps, w1, s1, b1, w2, s2, b2, out_dtype) -> tuple[Tensor, Tensor]:
        """The op as its gate_up projection then its down projection, each plain or FP8 as its scale says."""
        if s1 is None:
            gate_up, summed = self.norm_linear(x, residual, norm_weight, eps, w1, b1)
        else:
            gate_up, summed = self.norm_fp8_linear(x, residual, norm_weight, eps, w1, s1, b1, out_dtype)
        if s2 is None:
            return self.silu_linear(gate_up, w2, b2), summed
        return self.silu_fp8_linear(gate_up, w2, s2, b2, out_dtype), summed


fused_add_rms_norm_mlp_reference = register_impl("fused_add_rms_norm_mlp", "torch")(
    Projections(
        fused_add_rms_norm_linear_reference,
        fused_add_rms_norm_fp8_linear_reference,
        silu_and_mul_linear_reference,
        silu_and_mul_fp8_linear_reference,
    )
)
