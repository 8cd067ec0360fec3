"""Rotary embedding and KV-cache writes, fused: a program handles the heads of one token (all of them, or for a
lone token a KV head and its query heads: `head_programs`).

One kernel serves four ops, chosen by constexpr flags: `rotary_embedding` (rotate q and k),
`reshape_and_cache` (k and v into the paged cache), `rope_and_cache` (rotate, then cache k
and v) and `qk_norm_rope_and_cache` (per-head RMSNorm first). Fused, q/k/v are read once
and the rotated k never round-trips through memory. Inputs may be strided views (slices of
a fused qkv projection); only the last dimension must be contiguous. An FP8 cache gets
k / k_scale and v / v_scale saturated to e4m3, or (inline scales) each head over its own amax / 448, the
scale stored in the block's scale slot (see `atom_models.ops.attention`).

Every head is handled as two halves [heads, head_dim / 2], as neox-style rotation pairs
element i with element i + head_dim / 2. Roundings follow the reference: cos/sin and each
product and sum are rounded to the activation dtype, as HF's torch ops round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.attention import cache_block_size, inline_scales
from atom_models.ops.backend import register_impl
from atom_models.ops.quant import FP8_DTYPE
from atom_models.ops.triton_kernels.common import (
    FP8_MAX_C,
    MIN_SCALE_C,
    cdiv,
    inline_scale_operands,
    launch_next_kernel,
    next_power_of_2,
    pdl_launch,
    tl_dtype,
    wait_for_previous_kernel,
)


@triton.jit
def _load_halves(row_ptr, heads, cols, mask, stride_h, HALF: tl.constexpr):
    ptrs = row_ptr + heads[:, None] * stride_h + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_halves(row_ptr, x1, x2, heads, cols, mask, stride_h, HALF: tl.constexpr):
    ptrs = row_ptr + heads[:, None] * stride_h + cols[None, :]
    dtype = row_ptr.dtype.element_ty
    tl.store(ptrs, x1.to(dtype), mask=mask)
    tl.store(ptrs + HALF, x2.to(dtype), mask=mask)


@triton.jit
def to_fp8_range(x1, x2, scale_ptr, HAS_SCALE: tl.constexpr):
    """Both halves divided by the cache's scale (when given) and saturated to e4m3's range.

    e4m3's largest value (FP8_MAX) is written out: the qkv GEMV's epilogue calls this too, and a helper that several
    kernels call must not read a global constexpr (see `common.silu`)."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
        x1 = x1 / scale
        x2 = x2 / scale
    return tl.clamp(x1, -448.0, 448.0), tl.clamp(x2, -448.0, 448.0)


