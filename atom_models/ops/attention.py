"""Paged attention and the KV-cache writes that feed it.

The KV cache of one layer is one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`
(keys, then values). A batch mixes prefill chunks and decode tokens: sequence `i` owns
query tokens `query_start_loc[i]:query_start_loc[i+1]`, which are the *last* tokens of its
`seq_lens[i]` context tokens, so a chunk attends causally to everything cached before it.
`slot_mapping[t]` is the flat cache slot (block * block_size + offset) of token `t`, or -1
for padding that must not be written.

`unified_attention` writes the new keys/values and then attends: it is what models call.
The rope/QK-norm fusion pass moves the write into `rope_and_cache` /
`qk_norm_rope_and_cache` and leaves `paged_attention`, which only reads the cache; for Llama the
`qkv_rope_cache` pass then folds the qkv projection in front into `qkv_rope_and_cache`.

FP8 KV cache (`--kv-cache-dtype fp8`): a float8_e4m3fn cache holds k / k_scale and v / v_scale,
saturated at ±448, and attention reads k * k_scale, v * v_scale. The scales are per tensor (one
k and one v scale per layer): the checkpoint's calibrated `k_scale`/`v_scale` when it has them
(compressed-tensors `kv_cache_scheme`), passed to every op as explicit inputs, else 1.0 (the
ops' default when none is passed), as vLLM does without calibration. A per-tensor scale adds no
bytes to decode's read of the whole cache and folds into the softmax scale (k) and the output (v);
e4m3's exponent covers most of the spread between tokens that per-token scales would absorb. Caches
of other dtypes ignore the scales.

FP8 with a scale per token and head (`--kv-cache-dtype fp8_per_token_head`): a uint8 cache
`[2, num_blocks, block_size + 1, kv_heads, head_dim]` whose first `block_size` slots of a block hold e4m3
entries and whose last slot holds the block's fp32 scales, head-major (`[kv_heads, block_size]` in the slot's
bytes), so a head's scales for a tile of keys are contiguous, and the cache stays one tensor a layer (no new graph
inputs). Each write computes its (token, head) scale from the entry's amax; the per-tensor scales are not used.
On the demo model (`bench_fp8_accuracy.py`, FP8 weights and activations) against scale 1.0: KL mean 0.0106 ->
0.0093, perplexity 39.53 -> 39.43 (bf16 39.29), top-1 agreement even (93.5%).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl
from atom_models.ops.linear import fused_add_rms_norm_linear_reference, rms_norm_linear_reference
from atom_models.ops.norm import rms_norm_reference
from atom_models.ops.quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fused_add_rms_norm_fp8_linear_reference,
    quantize_fp8_static,
    rms_norm_fp8_linear_reference,
)
from atom_models.ops.rotary import rotary_embedding_reference

# Ops that are the graph's split points: they read or write the KV cache, stay opaque
# to Inductor, and run between the compiled pieces.
KV_CACHE_OPS = (
    "atom::unified_attention",
    "atom::paged_attention",
    "atom::reshape_and_cache",
    "atom::rope_and_cache",
    "atom::qk_norm_rope_and_cache",
    "atom::qkv_rope_and_cache",
)


@torch.library.custom_op("atom::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    implementation("reshape_and_cache", k.device)(k, v, kv_cache, slot_mapping, k_scale, v_scale)


@reshape_and_cache.register_fake
def _(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.custom_op("atom::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    return implementation("paged_attention", q.device)(
        q, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
    )


@paged_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=None, v_scale=None):
    return torch.empty_like(q)


@torch.library.custom_op("atom::unified_attention", mutates_args=("kv_cache",))
def unified_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)


@unified_attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, k_scale=None, v_scale=None):
    return torch.empty_like(q)


@torch.library.custom_op("atom::rope_and_cache", mutates_args=("kv_cache",))
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
    """RoPE on q and k, then k and v into the cache; returns the rotated q."""
    return implementation("rope_and_cache", q.device)(
        positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale
    )


@rope_and_cache.register_fake
def _(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("atom::qk_norm_rope_and_cache", mutates_args=("kv_cache",))
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
    """Per-head RMSNorm of q and k (Qwen3), RoPE, then k and v into the cache; returns q."""
    return implementation("qk_norm_rope_and_cache", q.device)(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale
    )


@qk_norm_rope_and_cache.register_fake
def _(
    positions,
    q,
    k,
    v,
    q_norm_weight,
    k_norm_weight,
    eps,
    cos_sin_cache,
    kv_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
):
    return q.new_empty(q.shape)


@torch.library.custom_op("atom::qkv_rope_and_cache", mutates_args=("kv_cache",))
def qkv_rope_and_cache(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    weight_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype | None,
    positions: Tensor,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    num_q_heads: int,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A Llama attention's front as one op: RMSNorm (of x + residual, where given), the fused qkv projection (FP8
    where `weight_scale` is given: fp8_linear's, into `out_dtype`), RoPE on q and k, and k and v into the cache.
    Returns (the rotated q [tokens, num_q_heads, head_dim], x + residual, or an empty tensor without a residual).

    What the `qkv_rope_cache` pass makes of the fused projection op and `rope_and_cache`: for one token the Triton
    backend rotates and writes the cache in the projection GEMV's epilogue, so a decode step has no RoPE kernel.
    """
    return implementation("qkv_rope_and_cache", x.device)(
        x,
        residual,
        norm_weight,
        eps,
        weight,
        weight_scale,
        bias,
        out_dtype,
        positions,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        num_q_heads,
        k_scale,
        v_scale,
    )


