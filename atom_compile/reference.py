"""Compare an artifact's outputs with the eager model on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from atom_compile.load import load_artifact
from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of
from atom_models.loader import build_model, load_weights


def prompt_step(config, num_tokens: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Inputs for one prefill of `num_tokens` random tokens, and a fresh KV cache for it."""
    generator = torch.Generator().manual_seed(seed)
    block_size = 16
    blocks = -(-num_tokens // block_size)
    caches = [
        torch.zeros(2, blocks, block_size, config.num_key_value_heads, head_dim_of(config), dtype=dtype, device=device)
        for _ in range(config.num_hidden_layers)
    ]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata.one_prompt(num_tokens, torch.arange(blocks, device=device), block_size)
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator).to(device)
    return ids, positions, caches, meta, positions.clone()


def compare(artifact_dir: str | Path, num_tokens: int = 19) -> dict[str, float | bool]:
    """Logits of the artifact and of the eager reference model at every position of a random prompt."""
    compiled = load_artifact(artifact_dir)
    manifest = compiled.manifest
    reference = build_model(compiled.config, compiled.dtype, compiled.device, manifest["quantization"])
    if manifest["weights"]["mode"] == "reference":
        load_weights(reference, manifest["weights"]["model_dir"], progress=False)
    else:
        params = dict(reference.named_parameters())
        for name, tensor in compiled.weights.items():
            if name in params:
                params[name].data.copy_(tensor)
    with torch.inference_mode():
        got = compiled(*prompt_step(compiled.config, num_tokens, compiled.device, compiled.dtype))
        expected = reference(*prompt_step(compiled.config, num_tokens, compiled.device, compiled.dtype))
    scale = expected.abs().max().item()
    return {
        "max_abs_diff": (got - expected).abs().max().item(),
        "max_rel_diff": (got - expected).abs().max().item() / scale,
        "argmax_equal": bool((got.argmax(-1) == expected.argmax(-1)).all()),
    }
