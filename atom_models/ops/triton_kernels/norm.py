"""RMSNorm kernels: plain, with the residual add fused in front, and with fp8 quantization fused behind; the
residual add's form may gather the rows it normalises (a model's final norm over the rows a step samples).

One program normalises one row held entirely in registers, so each input is read once and
each output written once. The roundings follow the reference (HF's order): normalise in
fp32, round to the activation dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.backend import register_impl
from atom_models.ops.triton_kernels.common import (
    as_rows,
    pdl_launch,
    row_launch,
    scale_group,
    store_fp8_row,
    tl_dtype,
    wait_for_previous_kernel,
)
from atom_models.ops.triton_kernels.quant import fp8_outputs


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    scale_ptr,
    rows_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    n_cols,
    eps,
    NORM_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    GATHER: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """GATHER: output row r normalises input row rows[r] (with its residual), and the sum is not stored."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(rows_ptr + row).to(tl.int64) if GATHER else row
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + source * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + source * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(NORM_DTYPE)
        if not GATHER:
            tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((x * rstd).to(NORM_DTYPE).to(tl.float32) * w).to(OUT_DTYPE)
    if QUANT:
        store_fp8_row(y.to(tl.float32), mask, n_cols, out_ptr + row * stride_out + cols, scale_ptr, row, BLOCK, GROUP)
    else:
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def _rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    quant: bool,
    group_size: int = 0,
    gather: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Returns (normed or normed_fp8, scale if quant, x + residual if residual and not `gather`); with `gather`
    (row indices, the residual add only) the normed rows are x's and the residual's rows `gather`."""
    norm_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, norm_dtype)
    rows = as_rows(x)
    res_rows = as_rows(residual) if residual is not None else rows
    out_shape = x.shape if gather is None else (gather.shape[0], x.shape[-1])
    summed = (
        torch.empty(x.shape, dtype=norm_dtype, device=x.device) if residual is not None and gather is None else None
    )
    if quant:
        if gather is not None:
            raise ValueError("the norm gathers rows only unquantized")
        out, scale = fp8_outputs(x, x.shape[-1], group_size)
    else:
        out, scale = torch.empty(out_shape, dtype=out_dtype, device=x.device), None
    block, warps = row_launch(rows.shape[1])
    programs = rows.shape[0] if gather is None else gather.shape[0]
    if programs:
        _rms_norm_kernel[(programs,)](
            rows,
            res_rows,
            weight,
            out,
            summed if summed is not None else out,
            scale if scale is not None else out,
            gather if gather is not None else out,
            rows.stride(0),
            res_rows.stride(0),
            x.shape[-1],
            x.shape[-1],
            rows.shape[1],
            eps,
            NORM_DTYPE=tl_dtype(norm_dtype),
            OUT_DTYPE=tl_dtype(out_dtype),
            HAS_RESIDUAL=residual is not None,
            QUANT=quant,
            BLOCK=block,
            GROUP=scale_group(block, group_size),
            GATHER=gather is not None,
            num_warps=warps,
            **pdl_launch(x.device),
        )
    return out, scale, summed


@register_impl("rms_norm", "triton")
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _rms_norm(x, None, weight, eps, quant=False)[0]


@register_impl("fused_add_rms_norm", "triton")
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out, _, summed = _rms_norm(x, residual, weight, eps, quant=False)
    return out, summed


@register_impl("fused_add_rms_norm_rows", "triton")
def fused_add_rms_norm_rows(x: Tensor, residual: Tensor, weight: Tensor, eps: float, rows: Tensor) -> Tensor:
    return _rms_norm(x, residual, weight, eps, quant=False, gather=rows)[0]


@register_impl("rms_norm_quant_fp8", "triton")
def rms_norm_quant_fp8(x: Tensor, weight: Tensor, eps: float, group_size: int = 0) -> tuple[Tensor, Tensor]:
    out, scale, _ = _rms_norm(x, None, weight, eps, quant=True, group_size=group_size)
    return out, scale


@register_impl("fused_add_rms_norm_quant_fp8", "triton")
def fused_add_rms_norm_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_size: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    out, scale, summed = _rms_norm(x, residual, weight, eps, quant=True, group_size=group_size)
    return out, scale, summed
