"""Attention over the paged KV cache, its per-step metadata, and rotary embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from atom_models.ops.rotary import rope_cos_sin_cache, rope_inv_freq


@dataclass
class AttentionMetadata:
    """Where each token of a step lives in the paged KV cache (see `atom_models.ops.attention`)."""

    slot_mapping: Tensor  # [tokens] int64 flat cache slot, -1 for padding
    block_tables: Tensor  # [seqs, max_blocks_per_seq] int32
    seq_lens: Tensor  # [seqs] int32, context length including this step's tokens
    query_start_loc: Tensor  # [seqs + 1] int32, cumulative query lengths

    @classmethod
    def one_prompt(cls, num_tokens: int, blocks: Tensor, block_size: int) -> AttentionMetadata:
        """A step prefilling one whole prompt into `blocks` (its block ids, in order): the layout of tests, export
        checks and accuracy benchmarks that run a model outside the engine."""
        positions = torch.arange(num_tokens, device=blocks.device)
        return cls(
            slot_mapping=blocks[positions // block_size].long() * block_size + positions % block_size,
            block_tables=blocks[None].int(),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=blocks.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=blocks.device),
        )


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table; one instance is shared by all layers of a model."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(inv_freq, max_positions), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ops.atom.rotary_embedding(positions, q, k, self.cos_sin_cache)


class Attention(nn.Module):
    """Writes this step's k/v into the layer's cache, then attends over the whole context.

    With `kv_cache_scales` it holds the checkpoint's calibrated per-tensor `k_scale`/`v_scale`
    for an FP8 cache and passes them to the ops; without, an FP8 cache uses 1.0.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_cache_scales: bool = False):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.kv_cache_scales = kv_cache_scales
        if kv_cache_scales:
            self.k_scale, self.v_scale = kv_scale_parameter(), kv_scale_parameter()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        kv_scales = (self.k_scale, self.v_scale) if self.kv_cache_scales else ()
        return torch.ops.atom.unified_attention(
            q,
            k,
            v,
            kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            *kv_scales,
        )


def kv_scale_parameter() -> nn.Parameter:
    param = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
    param.weight_loader = load_scalar
    param.quant_scale = True
    return param


def load_scalar(param: nn.Parameter, loaded: Tensor, shard_id: None = None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor scale has one element, got shape {tuple(loaded.shape)}")
    param.data.copy_(loaded.reshape(1))
