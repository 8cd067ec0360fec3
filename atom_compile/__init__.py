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

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from atom_compile.lazy_names import lazy_names
from atom_compile.options import ExportOptions

if TYPE_CHECKING:
    from atom_compile.export import export_model
    from atom_compile.load import CompiledModel, is_artifact, load_artifact
    from atom_compile.passes import list_passes, register_pass, resolve_pipeline, run_passes, unregister_pass
    from atom_compile.reference import compare
    from atom_compile.trace import TracedModel

# The rest load on first use (PEP 562): `atom-compile --help` and bad flags answer before torch imports.
_MODULE_OF = {
    "CompiledModel": "atom_compile.load",
    "TracedModel": "atom_compile.trace",
    "compare": "atom_compile.reference",
    "export_model": "atom_compile.export",
    "is_artifact": "atom_compile.load",
    "list_passes": "atom_compile.passes",
    "load_artifact": "atom_compile.load",
    "register_pass": "atom_compile.passes",
    "resolve_pipeline": "atom_compile.passes",
    "run_passes": "atom_compile.passes",
    "unregister_pass": "atom_compile.passes",
}

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


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)


class _Package(types.ModuleType):
    """Keeps `export` and `trace` the functions below: importing a submodule binds it on its package, and the
    submodules `atom_compile.export` / `atom_compile.trace` now load after them (lazily), not before."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("export", "trace") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def trace(
    model_dir,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    quantization: str | None = None,
    quantization_exclude: Sequence[str] = (),
) -> TracedModel:
    """The model in `model_dir` traced to one FX graph (no passes applied)."""
    from atom_compile.export import trace_model_dir

    options = ExportOptions(
        device=device, dtype=dtype, quantization=quantization, quantization_exclude=quantization_exclude
    )
    return trace_model_dir(model_dir, options)[1]


def export(model_dir, output, **options) -> dict:
    """`atom-compile export` from Python; keyword arguments are `ExportOptions` fields."""
    from atom_compile.export import export_model

    return export_model(model_dir, output, ExportOptions(**options))
