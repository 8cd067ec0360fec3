"""`atom-compile`: export an HF model to an artifact, list passes, show what an artifact holds."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from atom_compile.options import (
    DEFAULT_BLOCK_SIZE,
    DTYPE_NAMES,
    LEVELS,
    QUANTIZATION_EXCLUDE_FLAG,
    WEIGHT_MODES,
    ExportOptions,
    dtype_name,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom-compile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="trace, fuse, split and compile a model into an artifact")
    export.add_argument("model_dir", type=Path, help="HF model directory (config.json, *.safetensors, tokenizer)")
    export.add_argument("-o", "--output", type=Path, required=True, help="artifact directory to write")
    export.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    export.add_argument("--dtype", default="auto", type=dtype_name, choices=["auto", *DTYPE_NAMES])
    export.add_argument(
        "--passes", default=None, help="pass names, or +name,-name edits of the default list (write --passes=-name)"
    )
    export.add_argument("--level", type=int, default=3, choices=LEVELS, help="0: eager FX pieces; 3: Inductor")
    export.add_argument("--max-model-len", type=int, default=None)
    export.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV-cache block that serving will use (its GPU kernels are compiled for it)",
    )
    export.add_argument("--quantization", default=None, choices=["fp8"], help="quantize weights online")
    export.add_argument("--quantization-exclude", **QUANTIZATION_EXCLUDE_FLAG)
    export.add_argument(
        "--weights",
        default="reference",
        choices=WEIGHT_MODES,
        help="reference the checkpoint (by fingerprint), copy weights in, or dummy (random at load)",
    )
    export.add_argument("--load-dummy", "--load_dummy", action="store_true", help="random weights (benchmarks)")
    export.add_argument("--backend", default=None, choices=["torch", "triton", "aiter"], help="ops backend")

    commands.add_parser("passes", help="list the registered passes in pipeline order")

    show = commands.add_parser("show", help="pieces, op counts and fired passes of an artifact")
    show.add_argument("artifact", type=Path)
    show.add_argument("--piece", default=None, help="piece to render (default: the largest compiled one)")
    show.add_argument("--svg", type=Path, default=None, help="write the piece's graph as SVG (needs graphviz)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # after parsing: these import torch (~3 s)
    from atom_compile.export import export_model
    from atom_compile.passes import list_passes

    # ValueError covers ArtifactError, WeightLoadError and UnsupportedModelError; OSError an output that cannot be
    # written (under a file, no permission) as well as a missing input
    user_errors = (ValueError, KeyError, OSError)
    try:
        if args.command == "export":
            options = ExportOptions(
                device=args.device,
                dtype=args.dtype,
                passes=args.passes,
                level=args.level,
                max_model_len=args.max_model_len,
                block_size=args.block_size,
                quantization=args.quantization,
                quantization_exclude=args.quantization_exclude,
                weights=args.weights,
                load_dummy=args.load_dummy,
                backend=args.backend,
            )
            export_model(args.model_dir, args.output, options)
        elif args.command == "passes":
            for p in list_passes():
                print(f"{p.name:<22} v{p.version}  {p.description}")
        else:
            show(args.artifact, args.piece, args.svg)
    except user_errors as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"atom-compile: error: {message}", file=sys.stderr)
        return 2
    return 0


def op_counts(source: str) -> Counter:
    return Counter(re.findall(r"torch\.ops\.(\w+\.\w+)\.\w+\(", source))


def show(path: Path, piece: str | None, svg: Path | None) -> None:
    from atom_compile.artifact import read_manifest

    manifest = read_manifest(path)
    entries = manifest["pieces"]
    if piece is not None and piece not in entries:
        raise KeyError(f"no piece {piece!r}; pieces: {', '.join(entries)}")
    print(
        f"{path}: {manifest['architecture']}, {manifest['dtype']} on {manifest['device']} "
        f"({manifest['device_capability']}), level {manifest['level']}, ops backend {manifest['ops_backend']}"
    )
    print("\npasses:")
    for record in manifest["passes"]:
        print(f"  {record['name']:<22} v{record['version']}  fired {record['matches']}×")
    print("\npieces:")
    for name, entry in manifest["pieces"].items():
        kind = "compiled" if entry["compiled"] else ("kv-cache op" if entry["kv_cache_op"] else "eager")
        counts = op_counts((path / entry["code"]).read_text())
        ops = ", ".join(f"{op}×{n}" for op, n in counts.most_common())
        print(f"  {name:<10} {entry['key']}  {kind:<11} {ops}")
    if piece is None:
        piece = max(entries, key=lambda n: sum(op_counts((path / entries[n]["code"]).read_text()).values()))
    source = (path / entries[piece]["code"]).read_text()
    if svg is not None:
        render_svg(source, svg)
        print(f"\nwrote the graph of {piece} to {svg}")
    else:
        print(f"\n{piece} ({entries[piece]['code']}):\n{source}")


def render_svg(source: str, out: Path) -> None:
    """Rebuild the piece's FX graph from its source (symbolically, with proxies) and draw it."""
    # (torch's FxGraphDrawer imports without pydot, and raises only when used)
    if importlib.util.find_spec("pydot") is None or shutil.which("dot") is None:
        raise ValueError("--svg needs pydot and graphviz's `dot`; without them, show prints the piece as text")
    import torch
    from torch.fx import Graph, GraphModule, Proxy
    from torch.fx.node import map_aggregate
    from torch.fx.passes.graph_drawer import FxGraphDrawer
    from torch.fx.proxy import GraphAppendingTracer

    from atom_compile.graphs.codegen import load_graph_source

    forward = load_graph_source(source, "piece")
    names = forward.__code__.co_varnames[1 : forward.__code__.co_argcount]
    graph = Graph()
    tracer = GraphAppendingTracer(graph)
    result = forward(None, *(Proxy(graph.placeholder(name), tracer) for name in names))
    graph.output(map_aggregate(result, lambda value: value.node if isinstance(value, Proxy) else value))
    gm = GraphModule(torch.nn.Module(), graph)
    out.write_bytes(FxGraphDrawer(gm, "piece").get_dot_graph().create_svg())


if __name__ == "__main__":
    sys.exit(main())
