"""The serving half of atom: engine, scheduler, KV cache, sampler, offline and HTTP APIs.

Its public names load on first use (PEP 562), so `atom-run --help` and argument errors answer before torch
imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_compile.lazy_names import lazy_names

if TYPE_CHECKING:
    from atom_runtime.config import EngineConfig
    from atom_runtime.llm import LLM
    from atom_runtime.outputs import CompletionOutput, RequestOutput
    from atom_runtime.sampling_params import SamplingParams, StructuredOutputsParams

_MODULE_OF = {
    "LLM": "atom_runtime.llm",
    "CompletionOutput": "atom_runtime.outputs",
    "EngineConfig": "atom_runtime.config",
    "RequestOutput": "atom_runtime.outputs",
    "SamplingParams": "atom_runtime.sampling_params",
    "StructuredOutputsParams": "atom_runtime.sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)
