"""Per-token dynamic FP8 (e4m3) quantization of activations."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.backend import register_impl
from atom_models.ops.quant import FP8_DTYPE
from atom_models.ops.triton_kernels.common import as_rows, row_launch, store_fp8_row


def fp8_outputs(x: Tensor, n_cols: int) -> tuple[Tensor, Tensor]:
    """Uninitialised (x_fp8, scale[..., 1]) for a quantized version of x with n_cols columns."""
    shape = (*x.shape[:-1], n_cols)
    return (
        torch.empty(shape, dtype=FP8_DTYPE, device=x.device),
        torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device),
    )


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_fp8_row(x, mask, q_ptr + row * stride_q + cols, scale_ptr + row)


@register_impl("quant_fp8_per_token", "triton")
def quant_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    rows = as_rows(x)
    x_q, scale = fp8_outputs(x, x.shape[-1])
    block, warps = row_launch(rows.shape[1])
    if rows.shape[0]:
        _quant_fp8_kernel[(rows.shape[0],)](
            rows, x_q, scale, rows.stride(0), x_q.shape[-1], rows.shape[1], BLOCK=block, num_warps=warps
        )
    return x_q, scale