@qkv_rope_and_cache.register_fake
def _(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    weight_scale,
    bias,
    out_dtype,
    positions,
    cos_sin_cache,
    kv_cache,
    slot_mapping,
    num_q_heads,
    k_scale=None,
    v_scale=None,
):
    dtype = out_dtype if weight_scale is not None else x.dtype
    q = x.new_empty((*x.shape[:-1], num_q_heads, kv_cache.shape[-1]), dtype=dtype)
    return q, x.new_empty(x.shape if residual is not None else (0,))


@dataclass(frozen=True)
class QKVRopeCache:
    """`qkv_rope_and_cache` as the fused projection op its arguments name, then `rope_and_cache`, in some backend."""

    norm_linear: Callable  # rms_norm_linear
    add_norm_linear: Callable  # fused_add_rms_norm_linear
    norm_fp8_linear: Callable  # rms_norm_fp8_linear
    add_norm_fp8_linear: Callable  # fused_add_rms_norm_fp8_linear
    rope_and_cache: Callable

    def __call__(self, *args) -> tuple[Tensor, Tensor]:
        x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype, *rope_args = args  # the op's, in order
        positions, cos_sin_cache, kv_cache, slot_mapping, num_q_heads, k_scale, v_scale = rope_args
        rest = (weight_scale, bias, out_dtype) if weight_scale is not None else (bias,)  # the projection's last
        summed = x.new_empty(0)
        if residual is None:
            project = self.norm_linear if weight_scale is None else self.norm_fp8_linear
            qkv = project(x, norm_weight, eps, weight, *rest)
        else:
            project = self.add_norm_linear if weight_scale is None else self.add_norm_fp8_linear
            qkv, summed = project(x, residual, norm_weight, eps, weight, *rest)
        head_dim = kv_cache.shape[-1]
        q_width, kv_width = num_q_heads * head_dim, (qkv.shape[-1] - num_q_heads * head_dim) // 2
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([q_width, kv_width, kv_width], -1))
        q = self.rope_and_cache(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale)
        return q, summed


# The dtype of an FP8 cache with inline (token, head) scales: its bytes are e4m3 entries and fp32 scales.
INLINE_SCALE_DTYPE = torch.uint8


def inline_scales(kv_cache: Tensor) -> bool:
    """Whether the cache is FP8 with its (token, head) scales inline (see the module docstring)."""
    return kv_cache.dtype == INLINE_SCALE_DTYPE


