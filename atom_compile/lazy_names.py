"""A package's public names that load on first use (PEP 562), torch-free: `atom-compile` and `atom-run` parse their
flags before torch imports."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, module_of: dict[str, str], names: list[str]) -> tuple[Callable, Callable]:
    """The package's `__getattr__` (each name of `module_of` from its module, on first use) and `__dir__`."""

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module_of[name]), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
