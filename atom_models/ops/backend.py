"""Which implementation an `atom` op runs: the plain-torch reference, Triton, or AITER.

Each op is one `torch.library` custom op whose body looks up its implementation here.
The reference implementation runs anywhere and is the ground truth in tests; Triton
serves CUDA; AITER is the slot for ROCm's kernels, offered when `aiter` imports and some op
registers an implementation for it (none does yet: atom runs on NVIDIA first). The backend is picked at export
time, written into the artifact's manifest and set again when the artifact loads, so
a traced graph never names a backend: the same FX code runs on any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

BACKENDS = ("torch", "triton", "aiter")

_IMPLS: dict[str, dict[str, Callable]] = {}
_active = "torch"


def register_impl(op_name: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn` implements op `op_name` for `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown ops backend {backend!r}; choose one of {', '.join(BACKENDS)}")

    def wrap(fn: Callable) -> Callable:
        _IMPLS.setdefault(op_name, {})[backend] = fn
        return fn

    return wrap


def implementation(op_name: str, device: torch.device) -> Callable:
    """The function that runs `op_name` on `device` under the active backend.

    CPU tensors always take the reference: Triton and AITER kernels need a GPU
    (tests call Triton kernels directly under TRITON_INTERPRET=1 instead).
    """
    impls = _IMPLS[op_name]
    if device.type != "cpu" and _active in impls:
        return impls[_active]
    return impls["torch"]


def available_backends(device: str | torch.device) -> list[str]:
    """Backends that can run on `device` in this process, best first."""
    device = torch.device(device)
    if device.type == "cpu":
        return ["torch"]
    found = []
    if torch.version.hip is not None and any("aiter" in impls for impls in _IMPLS.values()):
        try:
            import aiter  # noqa: F401

            found.append("aiter")
        except ImportError:
            pass
    try:
        from atom_models.ops import triton_kernels  # noqa: F401

        found.append("triton")
    except ImportError:
        pass
    return [*found, "torch"]


def default_backend(device: str | torch.device) -> str:
    return available_backends(device)[0]


def set_backend(name: str) -> None:
    global _active
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "triton":
        from atom_models.ops import triton_kernels  # noqa: F401  (registers the kernels)
    _active = name


@contextmanager
def use_backend(name: str):
    previous = _active
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)
