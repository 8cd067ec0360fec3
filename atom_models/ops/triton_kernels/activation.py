"""SiLU(gate) * up over [gate | up] rows, alone and with fp8 quantization fused behind.

Roundings follow the reference: SiLU is computed in fp32 and rounded to the activation
dtype, and the product is rounded again, as two torch ops would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.backend import register_impl
from atom_models.ops.triton_kernels.common import (
    as_rows,
    cdiv,
    next_power_of_2,
    pdl_launch,
    row_launch,
    scale_group,
    silu,
    store_fp8_row,
    wait_for_previous_kernel,
)
from atom_models.ops.triton_kernels.quant import fp8_outputs

# Columns per program of the plain kernel: enough bytes in flight, small enough to spread short rows.
_CHUNK = 1024


@triton.jit
def _silu_mul(x_row_ptr, cols, mask, n_cols):
    """SiLU(gate) * up in fp32, rounded like the reference (to x's dtype after each op)."""
    dtype = x_row_ptr.dtype.element_ty
    gate = tl.load(x_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = silu(gate).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.store(out_ptr + row * stride_out + cols, _silu_mul(x_ptr + row * stride_x, cols, mask, n_cols), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, n_cols).to(tl.float32)
    store_fp8_row(y, mask, n_cols, q_ptr + row * stride_q + cols, scale_ptr, row, BLOCK, GROUP)


@register_impl("silu_and_mul", "triton")
def silu_and_mul(x: Tensor) -> Tensor:
    rows = as_rows(x)
    n_cols = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    block = min(_CHUNK, next_power_of_2(n_cols))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], cdiv(n_cols, block))](
            rows, out, rows.stride(0), n_cols, n_cols, BLOCK=block, num_warps=4, **pdl_launch(x.device)
        )
    return out


@register_impl("silu_and_mul_quant_fp8", "triton")
def silu_and_mul_quant_fp8(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    rows = as_rows(x)
    n_cols = x.shape[-1] // 2
    x_q, scale = fp8_outputs(x, n_cols, group_size)
    block, warps = row_launch(n_cols)
    if rows.shape[0]:
        _silu_and_mul_quant_kernel[(rows.shape[0],)](
            rows,
            x_q,
            scale,
            rows.stride(0),
            n_cols,
            n_cols,
            BLOCK=block,
            GROUP=scale_group(block, group_size),
            num_warps=warps,
            **pdl_launch(x.device),
        )
    return x_q, scale
