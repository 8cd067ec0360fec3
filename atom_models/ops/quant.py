"""FP8 (e4m3) quantization: weights, activations, scaled matmuls, and the norm/activation ops fused with them.

Activations are quantized dynamically per token (each row gets the scale amax / 448), per token
and group of `group_size` columns (DeepSeek-V3's 1x128, paired with 128x128 weight blocks: each
group gets its own scale), or statically with one calibrated scale. Weights carry one scale per tensor, per output
channel, or per block (DeepSeek-V3's 128x128). In every scheme a value is `q * scale`.
The fused ops' references are the unfused compositions, so a fusion pass changes the
kernels that run, never the function computed (except the fp8_linear ops at one token; see there).
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


def num_scale_groups(n_cols: int, group_size: int) -> int:
    """Scales a row of `n_cols` gets: one (group_size 0: the whole row), or one a group of columns."""
    return -(-n_cols // group_size) if group_size else 1


def _fp8_like(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    groups = num_scale_groups(x.shape[-1], group_size)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


@torch.library.custom_op("atom::quant_fp8_per_token", mutates_args=())
def quant_fp8_per_token(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    """Returns (x_fp8, scale[..., groups]) with x ≈ x_fp8 * scale, a scale per row or per `group_size` columns."""
    return implementation("quant_fp8_per_token", x.device)(x, group_size)


@quant_fp8_per_token.register_fake
def _(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    return _fp8_like(x, group_size)


@torch.library.custom_op("atom::scaled_mm", mutates_args=())
def scaled_mm(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias; w_q is [out, in], w_scale [out, 1] or [1]."""
    return implementation("scaled_mm", x_q.device)(x_q, x_scale, w_q, w_scale, bias, out_dtype)