@triton.jit
def _to_fp8_inline(x1, x2, scale_ptrs, mask):
    """Each head (row) over its own scale, amax / 448, which goes to `scale_ptrs` ([heads])."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
    scale = tl.maximum(amax / FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptrs, scale, mask=mask)
    x1 = x1 / scale[:, None]
    x2 = x2 / scale[:, None]
    return tl.clamp(x1, -FP8_MAX_C, FP8_MAX_C), tl.clamp(x2, -FP8_MAX_C, FP8_MAX_C)


@triton.jit
def _rms_norm_halves(
    x1, x2, w_ptr, cols, col_mask, eps, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, HALF: tl.constexpr
):
    """Per-head RMSNorm over both halves, rounded like `rms_norm_reference`."""
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y1 = ((x1 * rstd).to(IN_DTYPE).to(tl.float32) * w1).to(OUT_DTYPE).to(tl.float32)
    y2 = ((x2 * rstd).to(IN_DTYPE).to(tl.float32) * w2).to(OUT_DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def rotate_halves(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """Neox rotation, x * cos + cat(-x2, x1) * sin, rounding each op to DTYPE."""
    a1 = (x1 * cos).to(DTYPE).to(tl.float32)
    a2 = (x2 * cos).to(DTYPE).to(tl.float32)
    b1 = (-x2 * sin).to(DTYPE).to(tl.float32)
    b2 = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a1 + b1).to(DTYPE).to(tl.float32), (a2 + b2).to(DTYPE).to(tl.float32)


@triton.jit
def _rope_cache_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    q_w_ptr,
    k_w_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    K_OUT: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    LAUNCH_NEXT_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token a program (see the module docstring), the op chosen by the flags.

    LAUNCH_NEXT_FIRST: the next kernel (attention) may launch before this one waits for the one before, so
    its programs ask L2 for their keys while the qkv projection finishes. For a lone token, whose projection is one
    wave of programs: Qwen3-0.6B batch 1 0.854 -> 0.842 ms a step (H100, thirteenth session). Where the projection
    runs in waves, attention's waiting programs would take multiprocessors its later waves need (batch 8: 1.238 ->
    1.287 ms)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_P)
    col_mask = cols < HALF
    # The step's positions and slots and the cos/sin table: nothing the kernel before writes, so they are read
    # while it may still run (under PDL), and the position -> cos/sin round trip leaves the critical path.
    if ROPE:
        cos_ptr = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_cos + cols
        cos = tl.load(cos_ptr, mask=col_mask, other=0.0).to(ACT_DTYPE).to(tl.float32)[None, :]
        sin = tl.load(cos_ptr + HALF, mask=col_mask, other=0.0).to(ACT_DTYPE).to(tl.float32)[None, :]
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if LAUNCH_NEXT_FIRST:
        launch_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL, LAUNCH_NEXT=not LAUNCH_NEXT_FIRST)
    kv_heads = tl.program_id(1) * KV_BLOCK + tl.arange(0, KV_BLOCK)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & col_mask[None, :]
    k1, k2 = _load_halves(k_ptr + t * stride_kt, kv_heads, cols, kv_mask, stride_kh, HALF)
    if ROPE:
        q_heads = tl.program_id(1) * Q_BLOCK + tl.arange(0, Q_BLOCK)
        q_mask = (q_heads < NUM_Q_HEADS)[:, None] & col_mask[None, :]
        q1, q2 = _load_halves(q_ptr + t * stride_qt, q_heads, cols, q_mask, stride_qh, HALF)
        if QK_NORM:
            q1, q2 = _rms_norm_halves(q1, q2, q_w_ptr, cols, col_mask, eps, IN_DTYPE, ACT_DTYPE, HALF)
            k1, k2 = _rms_norm_halves(k1, k2, k_w_ptr, cols, col_mask, eps, IN_DTYPE, ACT_DTYPE, HALF)
        q1, q2 = rotate_halves(q1, q2, cos, sin, ACT_DTYPE)
        k1, k2 = rotate_halves(k1, k2, cos, sin, ACT_DTYPE)
        _store_halves(q_out_ptr + t * stride_qot, q1, q2, q_heads, cols, q_mask, stride_qoh, HALF)
    if K_OUT:
        _store_halves(k_out_ptr + t * stride_kot, k1, k2, kv_heads, cols, kv_mask, stride_koh, HALF)
    if WRITE_CACHE:  # noqa: SIM102 (a constexpr apart: `slot` exists only where it holds)
        if slot >= 0:
            offset = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
            v1, v2 = _load_halves(v_ptr + t * stride_vt, kv_heads, cols, kv_mask, stride_vh, HALF)
            if INLINE_SCALES:  # k/v_scale_ptr: the cache as fp32; the block's scales after its BLOCK_SIZE slots
                block_start = (slot // BLOCK_SIZE) * stride_cache_block + BLOCK_SIZE * stride_cache_slot
                scales = block_start // 4 + kv_heads * BLOCK_SIZE + slot % BLOCK_SIZE
                k1, k2 = _to_fp8_inline(k1, k2, k_scale_ptr + scales, kv_heads < NUM_KV_HEADS)
                v1, v2 = _to_fp8_inline(v1, v2, v_scale_ptr + scales, kv_heads < NUM_KV_HEADS)
            elif FP8_CACHE:
                k1, k2 = to_fp8_range(k1, k2, k_scale_ptr, HAS_SCALES)
                v1, v2 = to_fp8_range(v1, v2, v_scale_ptr, HAS_SCALES)
            _store_halves(k_cache_ptr + offset, k1, k2, kv_heads, cols, kv_mask, stride_cache_head, HALF)
            _store_halves(v_cache_ptr + offset, v1, v2, kv_heads, cols, kv_mask, stride_cache_head, HALF)


# Tokens up to which a token's heads are spread over several programs (one a KV head, its query heads with it).
# One: Qwen3-0.6B batch 1 0.807 / 0.808 -> 0.803 / 0.805 ms a step (graph 0.802 / 0.801 -> 0.799 / 0.797), Llama-3-8B
# FP8 even (graph 3.480 against 3.481); spreading a batch of 8 (64 programs) lost: 1.223 -> 1.281 ms, about what
# letting attention launch early lost there (`LAUNCH_NEXT_FIRST`) (H100, two rounds, sixteenth session).
SPREAD_HEADS_MAX_TOKENS = 1


def head_programs(num_tokens: int, num_kv_heads: int) -> int:
    """Programs a token: a lone decode token spreads its heads over several, so each program's chain of loads, norm,
    rotation and stores (on the step's critical path, between the qkv projection and attention) is short; more
    tokens take one program each."""
    return num_kv_heads if num_tokens <= SPREAD_HEADS_MAX_TOKENS else 1


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_cache(
    positions: Tensor | None,
    q: Tensor | None,
    k: Tensor,
    v: Tensor | None,
    cos_sin_cache: Tensor | None,
    norm_weights: tuple[Tensor, Tensor] | None,
    eps: float,
    kv_cache: Tensor | None,
    slot_mapping: Tensor | None,
    k_out: bool,
    kv_scales: tuple[Tensor | None, Tensor | None] = (None, None),
) -> tuple[Tensor | None, Tensor | None]:
    """Launch the fused kernel; q is rotated when given. Returns (rotated q, rotated k if k_out)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    k = _unit_last(k)
    rope = q is not None
    q = _unit_last(q) if rope else k
    v = _unit_last(v) if v is not None else k
    in_dtype = q.dtype
    act_dtype = torch.promote_types(in_dtype, norm_weights[0].dtype) if norm_weights is not None else in_dtype
    q_out = torch.empty(q.shape, dtype=act_dtype, device=q.device) if rope else None
    k_rot = torch.empty(k.shape, dtype=act_dtype, device=k.device) if k_out else None
    unused = k  # stands in for pointer arguments that the kernel's flags leave unread
    inline = kv_cache is not None and inline_scales(kv_cache)
    caches = (kv_cache[0], kv_cache[1]) if kv_cache is not None else (unused, unused)
    fp8_cache = kv_cache is not None and kv_cache.dtype == FP8_DTYPE
    has_scales = fp8_cache and kv_scales[0] is not None
    if inline:
        (k_cache, k_scale), (v_cache, v_scale) = (inline_scale_operands(c) for c in caches)
        caches = (k_cache, v_cache)
    else:
        k_scale, v_scale = kv_scales if has_scales else (unused, unused)
    q_w, k_w = norm_weights if norm_weights is not None else (unused, unused)
    heads_q = q.shape[1]
    programs = head_programs(num_tokens, num_kv_heads)
    if num_tokens:
        _rope_cache_kernel[(num_tokens, programs)](
            positions if rope else unused,
            q,
            k,
            v,
            cos_sin_cache if rope else unused,
            q_w,
            k_w,
            q_out if rope else unused,
            k_rot if k_out else unused,
            caches[0],
            caches[1],
            slot_mapping if kv_cache is not None else unused,
            k_scale,
            v_scale,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            q_out.stride(0) if rope else 0,
            q_out.stride(1) if rope else 0,
            k_rot.stride(0) if k_out else 0,
            k_rot.stride(1) if k_out else 0,
            cos_sin_cache.stride(0) if rope else 0,
            caches[0].stride(0),
            caches[0].stride(1),
            caches[0].stride(2),
            eps,
            NUM_Q_HEADS=heads_q,
            NUM_KV_HEADS=num_kv_heads,
            Q_BLOCK=next_power_of_2(cdiv(heads_q, programs)),
            KV_BLOCK=next_power_of_2(cdiv(num_kv_heads, programs)),
            HALF=head_dim // 2,
            HALF_P=next_power_of_2(head_dim // 2),
            BLOCK_SIZE=cache_block_size(kv_cache) if kv_cache is not None else 1,
            IN_DTYPE=tl_dtype(in_dtype),
            ACT_DTYPE=tl_dtype(act_dtype),
            ROPE=rope,
            QK_NORM=norm_weights is not None,
            K_OUT=k_out,
            WRITE_CACHE=kv_cache is not None,
            FP8_CACHE=fp8_cache,
            HAS_SCALES=has_scales,
            INLINE_SCALES=inline,
            LAUNCH_NEXT_FIRST=num_tokens == 1,
            num_warps=4,
            **pdl_launch(q.device),
        )
    return q_out, k_rot


@register_impl("rotary_embedding", "triton")
def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    return _rope_cache(positions, q, k, None, cos_sin_cache, None, 0.0, None, None, k_out=True)


@register_impl("reshape_and_cache", "triton")
def reshape_and_cache(
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    _rope_cache(None, None, k, v, None, None, 0.0, kv_cache, slot_mapping, False, (k_scale, v_scale))


@register_impl("rope_and_cache", "triton")
def rope_and_cache(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    q_out, _ = _rope_cache(
        positions, q, k, v, cos_sin_cache, None, 0.0, kv_cache, slot_mapping, False, (k_scale, v_scale)
    )
    return q_out


@register_impl("qk_norm_rope_and_cache", "triton")
def qk_norm_rope_and_cache(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    eps: float,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    norms = (q_norm_weight, k_norm_weight)
    q_out, _ = _rope_cache(
        positions, q, k, v, cos_sin_cache, norms, eps, kv_cache, slot_mapping, False, (k_scale, v_scale)
    )
    return q_out
