"""Qwen3 (dense): Llama's layout plus a per-head RMSNorm on q and k before RoPE.

Its `head_dim` is set in the config and need not equal hidden_size / num_heads.
"""

from __future__ import annotations

from torch import Tensor
from transformers import PretrainedConfig

from atom_models.layers import AttentionMetadata, RMSNorm, RotaryEmbedding
from atom_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from atom_models.quantization import QuantizationConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, quant: QuantizationConfig | None, prefix: str
    ):
        super().__init__(config, rotary_emb, quant, prefix)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        q, k, v = self.split_heads(hidden)
        q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.flatten(1))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
