"""nn.Module building blocks for models, each a thin owner of weights around `atom` ops."""

from atom_models.layers.attention import Attention, AttentionMetadata, RotaryEmbedding
from atom_models.layers.embedding import LMHead, VocabEmbedding
from atom_models.layers.linear import Linear
from atom_models.layers.norm import RMSNorm

__all__ = ["Attention", "AttentionMetadata", "LMHead", "Linear", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"]
