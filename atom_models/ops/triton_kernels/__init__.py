"""Triton kernels for the `atom` ops, one module per op family.

Importing this package registers every kernel as the "triton" implementation of its op
(see `atom_models.ops.backend`); it raises ImportError where Triton is not installed,
which is how the backend probes whether Triton is available.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the triton ops backend needs the 'triton' package") from exc

from atom_models.ops.triton_kernels import activation, attention, gemm, norm, quant, rotary_cache  # noqa: F401, E402
