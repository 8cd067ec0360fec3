"""The model `atom-run` uses when given none: the demo model shipped in `atom_models/demo/`.

It is exported (traced and compiled) once per machine and kept in a user cache directory,
`$ATOM_CACHE_DIR`, else `$XDG_CACHE_HOME/atom`, else `~/.cache/atom`. The cache entry's name is a
hash of everything the artifact must share with the machine (the manifest's environment fields),
of the export options and of the shipped weights, so a new torch, another GPU or a new demo model
gets its own entry instead of a mismatch error.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import atom_compile
import atom_models
from atom_compile import artifact
from atom_compile.options import DEFAULT_BLOCK_SIZE
from atom_models import resolve_device
from atom_models.ops import default_backend

DEMO_DIR = Path(atom_models.__file__).parent / "demo"
DEMO_NAME = "atom-demo"


def cache_root() -> Path:
    if os.environ.get("ATOM_CACHE_DIR"):
        return Path(os.environ["ATOM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atom"


def artifact_key(
    device: torch.device,
    dtype: str,
    quantization: str | None,
    quantization_exclude: Sequence[str] = (),
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict:
    """The fields that decide whether a cached artifact of the demo model can serve here."""
    return {
        **artifact.environment(device),
        "atom_version": artifact.atom_version(),
        "ops_backend": default_backend(device),
        "dtype": dtype,
        "quantization": quantization,
        **({"quantization_exclude": sorted(set(quantization_exclude))} if quantization_exclude else {}),
        **({"block_size": block_size} if block_size != DEFAULT_BLOCK_SIZE else {}),
        "model": {name: artifact.file_digest(DEMO_DIR / name) for name in ("config.json", "model.safetensors")},
    }


def default_artifact(
    device: str = "auto",
    dtype: str = "auto",
    quantization: str | None = None,
    quantization_exclude: Sequence[str] = (),
    block_size: int | None = None,
) -> Path:
    """The demo model's artifact for this machine (and KV-cache block size): from the cache, or exported into it
    first."""
    target = resolve_device(device)
    block_size = block_size or DEFAULT_BLOCK_SIZE
    key = artifact_key(target, dtype, quantization, quantization_exclude, block_size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / f"{DEMO_NAME}-{target.type}-{digest}"
    if atom_compile.is_artifact(path):
        return path
    print(f"[atom-run] exporting the demo model for {target} into {path} (once per machine)", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Weights copied in: the cached artifact stays valid wherever atom is installed later.
    atom_compile.export(
        DEMO_DIR,
        path,
        device=str(target),
        dtype=dtype,
        quantization=quantization,
        quantization_exclude=quantization_exclude,
        block_size=block_size,
        weights="copy",
    )
    return path
