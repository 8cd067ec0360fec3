"""Llama 2 / 3 / 3.1 (and models that share its shape), written against the atom ops library.

Read top to bottom: attention (fused QKV projection, RoPE, paged attention), MLP (fused
gate/up projection, SiLU·mul), the decoder layer (pre-norm with the residual add fused
into the next norm), the stack, and the causal-LM head. Weights arrive through each
parameter's `weight_loader`; `packed_modules_mapping` says which checkpoint tensors are
packed into which parameter. `quant` (a `QuantizationConfig`) is asked, by checkpoint module
name, how each linear layer is quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from atom_models.layers import (
    Attention,
    AttentionMetadata,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
)
from atom_models.quantization import LayerQuantConfig, QuantizationConfig

# The checkpoint modules our packed projections hold.
QKV_SOURCES = ("q_proj", "k_proj", "v_proj")
GATE_UP_SOURCES = ("gate_proj", "up_proj")


def linear_quant(
    quant: QuantizationConfig | None, prefix: str, packed_from: tuple[str, ...] = ()
) -> LayerQuantConfig | None:
    """The spec of the linear layer at `prefix` (None: unquantized)."""
    return quant.linear(prefix, packed_from) if quant is not None else None


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_of(config: PretrainedConfig) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return params["rope_theta"], params
    return getattr(config, "rope_theta", 10000.0), getattr(config, "rope_scaling", None)


def make_rotary(config: PretrainedConfig) -> RotaryEmbedding:
    theta, scaling = rope_of(config)
    return RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, quant: QuantizationConfig | None, prefix: str
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(
            config.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias=bias,
            shard_ids=["q", "k", "v"],
            quant=linear_quant(quant, f"{prefix}.qkv_proj", QKV_SOURCES),
            prefix=f"{prefix}.qkv_proj",
            packed_from=QKV_SOURCES,
        )
        self.o_proj = Linear(
            self.q_size,
            config.hidden_size,
            bias=bias,
            quant=linear_quant(quant, f"{prefix}.o_proj"),
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary_emb
        kv_cache_scales = quant is not None and quant.kv_cache_scales
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, kv_cache_scales)

    def split_heads(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        q, k, v = self.split_heads(hidden)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            [size, size],
            bias=bias,
            shard_ids=[0, 1],
            quant=linear_quant(quant, f"{prefix}.gate_up_proj", GATE_UP_SOURCES),
            prefix=f"{prefix}.gate_up_proj",
            packed_from=GATE_UP_SOURCES,
        )
        self.down_proj = Linear(
            size,
            config.hidden_size,
            bias=bias,
            quant=linear_quant(quant, f"{prefix}.down_proj"),
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(torch.ops.atom.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, quant: QuantizationConfig | None, prefix: str
    ):
        super().__init__()
        self.self_attn = self.attention_class(config, rotary_emb, quant, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config: PretrainedConfig, quant: QuantizationConfig | None, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = make_rotary(config)
        self.layers = nn.ModuleList(
            self.layer_class(config, rotary_emb, quant, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    # checkpoint module name -> (our packed parameter's module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, quant: QuantizationConfig | None = None):
        super().__init__()
        self.config = config
        self.quant_config = quant
        self.model = self.model_class(config, quant)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """One step over a flat batch of tokens; returns fp32 logits for `logits_indices`."""
        hidden = self.model(input_ids, positions, kv_caches, meta)
        return self.lm_head(hidden, logits_indices)
