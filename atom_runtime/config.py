"""Engine settings, named and defaulted as ATOM's and vLLM's engine arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

# fp8: e4m3 with per-tensor scales (the checkpoint's, else 1.0); fp8_per_token_head: e4m3 with a scale per token and
# head, computed as each entry is written and kept in the cache (see `atom_models.ops.attention`).
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp8_per_token_head")
# NONE: no graphs. FULL: whole steps replay captured graphs: pure-decode batches by batch size, prefill and mixed
# steps of up to the largest capture size of tokens by (tokens, sequences) buckets, as vLLM's FULL.
# PIECEWISE: the compiled pieces between attention ops replay graphs per token count, for every step.
# FULL_AND_PIECEWISE: FULL's graphs for pure-decode batches, PIECEWISE for prefill and mixed ones.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
DEFAULT_CAPTURE_SIZES = [1, 2, 4, 8, *range(16, 513, 16)]


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int | None = None  # default: an artifact's (its GPU kernels are compiled for it), else 16
    gpu_memory_utilization: float = 0.9
    num_kvcache_blocks: int | None = None  # default: sized from free memory
    cpu_kvcache_space_gib: float = 1.0  # KV cache size when running on CPU
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto = the model's dtype
    max_logprobs: int = 20
    enforce_eager: bool = False
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: list[int] | None = None  # default: 1, 2, 4, 8, 16, 32, 48, ..., 512
    seed: int | None = 0  # None: 0, as vLLM's V1 engine takes it (it has no unseeded mode either)

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = 0
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 < self.cpu_kvcache_space_gib < math.inf:  # (NaN too)
            raise ValueError(f"cpu_kvcache_space_gib must be positive and finite, got {self.cpu_kvcache_space_gib}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be positive, got {self.num_kvcache_blocks}")
        self.cudagraph_mode = self.cudagraph_mode.upper()
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        if self.cudagraph_capture_sizes is not None and any(s < 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive, got {self.cudagraph_capture_sizes}")

    def graph_capture_sizes(self) -> list[int]:
        """Decode batch sizes (sequences) to capture FULL graphs for: none when eager or not FULL*."""
        if self.enforce_eager or self.cudagraph_mode not in ("FULL", "FULL_AND_PIECEWISE"):
            return []
        return sorted({s for s in self._capture_sizes() if s <= self.max_num_seqs})

    def mixed_graph_sizes(self) -> list[int]:
        """Token counts to capture FULL graphs of prefill and mixed steps for: in FULL mode only."""
        if self.enforce_eager or self.cudagraph_mode != "FULL":
            return []
        return sorted({s for s in self._capture_sizes() if s <= self.max_num_batched_tokens})

    def piecewise_capture_sizes(self) -> list[int]:
        """Token counts to capture PIECEWISE graphs for: none when eager or not *PIECEWISE."""
        if self.enforce_eager or self.cudagraph_mode not in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            return []
        return sorted({s for s in self._capture_sizes() if s <= self.max_num_batched_tokens})

    def _capture_sizes(self) -> list[int]:
        return self.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES
