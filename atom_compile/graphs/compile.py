"""Compile a piece with Inductor, ahead of time, into a file that loads without compiling.

Two formats, one per device, each chosen because it is the one that loads cleanly there
(measured with torch 2.13 on CPU and torch 2.11 on H100):

- CPU, "aoti": the piece is exported on its own and compiled with AOTInductor into a `.pt2`
  package, a shared library that `aoti_load_package` maps in without invoking a compiler.
  (`standalone_compile(...).save()` artifacts re-run g++ when they load on CPU.)
- CUDA, "inductor": `torch._inductor.standalone_compile` on the piece's graph with its
  symbolic sizes, saved in the binary format; loading unpacks the compiled Triton kernels
  into the Triton cache, compiling nothing. (An AOTInductor CUDA package crashed the
  process that loaded it, on torch 2.11.)

Either way the piece's inputs, weights included, are plain arguments, so one compiled
piece serves every layer that has its structure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import sympy
import torch
from torch.export import Dim
from torch.fx import GraphModule

from atom_models.ops.activation import silu_and_mul_reference
from atom_models.ops.linear import (
    fused_add_rms_norm_linear_reference,
    linear_reference,
    logits_reference,
    rms_norm_linear_reference,
    silu_and_mul_linear_reference,
)
from atom_models.ops.mlp import Projections
from atom_models.ops.norm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_rows_reference,
    rms_norm_reference,
)
from atom_models.ops.rotary import rotary_embedding_reference

FORMATS = {"cpu": "aoti", "cuda": "inductor"}
SUFFIXES = {"aoti": ".pt2", "inductor": ".bin"}


def inductor_decompositions() -> dict:
    """Ops Inductor generates better than an opaque call: their references, decomposed into the piece.

    Inside a compiled piece a custom op is a fallback call Inductor cannot fuse with its
    neighbours; these ops are elementwise or row-wise, so Inductor's own kernels for the
    reference code fuse the residual add, norm, activation and RoPE around the GEMMs.
    """
    return {
        torch.ops.atom.rms_norm.default: rms_norm_reference,
        torch.ops.atom.fused_add_rms_norm.default: fused_add_rms_norm_reference,
        torch.ops.atom.silu_and_mul.default: silu_and_mul_reference,
        torch.ops.atom.rotary_embedding.default: rotary_embedding_reference,
    }


def cpu_decompositions() -> dict:
    """The projections, fused or not, and the final norm over the sampled rows, as their references in a CPU piece.

    On CPU the ops always run their references; inside an AOTInductor package an op would be a call
    back into Python for every projection (25-40 us each), where Inductor's own GEMM needs none.
    """
    return {
        torch.ops.atom.linear.default: linear_reference,
        torch.ops.atom.logits.default: logits_reference,
        torch.ops.atom.rms_norm_linear.default: rms_norm_linear_reference,
        torch.ops.atom.fused_add_rms_norm_linear.default: fused_add_rms_norm_linear_reference,
        torch.ops.atom.silu_and_mul_linear.default: silu_and_mul_linear_reference,
        torch.ops.atom.fused_add_rms_norm_mlp.default: _mlp_as_projections,
        torch.ops.atom.fused_add_rms_norm_rows.default: fused_add_rms_norm_rows_reference,
    }


# On CPU the MLP op runs as the fused projections it stands for: unquantized ones as their references (Inductor's
# GEMMs), FP8 ones as their ops (not decomposed on CPU either).
_mlp_as_projections = Projections(
    fused_add_rms_norm_linear_reference,
    torch.ops.atom.fused_add_rms_norm_fp8_linear,
    silu_and_mul_linear_reference,
    torch.ops.atom.silu_and_mul_fp8_linear,
)


def register_inductor_decompositions() -> None:
    """Make Inductor (only Inductor) expand these ops into their references when it compiles a piece."""
    from torch._inductor.decomposition import decompositions, register_decomposition

    for op, reference in inductor_decompositions().items():
        if op not in decompositions:
            register_decomposition(op)(reference)


def _dim(expr: sympy.Expr, dims: dict[str, Dim]):
    """A torch.export dimension for a symbolic size `s` or `s + c`."""
    if isinstance(expr, sympy.Symbol):
        return dims.setdefault(expr.name, Dim(expr.name))
    if isinstance(expr, sympy.Add) and len(expr.args) == 2:
        constant, symbol = sorted(expr.args, key=lambda a: isinstance(a, sympy.Symbol))
        if isinstance(symbol, sympy.Symbol) and isinstance(constant, sympy.Integer):
            return _dim(symbol, dims) + int(constant)
    raise NotImplementedError(f"piece input size {expr} is neither a symbol nor a symbol plus a constant")


def example_inputs(piece: GraphModule, device: torch.device) -> tuple[list[torch.Tensor], list[dict | None]]:
    """Concrete inputs at the traced sizes, and which of their dimensions are dynamic."""
    dims: dict[str, Dim] = {}
    args, dynamic = [], []
    for node in piece.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            raise NotImplementedError(f"piece input {node.name} is not a tensor ({val!r})")
        sizes, spec = [], {}
        for i, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                spec[i] = _dim(size.node.expr, dims)
                sizes.append(size.node.hint)
            else:
                sizes.append(int(size))
        if val.dtype.is_floating_point and val.dtype.itemsize >= 2:
            tensor = torch.randn(sizes, device=device).to(val.dtype)
        else:
            tensor = torch.zeros(sizes, dtype=val.dtype, device=device)
        args.append(tensor)
        dynamic.append(spec or None)
    return args, dynamic


def compile_piece(piece: GraphModule, path: Path, device: torch.device) -> str:
    """Inductor-compile `piece` for dynamic sizes into `path`; returns the format used."""
    register_inductor_decompositions()
    fmt = FORMATS[device.type]
    with torch.no_grad():
        if fmt == "aoti":
            args, dynamic = example_inputs(piece, device)
            with warnings.catch_warnings():  # torch's own copies of its LeafSpecs warn (torch 2.13), twice a piece
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
                exported = torch.export.export(piece, tuple(args), dynamic_shapes=tuple(dynamic))
                exported = exported.run_decompositions(cpu_decompositions())
                torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        else:
            fakes = [n.meta["val"] for n in piece.graph.nodes if n.op == "placeholder"]
            compiled = torch._inductor.standalone_compile(piece, fakes, dynamic_shapes="from_graph")
            compiled.save(path=str(path), format="binary")
    return fmt


def load_compiled_piece(path: Path, fmt: str, returns_tuple: bool) -> Callable:
    """The compiled piece as a function with the FX piece's calling convention."""
    if fmt == "aoti":
        runner = torch._inductor.aoti_load_package(str(path))
    else:
        runner = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    if returns_tuple:
        return lambda *args: tuple(runner(*args))

    def single(*args):
        out = runner(*args)
        return out[0] if isinstance(out, list | tuple) else out

    return single
