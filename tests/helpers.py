"""Shared by several test files: an atom model on one prompt outside the engine (numerical comparisons), and Python
snippets in a fresh interpreter (import-order checks)."""

from __future__ import annotations

import subprocess
import sys

import torch

from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of


def prefill_logits(model, input_ids: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged KV cache (scattered blocks)."""
    config = model.config
    n = input_ids.numel()
    num_blocks = -(-n // block_size)
    blocks = torch.randperm(num_blocks * 2)[:num_blocks]  # non-contiguous, out of order
    caches = [
        torch.zeros(2, num_blocks * 2, block_size, config.num_key_value_heads, head_dim_of(config))
        for _ in range(config.num_hidden_layers)
    ]
    positions = torch.arange(n)
    meta = AttentionMetadata.one_prompt(n, blocks, block_size)
    with torch.inference_mode():
        return model(input_ids, positions, caches, meta, positions)


def run_fresh_python(code: str) -> None:
    """Runs `code` in a new interpreter (nothing imported yet) and fails the test with its stderr if it fails."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