def _projection_like(x: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The fake output of x [..., K] through a weight [N, K]: [..., N] in out_dtype."""
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


@scaled_mm.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    return _projection_like(x_q, w_q, out_dtype)


@torch.library.custom_op("atom::scaled_mm_blockwise", mutates_args=())
def scaled_mm_blockwise(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    block_n: int,
    block_k: int,
) -> Tensor:
    """(x_q * x_scale) @ dequant(w_q)^T + bias with w_scale [cdiv(out, block_n), cdiv(in, block_k)].

    x_scale is per token ([..., 1]) or per token and block_k columns ([..., cdiv(in, block_k)]).
    """
    return implementation("scaled_mm_blockwise", x_q.device)(
        x_q, x_scale, w_q, w_scale, bias, out_dtype, block_n, block_k
    )


@scaled_mm_blockwise.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype, block_n, block_k):
    return _projection_like(x_q, w_q, out_dtype)


@torch.library.custom_op("atom::rms_norm_quant_fp8", mutates_args=())
def rms_norm_quant_fp8(x: Tensor, weight: Tensor, eps: float, group_size: int = 0) -> tuple[Tensor, Tensor]:
    return implementation("rms_norm_quant_fp8", x.device)(x, weight, eps, group_size)


@rms_norm_quant_fp8.register_fake
def _(x, weight, eps, group_size=0):
    return _fp8_like(x, group_size)


@torch.library.custom_op("atom::fused_add_rms_norm_quant_fp8", mutates_args=())
def fused_add_rms_norm_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_size: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (normed_fp8, scale, x + residual)."""
    return implementation("fused_add_rms_norm_quant_fp8", x.device)(x, residual, weight, eps, group_size)


@fused_add_rms_norm_quant_fp8.register_fake
def _(x, residual, weight, eps, group_size=0):
    return (*_fp8_like(x, group_size), torch.empty_like(x))


@torch.library.custom_op("atom::silu_and_mul_quant_fp8", mutates_args=())
def silu_and_mul_quant_fp8(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    return implementation("silu_and_mul_quant_fp8", x.device)(x, group_size)


@silu_and_mul_quant_fp8.register_fake
def _(x, group_size=0):
    return _fp8_like(x.new_empty(*x.shape[:-1], x.shape[-1] // 2), group_size)


@register_impl("quant_fp8_per_token", "torch")
def quant_fp8_per_token_reference(x: Tensor, group_size: int = 0) -> tuple[Tensor, Tensor]:
    xf = x.float()
    cols = x.shape[-1]
    groups = num_scale_groups(cols, group_size)
    if groups == 1:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    else:  # zero-pad the last group; padding never raises an amax
        padded = torch.nn.functional.pad(xf.abs(), (0, groups * group_size - cols))
        amax = padded.unflatten(-1, (groups, group_size)).amax(dim=-1)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / expand_group_scale(scale, group_size, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def expand_group_scale(scale: Tensor, group_size: int, cols: int) -> Tensor:
    """Activation scales [..., groups] as one a column ([..., cols]); a single scale a row broadcasts as it is."""
    if scale.shape[-1] == 1:
        return scale
    return scale.repeat_interleave(group_size, dim=-1)[..., :cols]


@register_impl("scaled_mm", "torch")
def scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor:
    return _dequantized_matmul(x_q.float() * x_scale, dequantize_weight(w_q, w_scale), bias, out_dtype)


@register_impl("scaled_mm_blockwise", "torch")
def scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype, block_n, block_k) -> Tensor:
    w = dequantize_weight(w_q, w_scale, (block_n, block_k))
    x = x_q.float() * expand_group_scale(x_scale, block_k, x_q.shape[-1])
    return _dequantized_matmul(x, w, bias, out_dtype)


def _dequantized_matmul(x: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    out = x @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@register_impl("rms_norm_quant_fp8", "torch")
def rms_norm_quant_fp8_reference(x, weight, eps, group_size=0):
    return quant_fp8_per_token_reference(rms_norm_reference(x, weight, eps), group_size)


@register_impl("fused_add_rms_norm_quant_fp8", "torch")
def fused_add_rms_norm_quant_fp8_reference(x, residual, weight, eps, group_size=0):
    normed, summed = fused_add_rms_norm_reference(x, residual, weight, eps)
    return (*quant_fp8_per_token_reference(normed, group_size), summed)


@register_impl("silu_and_mul_quant_fp8", "torch")
def silu_and_mul_quant_fp8_reference(x, group_size=0):
    return quant_fp8_per_token_reference(silu_and_mul_reference(x), group_size)


# FP8 linears with dynamic per-token activations: a quantizer (alone, or fused with the norm or SiLU·mul in front)
# and the `scaled_mm` that is its one user, as one op (the fp8_linear pass). For several tokens that is the
# quantizer and then `scaled_mm` on the FP8 tensor cores. For one token (a batch-1 decode step) it is weight-only:
# x stays unquantized. Its GEMV runs on CUDA cores, where an FP8 x saves nothing, and quantizing x first costs a
# kernel a projection, or passes over the row in every program of the GEMV (that took Llama-3-8B's FP8 batch-1
# step from 4.05 to 4.77 ms on an H100). The one exception to "a fusion never changes the function computed":
# one token loses the activation's rounding, which brings it closer to the unquantized model, so a request decoded
# alone and the same request in a batch differ by that rounding (`--passes=-fp8_linear` keeps it everywhere).


def one_token(x: Tensor) -> bool:
    """Whether x [..., K] is a single token's row (the weight-only case of the fp8_linear ops)."""
    return x.numel() == x.shape[-1] > 0


@torch.library.custom_op("atom::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """scaled_mm(*quant_fp8_per_token(x), w_q, w_scale, bias, out_dtype); one token: x @ dequantized w^T + bias."""
    return implementation("fp8_linear", x.device)(x, w_q, w_scale, bias, out_dtype)


@fp8_linear.register_fake
def _(x, w_q, w_scale, bias, out_dtype):
    return _projection_like(x, w_q, out_dtype)


@register_impl("fp8_linear", "torch")
def fp8_linear_reference(x, w_q, w_scale, bias, out_dtype) -> Tensor:
    if one_token(x):
        return _dequantized_matmul(x.float(), dequantize_weight(w_q, w_scale), bias, out_dtype)
    return scaled_mm_reference(*quant_fp8_per_token_reference(x), w_q, w_scale, bias, out_dtype)


@torch.library.custom_op("atom::rms_norm_fp8_linear", mutates_args=())
def rms_norm_fp8_linear(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """fp8_linear(rms_norm(x, norm_weight, eps), w_q, w_scale, bias, out_dtype)."""
    return implementation("rms_norm_fp8_linear", x.device)(x, norm_weight, eps, w_q, w_scale, bias, out_dtype)


@rms_norm_fp8_linear.register_fake
def _(x, norm_weight, eps, w_q, w_scale, bias, out_dtype):
    return _projection_like(x, w_q, out_dtype)


@register_impl("rms_norm_fp8_linear", "torch")
def rms_norm_fp8_linear_reference(x, norm_weight, eps, w_q, w_scale, bias, out_dtype) -> Tensor:
    return fp8_linear_reference(rms_norm_reference(x, norm_weight, eps), w_q, w_scale, bias, out_dtype)


@torch.library.custom_op("atom::fused_add_rms_norm_fp8_linear", mutates_args=())
def fused_add_rms_norm_fp8_linear(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """(fp8_linear(rms_norm(x + residual, norm_weight, eps), w_q, w_scale, bias, out_dtype), x + residual)."""
    return implementation("fused_add_rms_norm_fp8_linear", x.device)(
        x, residual, norm_weight, eps, w_q, w_scale, bias, out_dtype
    )


@fused_add_rms_norm_fp8_linear.register_fake
def _(x, residual, norm_weight, eps, w_q, w_scale, bias, out_dtype):
    return _projection_like(x, w_q, out_dtype), torch.empty_like(x)


@register_impl("fused_add_rms_norm_fp8_linear", "torch")
def fused_add_rms_norm_fp8_linear_reference(
    x, residual, norm_weight, eps, w_q, w_scale, bias, out_dtype
) -> tuple[Tensor, Tensor]:
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return fp8_linear_reference(normed, w_q, w_scale, bias, out_dtype), summed


@torch.library.custom_op("atom::silu_and_mul_fp8_linear", mutates_args=())
def silu_and_mul_fp8_linear(
    x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """fp8_linear(silu_and_mul(x), w_q, w_scale, bias, out_dtype), x = [gate | up]."""
    return implementation("silu_and_mul_fp8_linear", x.device)(x, w_q, w_scale, bias, out_dtype)


@silu_and_mul_fp8_linear.register_fake
def _(x, w_q, w_scale, bias, out_dtype):
    return _projection_like(x, w_q, out_dtype)


@register_impl("silu_and_mul_fp8_linear", "torch")
def silu_and_mul_fp8_linear_reference(x, w_q, w_scale, bias, out_dtype) -> Tensor:
    return fp8_linear_reference(silu_and_mul_reference(x), w_q, w_scale, bias, out_dtype)


def quantize_fp8_static(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale in e4m3 with a calibrated per-tensor scale; plain torch ops, so Inductor fuses it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_tensor(w: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float weight -> (fp8 weight, fp32 scale [1])."""
    wf = w.float()
    scale = (wf.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
    return quantize_fp8_static(wf, scale), scale


def quantize_weight_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float weight -> (fp8 weight, fp32 scale [out, 1]); one scale per output row."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8_static(wf, scale), scale


def quantize_weight_blockwise(w: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """[out, in] float weight -> (fp8 weight, fp32 scale [cdiv(out, bn), cdiv(in, bk)]); edge blocks may be partial."""
    bn, bk = block
    rows, cols = w.shape
    padded = w.float().new_zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
    padded[:rows, :cols] = w.float()
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [row blocks, bn, col blocks, bk]
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8_static(w.float(), expand_block_scale(scale, block, (rows, cols))), scale


def quantize_weight(w: Tensor, scheme: str, block: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """(fp8 weight, scale) of a float [out, in] weight: scheme per_tensor, per_channel, or block (with `block`)."""
    if scheme == "block":
        return quantize_weight_blockwise(w, block)
    if scheme == "per_channel":
        return quantize_weight_per_channel(w)
    if scheme == "per_tensor":
        return quantize_weight_per_tensor(w)
    raise ValueError(f"unknown weight quantization scheme {scheme!r}")


def expand_block_scale(scale: Tensor, block: tuple[int, int], shape: tuple[int, int]) -> Tensor:
    """A block scale [cdiv(out, bn), cdiv(in, bk)] repeated over every element of its block."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[: shape[0]].repeat_interleave(bk, dim=1)[:, : shape[1]]


def dequantize_weight(w_q: Tensor, scale: Tensor, block: tuple[int, int] | None = None) -> Tensor:
    """The fp32 weight an fp8 weight stands for: scale [1] or [out, 1], or a block scale with `block`."""
    if block is not None:
        return w_q.float() * expand_block_scale(scale, block, tuple(w_q.shape))
    return w_q.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
