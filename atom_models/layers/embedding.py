"""Token embedding and the LM head, which computes logits only for the rows asked for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from atom_models.layers.linear import frozen
from atom_models.layers.norm import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = frozen(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in fp32 for `logits_indices` only: the last token of each sequence in a step."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = frozen(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: Tensor, logits_indices: Tensor) -> Tensor:
        return torch.ops.atom.logits(hidden.index_select(0, logits_indices), self.weight)
