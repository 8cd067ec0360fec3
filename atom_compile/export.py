"""`atom-compile export`: HF model directory → artifact directory. All tracing and compiling happens here."""

from __future__ import annotations

import gc
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from atom_compile import artifact
from atom_compile.graphs.codegen import graph_source
from atom_compile.graphs.compile import FORMATS, SUFFIXES, compile_piece
from atom_compile.graphs.split import Piece, propagate_fake_values, split_at_attention
from atom_compile.graphs.warmup import TRITON_CACHE, warm_kernels
from atom_compile.load import load_pieces, load_top_graph
from atom_compile.options import ExportOptions
from atom_compile.passes import resolve_pipeline, run_passes
from atom_compile.trace import TracedModel, trace_model
from atom_models import load_config, resolve_device, resolve_dtype, resolve_max_model_len
from atom_models.loader import build_model, checkpoint_files, fill_dummy_weights, load_weights, projections
from atom_models.ops import available_backends, default_backend, use_backend

logger = logging.getLogger(__name__)


def _say(message: str) -> None:
    print(f"[atom-compile] {message}", file=sys.stderr, flush=True)


def trace_model_dir(model_dir: str | Path, options: ExportOptions) -> tuple[torch.nn.Module, TracedModel]:
    """Build the model on the export device with its weights, and trace it."""
    device = resolve_device(options.device)
    config = load_config(model_dir)
    _say(f"loading {model_dir} on {device}")
    dtype = resolve_dtype(options.dtype, config)
    model = build_model(config, dtype, device, options.quantization, options.quantization_exclude)
    if options.quantization_exclude:
        linears = projections(model)
        kept = sum(module.quant is None for module in linears)
        _say(f"{kept} of {len(linears)} projections left unquantized ({', '.join(options.quantization_exclude)})")
    if options.load_dummy:
        fill_dummy_weights(model)
    else:
        load_weights(model, model_dir)
    return model, trace_model(model)


def export_model(model_dir: str | Path, output: str | Path, options: ExportOptions | None = None) -> dict:
    """Trace, rewrite, split, compile and write the artifact; returns its manifest.

    The traced FX graphs are cyclic, so the model they hold (its weights on the export device) is garbage only the
    collector frees: run before returning, or the caller's next allocations (a KV cache, the artifact's own weights
    after a --rebuild) find that memory taken."""
    manifest = _export_model(model_dir, output, options or ExportOptions())
    gc.collect()
    return manifest


