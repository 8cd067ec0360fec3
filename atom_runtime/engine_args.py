"""The engine's command-line flags (ATOM's and vLLM's names), shared by `atom-run serve` and `generate`.

Each `EngineConfig` field has one flag here, with the field's default; `create_engine_kwargs`
turns parsed flags back into `create_engine` arguments, field by field, so a flag list
exists only once.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from atom_compile.options import DEFAULT_BLOCK_SIZE, DTYPE_NAMES, QUANTIZATION_EXCLUDE_FLAG, dtype_name
from atom_runtime.config import CUDAGRAPH_MODES, KV_CACHE_DTYPES, EngineConfig

_DEFAULTS = EngineConfig()


def capture_sizes(text: str) -> list[int]:
    """ATOM's list syntax, "[1,2,4,8]", or plain "1,2,4,8"."""
    try:
        sizes = [int(s) for s in text.strip().strip("[]").split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list of integers like [1,2,4,8], got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("the list of capture sizes is empty")
    return sizes


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype",
        default="auto",
        type=dtype_name,
        choices=["auto", *DTYPE_NAMES],
        help="weights' and activations' dtype (auto: the model's; half and float as vLLM's spellings)",
    )
    group.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    group.add_argument("--load-dummy", action="store_true", help="random weights instead of the checkpoint's")
    group.add_argument(
        "--generation-config",
        default="auto",
        help="requests' sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens "
        "caps max_tokens): auto (the model's generation_config.json), vllm (none), or a directory with that file",
    )
    group.add_argument("--quantization", choices=["fp8"], default=None, help="quantize an HF model's weights online")
    group.add_argument("--quantization-exclude", **QUANTIZATION_EXCLUDE_FLAG)
    group.add_argument(
        "--rebuild", action="store_true", help="re-export an artifact that does not fit this machine instead of failing"
    )
    group.add_argument(
        "--max-model-len", type=int, default=_DEFAULTS.max_model_len, help="context length (default: the model's)"
    )
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="sequences per step")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens, help="tokens per step"
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=_DEFAULTS.block_size,
        help=f"tokens per KV-cache block (default: the artifact's, else {DEFAULT_BLOCK_SIZE})",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_DEFAULTS.gpu_memory_utilization,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    group.add_argument(
        "--num-kvcache-blocks",
        type=int,
        default=_DEFAULTS.num_kvcache_blocks,
        help="KV-cache blocks (default: sized from free memory)",
    )
    group.add_argument(
        "--cpu-kvcache-space-gib",
        type=float,
        default=_DEFAULTS.cpu_kvcache_space_gib,
        help="KV-cache size when running on CPU",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=_DEFAULTS.kv_cache_dtype,
        help="auto: the model's dtype (bf16 forces it); fp8: e4m3 with per-tensor scales (the checkpoint's, else 1.0); "
        "fp8_per_token_head: e4m3 with a scale per token and head, kept in the cache",
    )
    group.add_argument(
        "--max-logprobs", type=int, default=_DEFAULTS.max_logprobs, help="most logprobs a request may ask for"
    )
    group.add_argument(
        "--enforce-eager", action="store_true", default=_DEFAULTS.enforce_eager, help="never capture CUDA graphs"
    )
    group.add_argument(
        "--cudagraph-mode",
        type=str.upper,
        choices=CUDAGRAPH_MODES,
        default=_DEFAULTS.cudagraph_mode,
        help="FULL: whole steps replay CUDA graphs (decode batches, and prefill and mixed steps up to the largest "
        "capture size of tokens); PIECEWISE: the compiled pieces between attention ops replay graphs per token count; "
        "FULL_AND_PIECEWISE (default): FULL's for decode, PIECEWISE otherwise; NONE",
    )
    group.add_argument(
        "--cudagraph-capture-sizes",
        type=capture_sizes,
        default=_DEFAULTS.cudagraph_capture_sizes,
        help="sizes to capture (sequences for decode graphs, tokens for PIECEWISE graphs and FULL graphs of mixed "
        'steps), as a list: "[1,2,4,8,16,32]" '
        "(default: 1, 2, 4, 8, 16, 32, ..., 512)",
    )
    group.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="random seed")
    group.add_argument(
        "--torch-profiler-dir", default=None, help="where /start_profile and /stop_profile write torch.profiler traces"
    )


def create_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`create_engine` keyword arguments from flags added by `add_engine_args`.

    Raises ValueError for settings `EngineConfig` refuses.
    """
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
    return dict(
        dtype=args.dtype,
        device=args.device,
        load_dummy=args.load_dummy,
        quantization=args.quantization,
        quantization_exclude=tuple(args.quantization_exclude),
        rebuild=args.rebuild,
        generation_config=args.generation_config,
        config=config,
    )
