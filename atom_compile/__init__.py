"""The compiler: trace an HF model once to FX, rewrite it with passes, split it at attention,
compile the pieces with Inductor, and write an artifact that serves without tracing.

Python API for compiler experiments::

    import atom_compile as ac

    traced = ac.trace("MODEL_DIR")                    # TracedModel; .graph_module is the FX graph
    print([p.name for p in ac.list_passes()])
    ac.run_passes(traced.graph_module, ac.resolve_pipeline("-cleanup"))

    @ac.register_pass("count_linears")
    def count_linears(gm):                            # a pass returns how often it matched
        return sum(n.target is torch.ops.atom.linear.default for n in gm.graph.nodes)

    ac.export("MODEL_DIR", "ARTIFACT", passes="+count_linears", device="cpu")
    print(ac.compare("ARTIFACT"))                     # against the eager reference model
"""

from atom_compile.export import ExportOptions, export_model
from atom_compile.load import CompiledModel, is_artifact, load_artifact
from atom_compile.passes import list_passes, register_pass, resolve_pipeline, run_passes, unregister_pass
from atom_compile.reference import compare
from atom_compile.trace import TracedModel

__all__ = [
    "CompiledModel",
    "ExportOptions",
    "TracedModel",
    "compare",
    "export",
    "export_model",
    "is_artifact",
    "list_passes",
    "load_artifact",
    "register_pass",
    "resolve_pipeline",
    "run_passes",
    "trace",
    "unregister_pass",
]


def trace(model_dir, *, device: str = "cpu", dtype: str = "auto", quantization: str | None = None) -> TracedModel:
    """The model in `model_dir` traced to one FX graph (no passes applied)."""
    from atom_compile.export import trace_model_dir

    return trace_model_dir(model_dir, ExportOptions(device=device, dtype=dtype, quantization=quantization))[1]


def export(model_dir, output, **options) -> dict:
    """`atom-compile export` from Python; keyword arguments are `ExportOptions` fields."""
    return export_model(model_dir, output, ExportOptions(**options))
