"""The serving half of atom: engine, scheduler, KV cache, sampler, offline and HTTP APIs."""

from atom_runtime.config import EngineConfig
from atom_runtime.llm import LLM
from atom_runtime.outputs import CompletionOutput, RequestOutput
from atom_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
