"""The artifact directory: manifest, checksums, and the checks that decide whether it runs here.

    ARTIFACT/
      manifest.json        what was built, from what, for which machine; checksums of every file
      graphs/model.py      the top-level graph: calls the pieces in order
      graphs/piece_*.py    readable FX code of every distinct piece
      compiled/piece_*     the compiled pieces (level 3): AOTInductor packages (.pt2) on CPU, Inductor's
                           standalone-compiled artifacts (.bin) on CUDA
      triton_cache/        (CUDA) every Triton kernel serving launches, ours and Inductor's, compiled at export
      weights/             the weights (with --weights copy); otherwise the manifest references the
                           source checkpoint by path and content fingerprint
      config.json, tokenizer files, chat template

Every path in the manifest is relative, so the directory can move.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
import xxhash

import atom_models

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class ArtifactError(ValueError):
    """The artifact cannot be used: missing, corrupted, or built for another machine (bad input to both CLIs)."""


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def device_capability(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def environment(device: torch.device) -> dict[str, str | int | None]:
    """The fields an artifact must share with the machine that loads it."""
    return {
        "format_version": FORMAT_VERSION,
        "torch_version": torch.__version__,
        "triton_version": triton_version() if device.type == "cuda" else None,
        "device_type": device.type,
        "device_capability": device_capability(device),
    }


def read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(
            f"{path} does not exist" if not path.exists() else f"{path} is not an atom artifact: it has no {MANIFEST}"
        )
    try:
        return json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise ArtifactError(f"{manifest_path} is corrupted: {error}") from None


def write_manifest(path: Path, manifest: dict) -> None:
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def checksums(path: Path, files: list[str]) -> dict[str, str]:
    return {name: file_digest(path / name) for name in sorted(files)}


def check_environment(manifest: dict, device: torch.device) -> None:
    """Raise naming the first field where the artifact and this machine differ."""
    here = environment(device)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"artifact mismatch: format_version is {manifest.get('format_version')} in the artifact "
            f"but this atom reads {FORMAT_VERSION}; re-export it (or load with rebuild=True / --rebuild)"
        )
    for field, value in here.items():
        if manifest.get(field) != value:
            raise ArtifactError(
                f"artifact mismatch: {field} is {manifest.get(field)!r} in the artifact but {value!r} here; "
                "re-export it (or load with rebuild=True / --rebuild)"
            )


def check_files(path: Path, manifest: dict) -> None:
    """Every file the manifest lists is present and has its recorded checksum."""
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise ArtifactError(f"artifact file {name} is missing from {path}")
        if file_digest(file) != digest:
            raise ArtifactError(f"artifact file {name} is corrupted: its checksum differs from the manifest's")


def check_source_weights(manifest: dict) -> Path:
    """The referenced checkpoint directory, after checking its weights are the ones exported."""
    source = manifest["weights"]
    model_dir = Path(source["model_dir"])
    for name, digest in source["files"].items():
        file = model_dir / name
        if not file.is_file():
            raise ArtifactError(f"the artifact's weights are missing: {file} does not exist")
        if file_digest(file) != digest:
            raise ArtifactError(
                f"the weights changed since export: {file} differs from the fingerprint in the manifest; "
                "re-export (or load with rebuild=True / --rebuild)"
            )
    return model_dir


def atom_version() -> str:
    return atom_models.__version__
