"""The serving half of atom: engine, scheduler, KV cache, sampler, offline and HTTP APIs.

Its public names load on first use (PEP 562), so `atom-run --help` and argument errors answer before torch
imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atom_runtime.config import EngineConfig
    from atom_runtime.llm import LLM
    from atom_runtime.outputs import CompletionOutput, RequestOutput
    from atom_runtime.sampling_params import SamplingParams

_MODULE_OF = {
    "LLM": "atom_runtime.llm",
    "CompletionOutput": "atom_runtime.outputs",
    "EngineConfig": "atom_runtime.config",
    "RequestOutput": "atom_runtime.outputs",
    "SamplingParams": "atom_runtime.sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'atom_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
