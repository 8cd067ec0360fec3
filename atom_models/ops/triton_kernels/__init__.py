"""Triton kernels for the `atom` ops, one module per op family.

Importing this package registers every kernel as the "triton" implementation of its op
(see `atom_models.ops.backend`); it raises ImportError where Triton is not installed,
which is how the backend probes whether Triton is available.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the triton ops backend needs the 'triton' package") from exc


def _use_inductors_ptxas() -> None:
    """Compile with the ptxas Inductor uses: torch's own, where its wheel ships one.

    Loading Inductor's kernels points Triton at torch's ptxas (TRITON_PTXAS_PATH), and ptxas's
    version is part of Triton's cache key (read once per process). A serving process always loads
    Inductor's kernels first; unless every process settles on the same ptxas before its first
    compile, kernels compiled into an artifact at export miss at serving and compile again.
    """
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # pragma: no cover - a torch without it leaves Triton's choice alone
        return
    _set_triton_ptxas_path()


_use_inductors_ptxas()

from atom_models.ops.triton_kernels import (  # noqa: F401, E402
    activation,
    attention,
    gemm,
    norm,
    quant,
    rotary_cache,
    sampling,
)