def inline_scale_cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of an FP8 cache with inline scales: one slot more a block, for its fp32 scales."""
    if 4 * block_size > head_dim:
        raise ValueError(f"inline KV scales need 4 * block_size <= head_dim, got block {block_size}, head {head_dim}")
    return (2, num_blocks, block_size + 1, kv_heads, head_dim)


def kv_cache_shape(dtype: torch.dtype, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple:
    """One layer's cache of `dtype`: [2, blocks, block_size, kv_heads, head_dim], a slot more a block for inline
    scales."""
    if dtype == INLINE_SCALE_DTYPE:
        return inline_scale_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    return (2, num_blocks, block_size, kv_heads, head_dim)


def cache_block_size(kv_cache: Tensor) -> int:
    return kv_cache.shape[2] - 1 if inline_scales(kv_cache) else kv_cache.shape[2]


def inline_cache_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 entries [2, blocks, block_size, kv_heads, head_dim], fp32 scales [2, blocks, kv_heads, block_size]),
    views that write through to the uint8 cache."""
    block_size, kv_heads = cache_block_size(kv_cache), kv_cache.shape[3]
    entries = kv_cache[:, :, :block_size].view(FP8_DTYPE)
    scales = kv_cache[:, :, block_size].view(torch.float32).flatten(2)[..., : kv_heads * block_size]
    return entries, scales.unflatten(2, (kv_heads, block_size))


def to_cache_dtype(x: Tensor, cache_dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """x as the cache stores it: x / scale saturated to e4m3 in an FP8 cache, else a plain cast."""
    if cache_dtype == FP8_DTYPE:
        return quantize_fp8_static(x, scale if scale is not None else 1.0)
    return x.to(cache_dtype)


def from_cache(x: Tensor, scale: Tensor | None) -> Tensor:
    """fp32 values of cache entries: FP8 ones times their scale."""
    if x.dtype == FP8_DTYPE and scale is not None:
        return x.float() * scale
    return x.float()


def cached_values(kv_cache: Tensor, kv: int, blocks: Tensor, seq_len: int, scale: Tensor | None) -> Tensor:
    """fp32 keys (kv 0) or values (1) of the first seq_len tokens in `blocks`: [seq_len, kv_heads, head_dim]."""
    if inline_scales(kv_cache):
        entries, scales = inline_cache_views(kv_cache)
        x = entries[kv, blocks].float() * scales[kv, blocks].transpose(1, 2)[..., None]
        return x.flatten(0, 1)[:seq_len]
    return from_cache(kv_cache[kv, blocks].flatten(0, 1)[:seq_len], scale)


@register_impl("reshape_and_cache", "torch")
def reshape_and_cache_reference(
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    slots = slot_mapping.long()
    valid = slots >= 0
    if inline_scales(kv_cache):
        entries, scales = inline_cache_views(kv_cache)
        blocks, offsets = slots[valid] // entries.shape[2], slots[valid] % entries.shape[2]
        for i, x in enumerate((k[valid], v[valid])):
            scale = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [tokens, kv_heads]
            entries[i, blocks, offsets] = quantize_fp8_static(x, scale[..., None])
            scales[i, blocks, :, offsets] = scale
        return
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0, slots[valid]] = to_cache_dtype(k[valid], kv_cache.dtype, k_scale)
    flat[1, slots[valid]] = to_cache_dtype(v[valid], kv_cache.dtype, v_scale)


@register_impl("paged_attention", "torch")
def paged_attention_reference(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    out = torch.zeros_like(q)
    block_size, num_kv_heads = cache_block_size(kv_cache), kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        if last == first:
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = cached_values(kv_cache, 0, blocks, seq_len, k_scale).repeat_interleave(group, dim=1)
        v = cached_values(kv_cache, 1, blocks, seq_len, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * scale
        query_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


@register_impl("rope_and_cache", "torch")
def rope_and_cache_reference(
    positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, k_scale=None, v_scale=None
) -> Tensor:
    q, k = rotary_embedding_reference(positions, q, k, cos_sin_cache)
    reshape_and_cache_reference(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q


qkv_rope_and_cache_reference = register_impl("qkv_rope_and_cache", "torch")(
    QKVRopeCache(
        rms_norm_linear_reference,
        fused_add_rms_norm_linear_reference,
        rms_norm_fp8_linear_reference,
        fused_add_rms_norm_fp8_linear_reference,
        rope_and_cache_reference,
    )
)


@register_impl("qk_norm_rope_and_cache", "torch")
def qk_norm_rope_and_cache_reference(
    positions,
    q,
    k,
    v,
    q_norm_weight,
    k_norm_weight,
    eps,
    cos_sin_cache,
    kv_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
) -> Tensor:
    q = rms_norm_reference(q, q_norm_weight, eps)
    k = rms_norm_reference(k, k_norm_weight, eps)
    return rope_and_cache_reference(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale)
