"""Our own Triton kernels (attention, fused cache writes, ...) compiled at export and shipped.

The compiled pieces carry Inductor's kernels inside them; the ops that run between pieces
call atom's Triton kernels, which Triton compiles on first use (and the runtime's `sample_rows` and
`carry_tokens` around them). At export we run the artifact as serving will (its top graph over the compiled
pieces, whose output strides the kernels specialise on) over steps shaped like the runtime's
(decode batches, prefill chunks, mixed), with `TRITON_CACHE_DIR` pointing into the artifact,
so every kernel variant serving launches is compiled there; loading copies them into the
process's Triton cache. Kernels mark their step-dependent integer arguments
`do_not_specialize`, so these few shapes cover all steps.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from atom_compile.trace import TracedModel, graph_arguments, model_weights
from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of
from atom_models.ops.attention import INLINE_SCALE_DTYPE, kv_cache_shape
from atom_models.ops.quant import FP8_DTYPE
from atom_models.ops.sampling import carry_tokens, sample_rows

TRITON_CACHE = "triton_cache"


def triton_cache_dir() -> Path:
    """Where Triton reads and writes compiled kernels in this process.

    Triton's own knob, not the environment: it honours TRITON_CACHE_DIR, but an explicit setting
    made by other code in the process (an override of the knob) wins over the variable.
    """
    import triton

    return Path(triton.knobs.cache.dir)


@contextmanager
def triton_cache_at(path: Path) -> Iterator[None]:
    """Point Triton's kernel cache at `path` for a while, whatever overrides were in place."""
    import triton

    knobs = triton.knobs.cache
    overridden = "dir" in vars(knobs)
    previous = vars(knobs).get("dir")
    knobs.dir = str(path)
    try:
        yield
    finally:
        if overridden:
            knobs.dir = previous
        else:
            del knobs.dir


WARM_CONTEXT = 40  # each decode sequence's cached tokens


