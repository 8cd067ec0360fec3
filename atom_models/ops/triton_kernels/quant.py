"""Dynamic FP8 (e4m3) quantization of activations: a scale per token, or per token and group of columns."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.backend import register_impl
from atom_models.ops.quant import FP8_DTYPE, num_scale_groups
from atom_models.ops.triton_kernels.common import (
    as_rows,
    pdl_launch,
    row_launch,
    scale_group,
    store_fp8_row,
    wait_for_previous_kernel,
)


def fp8_outputs(x: Tensor, n_cols: int, group_size: int = 0) -> tuple[Tensor, Tensor]:
    """Uninitialised (x_fp8, scale[..., groups]) for a quantized version of x with n_cols columns."""
    shape = (*x.shape[:-1], n_cols)
    return (
        torch.empty(shape, dtype=FP8_DTYPE, device=x.device),
        torch.empty((*x.shape[:-1], num_scale_groups(n_cols, group_size)), dtype=torch.float32, device=x.device),
    )


@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_fp8_row(x, mask, n_cols, q_ptr + row * stride_q + cols, scale_ptr, row, BLOCK, GROUP)


@register_impl("quant_fp8_per_token", "triton")
def quant_fp8_per_token(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    rows = as_rows(x)
    x_q, scale = fp8_outputs(x, x.shape[-1], group_size)
    block, warps = row_launch(rows.shape[1])
    if rows.shape[0]:
        _quant_fp8_kernel[(rows.shape[0],)](
            rows,
            x_q,
            scale,
            rows.stride(0),
            x_q.shape[-1],
            rows.shape[1],
            BLOCK=block,
            GROUP=scale_group(block, group_size),
            num_warps=warps,
            **pdl_launch(x.device),
        )
    return x_q, scale
