"""Load an artifact for serving: check it fits this machine, load weights, bind the pieces.

Nothing here traces or compiles. The top-level graph and eager pieces are executed from
their saved source, compiled pieces are loaded from their saved packages (AOTInductor on CPU,
standalone-compiled on CUDA), and the Triton kernels they and our ops launch come from the artifact's cache.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import PretrainedConfig

from atom_compile import artifact
from atom_compile.graphs.codegen import load_graph_source
from atom_compile.graphs.compile import load_compiled_piece
from atom_compile.graphs.warmup import TRITON_CACHE, install_kernels
from atom_compile.trace import GraphInput, graph_arguments, model_weights
from atom_models import load_config
from atom_models.layers import AttentionMetadata
from atom_models.loader import DTYPES, build_model, fill_dummy_weights, load_weights
from atom_models.ops import set_backend

logger = logging.getLogger(__name__)


class _Pieces:
    """Stands in for `self` in the top-level graph's code: `self.submod_N(...)` calls piece N."""

    def __init__(self, pieces: dict):
        self.__dict__.update(pieces)


def load_pieces(path: Path, entries: dict[str, dict]) -> _Pieces:
    """Every piece of an artifact, bound by name: compiled ones from their files, eager ones from their code."""
    loaded: dict[str, object] = {}
    by_key: dict[str, object] = {}
    for name, entry in entries.items():
        if entry["key"] not in by_key:
            if entry["compiled"]:
                by_key[entry["key"]] = load_compiled_piece(
                    path / entry["compiled"], entry["format"], entry["returns_tuple"]
                )
            else:
                code = path / entry["code"]
                forward = load_graph_source(code.read_text(), str(code))
                by_key[entry["key"]] = lambda *args, _forward=forward: _forward(None, *args)
        loaded[name] = by_key[entry["key"]]
    return _Pieces(loaded)


def load_top_graph(path: Path):
    """The top-level graph's forward(pieces, *inputs)."""
    return load_graph_source((path / "graphs/model.py").read_text(), str(path / "graphs/model.py"))


@dataclass(frozen=True)
class PieceCall:
    """One call of a piece in the top-level graph: which values it takes and which earlier calls made them."""

    name: str
    args: tuple[str, ...]  # the top graph's names for the arguments (placeholders or earlier results)
    sources: frozenset[str]  # the pieces whose results (or items of them) it takes
    plain: bool  # every argument is a plain name (so `args` and `sources` are complete)


def piece_calls(path: Path) -> list[PieceCall]:
    """The pieces the top-level graph calls, in order, read from its source (`x = self.submod_N(...)`)."""
    made_by: dict[str, str] = {}  # value name -> the piece whose result it is (or an item of)
    calls = []
    for statement in ast.parse((path / "graphs/model.py").read_text()).body[0].body:
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
            continue
        target, value = statement.targets[0], statement.value
        func = value.func if isinstance(value, ast.Call) else None
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and isinstance(target, ast.Name)
        ):
            args = tuple(a.id for a in value.args if isinstance(a, ast.Name))
            plain = len(args) == len(value.args) and not value.keywords
            calls.append(PieceCall(func.attr, args, frozenset(made_by[a] for a in args if a in made_by), plain))
            made_by[target.id] = func.attr
        elif isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in made_by:
            made_by[target.id] = made_by[value.value.id]
    return calls


class CompiledModel:
    """An artifact bound to its weights, callable like the eager model's forward."""

    def __init__(self, path: Path, manifest: dict, device: torch.device):
        self.path = path
        self.manifest = manifest
        self.device = device
        self.config: PretrainedConfig = load_config(path)
        self.dtype = DTYPES[manifest["dtype"]]
        set_backend(manifest["ops_backend"])
        if (path / TRITON_CACHE).is_dir():
            install_kernels(path / TRITON_CACHE)
        self.weights = self._load_weights()
        self.forward_graph = load_top_graph(path)
        self.pieces = load_pieces(path, manifest["pieces"])
        self.calls = piece_calls(path)
        self.inputs = [GraphInput(**i) for i in manifest["inputs"]]

    def _load_weights(self) -> dict[str, Tensor]:
        quant = self.manifest["quantization"]
        model = build_model(self.config, self.dtype, self.device, quant)
        source = self.manifest["weights"]
        if source["mode"] == "dummy":
            fill_dummy_weights(model)
        elif source["mode"] == "copy":
            params = dict(model.named_parameters())
            with safe_open(str(self.path / source["file"]), framework="pt", device=str(self.device)) as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    params[name].data.copy_(f.get_tensor(name))
        else:  # load_artifact has verified the checkpoint's fingerprint already: read it once, not twice
            load_weights(model, source["model_dir"])
        return model_weights(model)

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        args = graph_arguments(self.inputs, self.weights, input_ids, positions, kv_caches, meta, logits_indices)
        return self.forward_graph(self.pieces, *args)[0]


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / artifact.MANIFEST).is_file()


def load_artifact(path: str | Path, *, rebuild: bool = False) -> CompiledModel:
    """Load `path`; with `rebuild`, re-export it from its recorded source first if it does not fit here."""
    path = Path(path).resolve()
    manifest = artifact.read_manifest(path)
    device = torch.device(manifest["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise artifact.ArtifactError(
            "artifact mismatch: device_type is 'cuda' in the artifact but this machine has no CUDA device; "
            "re-export it with --device cpu"
        )
    try:
        artifact.check_environment(manifest, device)
        artifact.check_files(path, manifest)
        if manifest["weights"]["mode"] == "reference":
            artifact.check_source_weights(manifest)
    except artifact.ArtifactError:
        if not rebuild:
            raise
        manifest = _rebuild(path, manifest)
    return CompiledModel(path, manifest, device)


def _rebuild(path: Path, manifest: dict) -> dict:
    from atom_compile.export import ExportOptions, export_model

    source = manifest["weights"].get("model_dir")
    if source is None:
        raise artifact.ArtifactError(f"cannot rebuild {path}: no source model was recorded")
    if not Path(source).is_dir():
        raise artifact.ArtifactError(f"cannot rebuild {path}: its source {source} no longer exists")
    logger.warning("re-exporting %s from %s", path, source)
    known = {f.name for f in fields(ExportOptions)}  # an older atom's manifest may name options since removed
    options = {k: v for k, v in manifest["export_options"].items() if k in known}
    return export_model(source, path, ExportOptions(**options))