def _export_model(model_dir: str | Path, output: str | Path, options: ExportOptions) -> dict:
    options.validate()
    model_dir, output = Path(model_dir).resolve(), Path(output)
    # Checked now, not after the minutes of compiling: an export replaces only an artifact, never other files.
    if output.exists() and not output.is_dir():
        raise ValueError(f"output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not (output / artifact.MANIFEST).is_file():
        raise ValueError(f"output {output} is a directory with files that are not an atom artifact; choose another")
    output.parent.mkdir(parents=True, exist_ok=True)
    device = resolve_device(options.device)
    backend = options.backend or default_backend(device)
    if backend not in available_backends(device):
        raise ValueError(
            f"ops backend {backend!r} is not available on {device}; available: {available_backends(device)}"
        )
    # an unknown pass or a context the model lacks is an error now, not after loading and tracing
    pipeline = resolve_pipeline(options.passes)
    max_model_len = resolve_max_model_len(options.max_model_len, load_config(model_dir))
    started = time.perf_counter()
    with use_backend(backend):
        model, traced = trace_model_dir(model_dir, options)
        _say(f"traced {len(traced.graph_module.graph.nodes)} nodes")
        records = run_passes(traced.graph_module, pipeline)
        _say("passes: " + ", ".join(f"{r.name}×{r.matches}" for r in records))
        propagate_fake_values(traced.graph_module)
        top, pieces = split_at_attention(traced.graph_module)
        staging = Path(tempfile.mkdtemp(prefix=".atom-export-", dir=output.parent))
        try:
            piece_entries = _write_pieces(staging, top, pieces, options.level, device)
            if device.type == "cuda":
                forward, pieces_by_name = load_top_graph(staging), load_pieces(staging, piece_entries)
                run = partial(forward, pieces_by_name)
                warm_kernels(staging / TRITON_CACHE, run, traced, model, max_model_len, options.block_size)
            weights = _write_weights(staging, model, model_dir, options)
            quant_config = getattr(model, "quant_config", None)
            kv_scaled = quant_config is not None and quant_config.kv_cache_scales
            _copy_tokenizer(model_dir, staging)
            files = [str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()]
            manifest = {
                **artifact.environment(device),
                "atom_version": artifact.atom_version(),
                "architecture": model.config.architectures[0],
                "model_config": model.config.to_dict(),
                "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
                "device": str(device),
                "ops_backend": backend,
                "level": options.level,
                "quantization": quant_config.to_dict() if quant_config is not None else None,
                # An FP8 KV cache (--kv-cache-dtype fp8 at serve time) is scaled per tensor by these.
                "kv_cache_scales": "per-tensor, from the checkpoint" if kv_scaled else "per-tensor, 1.0",
                "passes": [asdict(r) for r in records],
                "max_model_len": max_model_len,
                "block_size": options.block_size,
                "export_options": asdict(options),
                "inputs": [asdict(i) for i in traced.inputs],
                "pieces": piece_entries,
                "weights": weights,
                "export_seconds": round(time.perf_counter() - started, 2),
                "files": artifact.checksums(staging, files),
            }
            artifact.write_manifest(staging, manifest)
            if output.exists():
                shutil.rmtree(output)
            staging.chmod(0o755)
            staging.rename(output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _say(f"wrote {output} in {manifest['export_seconds']:.1f} s")
    return manifest


def _write_pieces(staging: Path, top, pieces: list[Piece], level: int, device: torch.device) -> dict:
    (staging / "graphs").mkdir()
    (staging / "graphs" / "model.py").write_text(graph_source(top))
    distinct: dict[str, Piece] = {}
    entries = {}
    for piece in pieces:
        distinct.setdefault(piece.key, piece)
        code = f"graphs/piece_{piece.key}.py"
        entries[piece.name] = {
            "key": piece.key,
            "code": code,
            "compiled": None,
            "format": None,
            "returns_tuple": piece.returns_tuple,
            "kv_cache_op": piece.runs_eagerly,
            "eager": piece.runs_eagerly or level == 0,
        }
    for key, piece in distinct.items():
        (staging / f"graphs/piece_{key}.py").write_text(graph_source(piece.graph_module))
    to_compile = [p for p in distinct.values() if not p.runs_eagerly] if level == 3 else []
    if to_compile:
        (staging / "compiled").mkdir()
    compiled = {}
    for piece in tqdm(to_compile, desc="Compiling pieces", unit="piece", file=sys.stderr):
        file = f"compiled/piece_{piece.key}{SUFFIXES[FORMATS[device.type]]}"
        compiled[piece.key] = {"compiled": file, "format": compile_piece(piece.graph_module, staging / file, device)}
    for entry in entries.values():
        entry.update(compiled.get(entry["key"], {}))
    _say(f"{len(pieces)} pieces, {len(distinct)} distinct, {len(to_compile)} compiled")
    return entries


def _write_weights(staging: Path, model: torch.nn.Module, model_dir: Path, options: ExportOptions) -> dict:
    source = {"model_dir": str(model_dir)}  # what `--rebuild` re-exports from
    if options.weights == "dummy":
        return {"mode": "dummy", **source}
    if options.weights == "copy":
        (staging / "weights").mkdir()
        tensors = {name: p.detach().contiguous().cpu() for name, p in model.named_parameters()}
        save_file(tensors, staging / "weights" / "model.safetensors", metadata={"format": "pt"})
        return {"mode": "copy", "file": "weights/model.safetensors", **source}
    _say("fingerprinting the source weights")
    files = {f.name: artifact.file_digest(f) for f in checkpoint_files(model_dir)}
    return {"mode": "reference", **source, "files": files}


def _copy_tokenizer(model_dir: Path, staging: Path) -> None:
    for name in artifact.TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, staging / name)