def warm_steps(max_model_len: int, unsplit_batch: int, large_tile_tokens: int) -> list[list[tuple[int, int]]]:
    """Steps as lists of (context already cached, new tokens) per sequence; `unsplit_batch`: the fewest sequences
    whose attention launch splits no context (the kernel's other variant, in decode-only and mixed launches);
    `large_tile_tokens`: the fewest prefill tokens of a step whose attention takes the large prefill tiles (a step
    of that many, in as few sequences as `max_model_len` allows, plus one token a further sequence)."""
    decode = [[(WARM_CONTEXT, 1)] * n for n in sorted({1, 2, 3, 16, 17, unsplit_batch})]  # 2: splits if any does
    prefill = [[(0, n)] for n in (1, 7, 16, 33, 130)]  # past 64 tokens: the GEMMs' larger tile configs
    seqs = max(1, -(-(large_tile_tokens - 1) // max(1, max_model_len - 1)))
    tokens = large_tile_tokens + seqs - 1
    prefill.append([(0, tokens // seqs + (i < tokens % seqs)) for i in range(seqs)])
    mixed = [[(0, 21), (30, 1), (12, 9), (50, 1)], [(0, 100), (20, 1)], [(0, 9)] + [(WARM_CONTEXT, 1)] * unsplit_batch]
    return [[(c, n) for c, n in step if c + n <= max_model_len] for step in decode + prefill + mixed]


def step_inputs(step: list[tuple[int, int]], max_blocks: int, block_size: int, device: torch.device) -> tuple:
    """(input_ids, positions, metadata, logits_indices) laid out like the runtime's persistent buffers."""
    positions, slots, tables = [], [], []
    next_block = 0
    for context, new in step:
        blocks = list(range(next_block, next_block + -(-(context + new) // block_size)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        for p in range(context, context + new):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    lens = [c + n for c, n in step]
    starts = [0]
    for _, new in step:
        starts.append(starts[-1] + new)
    i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, **i64),
        block_tables=torch.tensor(tables, **i32),
        seq_lens=torch.tensor(lens, **i32),
        query_start_loc=torch.tensor(starts, **i32),
    )
    return torch.zeros(len(positions), **i64), torch.tensor(positions, **i64), meta, torch.tensor(starts[1:], **i64) - 1


def kv_cache_dtypes(model: nn.Module, device: torch.device, block_size: int) -> list[torch.dtype]:
    """The KV-cache dtypes serving may choose: the model's (or bf16), and FP8 where the GPU has it (sm_89+), with
    per-tensor scales and, where the head is wide enough for a block's scales in one slot, inline ones."""
    dtypes = [model.lm_head.weight.dtype]
    if dtypes[0] != torch.bfloat16:
        dtypes.append(torch.bfloat16)
    if torch.cuda.get_device_capability(device) >= (8, 9):
        dtypes.append(FP8_DTYPE)
        if head_dim_of(model.config) >= 4 * block_size:
            dtypes.append(INLINE_SCALE_DTYPE)
    return dtypes


def forget_compiled_kernels() -> None:
    """Drop atom's Triton kernels from Triton's in-process cache.

    A variant this process compiled before (the export's reference check runs the same kernels) is
    launched from memory and never written to the artifact's cache; forgotten, it compiles into it.
    """
    from triton.runtime.jit import JITFunction

    from atom_models.ops import triton_kernels

    for info in pkgutil.iter_modules(triton_kernels.__path__, f"{triton_kernels.__name__}."):
        for value in vars(importlib.import_module(info.name)).values():
            while not isinstance(value, JITFunction) and hasattr(value, "fn"):  # autotune / heuristics wrappers
                value = value.fn
            if isinstance(value, JITFunction):
                value.device_caches.clear()


@torch.inference_mode()
def warm_kernels(
    cache: Path, forward: Callable, traced: TracedModel, model: nn.Module, max_model_len: int, block_size: int
) -> None:
    """Run `forward(*graph inputs)` (the artifact as served, with KV-cache blocks of `block_size` tokens) over
    `warm_steps` into the Triton cache `cache`."""
    from atom_models.ops.triton_kernels.attention import large_tile_tokens, unsplit_decode_batch

    config = model.config
    device = next(model.parameters()).device
    max_blocks = -(-max_model_len // block_size)
    kv_heads, head_dim = config.num_key_value_heads, head_dim_of(config)
    large = large_tile_tokens(kv_heads, config.num_attention_heads, head_dim, device)
    steps = warm_steps(max_model_len, unsplit_decode_batch(kv_heads, head_dim, device), large)
    blocks = max(sum(-(-(c + n) // block_size) for c, n in step) for step in steps)  # every step's tables fit
    kv_shape = (blocks, block_size, kv_heads, head_dim)
    weights = model_weights(model)
    forget_compiled_kernels()
    with triton_cache_at(cache):
        for kv_dtype in kv_cache_dtypes(model, device, block_size):  # serving picks one with --kv-cache-dtype
            shape = kv_cache_shape(kv_dtype, *kv_shape)
            kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(config.num_hidden_layers)]
            for step in steps:
                input_ids, positions, meta, logits_indices = step_inputs(step, max_blocks, block_size, device)
                (logits,) = forward(
                    *graph_arguments(traced.inputs, weights, input_ids, positions, kv_caches, meta, logits_indices)
                )
                if len(step):  # (a short max_model_len can empty a step); the decode graphs' draws, over the logits
                    rows = logits.shape[0]  # as the LM head gives them, with the step inputs' dtypes
                    draws = torch.ones(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device)
                    positions32 = torch.zeros(rows, dtype=torch.int32, device=device)
                    tokens = sample_rows(logits, *draws, positions32)
                    # and as a decode graph draws: moving its inputs on (padding rows, slot -1: none moves)
                    advance = torch.zeros_like(tokens), torch.full_like(tokens, -1), positions32.clone()
                    sample_rows(logits, *draws, positions32, out=torch.empty_like(tokens), advance=advance)
                    carry_tokens(input_ids, logits_indices, torch.arange(rows, device=device), tokens)  # next step's
        torch.cuda.synchronize()


def install_kernels(cache: Path) -> None:
    """Copy an artifact's compiled Triton kernels into this process's Triton cache.

    That cache is the machine's, shared by every process on it (a server a GPU, a benchmark beside an export), so a
    kernel another process may be loading must never be seen half-written: copied over in place, a file is empty
    for a while. Entries are named by a hash of the kernel's source, options and target, so a file already there
    whole (its size) is left as it is; any other (missing, or cut short by an older install) is written under a
    temporary name and renamed into place, an entry's members before its group file (as Triton writes its own).
    Triton's group files list their members by absolute path, which pointed into the export's staging directory:
    they are rewritten to the members' new home, or Triton misses them.
    """
    target = triton_cache_dir()
    files = sorted((p for p in cache.rglob("*") if p.is_file()), key=lambda p: (p.name.startswith("__grp__"), p))
    for source in files:
        dest = target / source.relative_to(cache)
        data = source.read_bytes()
        if source.name.startswith("__grp__"):
            group = json.loads(data)
            children = group["child_paths"]
            group["child_paths"] = {name: str(dest.parent / Path(path).name) for name, path in children.items()}
            data = json.dumps(group).encode()
        if dest.is_file() and dest.stat().st_size == len(data):
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        temp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        temp.write_bytes(data)
        os.replace(temp, dest)
