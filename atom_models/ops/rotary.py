"""Rotary position embedding, neox style (rotate halves), with llama3 frequency scaling.

The cos/sin table is computed once per model in fp32 and indexed by position inside the
op, so the traced graph carries positions, never precomputed cos/sin per step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies as HF computes them, for rope types 'default' and 'llama3'."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: default, llama3")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(inv_freq: Tensor, max_positions: int) -> Tensor:
    """[max_positions, head_dim] fp32 table: cos of each frequency, then sin."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@torch.library.custom_op("atom::rotary_embedding", mutates_args=())
def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]; returns rotated copies."""
    return implementation("rotary_embedding", q.device)(positions, q, k, cos_sin_cache)


@rotary_embedding.register_fake
def _(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim // 2] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@register_impl("rotary_embedding", "torch")
def rotary_embedding_reference(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    # HF casts cos/sin to the activation dtype before rotating; so do we.
    cos, sin = cos_sin_cache[positions.long()].to(q.dtype).chunk(2, dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
