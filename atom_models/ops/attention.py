"""Paged attention and the KV-cache writes that feed it.

The KV cache of one layer is one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`
(keys, then values). A batch mixes prefill chunks and decode tokens: sequence `i` owns
query tokens `query_start_loc[i]:query_start_loc[i+1]`, which are the *last* tokens of its
`seq_lens[i]` context tokens, so a chunk attends causally to everything cached before it.
`slot_mapping[t]` is the flat cache slot (block * block_size + offset) of token `t`, or -1
for padding that must not be written.

`unified_attention` writes the new keys/values and then attends: it is what models call.
The rope/QK-norm fusion pass moves the write into `rope_and_cache` /
`qk_norm_rope_and_cache` and leaves `paged_attention`, which only reads the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl
from atom_models.ops.norm import rms_norm_reference
from atom_models.ops.rotary import rotary_embedding_reference

# Ops that are the graph's split points: they read or write the KV cache, stay opaque
# to Inductor, and run between the compiled pieces.
KV_CACHE_OPS = (
    "atom::unified_attention",
    "atom::paged_attention",
    "atom::reshape_and_cache",
    "atom::rope_and_cache",
    "atom::qk_norm_rope_and_cache",
)


@torch.library.custom_op("atom::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    implementation("reshape_and_cache", k.device)(k, v, kv_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    return None


@torch.library.custom_op("atom::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float
) -> Tensor:
    return implementation("paged_attention", q.device)(q, kv_cache, block_tables, seq_lens, query_start_loc, scale)


@paged_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, query_start_loc, scale):
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
) -> Tensor:
    reshape_and_cache(k, v, kv_cache, slot_mapping)
    return paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale)


@unified_attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return torch.empty_like(q)


@torch.library.custom_op("atom::rope_and_cache", mutates_args=("kv_cache",))
def rope_and_cache(
    positions: Tensor, q: Tensor, k: Tensor, v: Tensor, cos_sin_cache: Tensor, kv_cache: Tensor, slot_mapping: Tensor
) -> Tensor:
    """RoPE on q and k, then k and v into the cache; returns the rotated q."""
    return implementation("rope_and_cache", q.device)(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)


@rope_and_cache.register_fake
def _(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping):
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
) -> Tensor:
    """Per-head RMSNorm of q and k (Qwen3), RoPE, then k and v into the cache; returns q."""
    return implementation("qk_norm_rope_and_cache", q.device)(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping
    )


@qk_norm_rope_and_cache.register_fake
def _(positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping):
    return q.new_empty(q.shape)


@register_impl("reshape_and_cache", "torch")
def reshape_and_cache_reference(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    slots = slot_mapping.long()
    valid = slots >= 0
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0, slots[valid]] = k[valid].to(kv_cache.dtype)
    flat[1, slots[valid]] = v[valid].to(kv_cache.dtype)


@register_impl("paged_attention", "torch")
def paged_attention_reference(
    q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float
) -> Tensor:
    out = torch.zeros_like(q)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        if last == first:
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * scale
        query_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


@register_impl("rope_and_cache", "torch")
def rope_and_cache_reference(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping) -> Tensor:
    q, k = rotary_embedding_reference(positions, q, k, cos_sin_cache)
    reshape_and_cache_reference(k, v, kv_cache, slot_mapping)
    return q


@register_impl("qk_norm_rope_and_cache", "torch")
def qk_norm_rope_and_cache_reference(
    positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping
) -> Tensor:
    q = rms_norm_reference(q, q_norm_weight, eps)
    k = rms_norm_reference(k, k_norm_weight, eps)
    return rope_and_cache_reference(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)
