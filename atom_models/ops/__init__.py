"""The ops library: every op models are written in, as `torch.ops.atom.*` custom ops.

Importing this package registers the ops. Each has a fake implementation (so it traces),
a plain-torch reference (the ground truth), and a Triton implementation where the GPU
path needs one (see `backend`; AITER's slot has no kernels yet). `sampling.sample_rows`, which the decode CUDA
graphs capture after the forward and nothing traces, is a plain function on the same backends.
"""

from atom_models.ops import activation, attention, linear, mlp, norm, quant, rotary, sampling  # noqa: F401
from atom_models.ops.attention import KV_CACHE_OPS
from atom_models.ops.backend import (
    available_backends,
    default_backend,
    register_impl,
    set_backend,
    use_backend,
)

__all__ = [
    "KV_CACHE_OPS",
    "available_backends",
    "default_backend",
    "register_impl",
    "set_backend",
    "use_backend",
]
