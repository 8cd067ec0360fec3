"""Paged attention over mixed batches: causal prefill chunks and split-KV decode in one launch.

One kernel, `_attention_kernel`, with a grid sized from tensor shapes alone (a step can be
captured in a CUDA graph; nothing synchronises with the host). Program `i` serves KV head
`i % heads` (the fastest-varying index, so programs are dispatched head by head within each program
index) as program `i // heads` of that head, of two kinds:

- `seqs * splits` decode programs (flash-decoding). For a sequence with exactly one query
  token, program (seq, split) attends over one slice of the context; splitting lets even a
  single long sequence use every multiprocessor. Each writes its partial output and
  log-sum-exp to scratch and takes a ticket; the split that arrives last merges the partials
  into the output and resets the ticket counter. Programs of other sequences do nothing.
  Split-major order: a short context uses only its first splits, and those of every sequence
  and head come first, in the first wave, ahead of the programs that find nothing to do.
- query-tile programs. Tiles cover the flat token dimension as `query_start_loc[s] // BLOCK_Q
  + s + j` (sequence s, tile j), so there are at most `cdiv(tokens, BLOCK_Q) + seqs` of them and
  each finds its sequence by counting the sequences that start before it. A tile of a prefill
  chunk runs flash attention over the paged context: keys before the causal diagonal without
  masks, the diagonal with them. Tiles past the last sequence zero the padding tokens; tiles of
  decode sequences do nothing.

A decode-only step is one launch, because at batch 1 its KV read takes only a few microseconds, about what a
second launch and its dependency cost (the split counters persist between launches: see `common.ticket_counters`).
A step with prefill tokens launches its tiles apart, on a stream of their own beside the decode programs (a
compute-bound launch next to a memory-bound one), with tiles sized to the step (`prefill_tiles`).

An FP8 cache is read with its per-tensor scales folded in: k_scale into the softmax scale, v_scale
into the output (see `atom_models.ops.attention`). Its value tiles are widened to fp16 before the second
product (`_fp8_to_f16`): converted by Triton, they left shared memory a byte a load, and the FP8 cache,
half the bytes, was read no faster than a bf16 one (H100, batch 64 at context 2048: 0.186 ms against bf16's 0.195;
now 0.124).

GQA: a program's rows are (token, head) pairs of all query heads that share one KV head, so
each key/value tile is loaded once per group. Scores and softmax are fp32; probabilities are
rounded to the activation dtype for the second product, as flash attention does (to fp16 over an FP8 cache).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.attention import cache_block_size, inline_scales
from atom_models.ops.backend import register_impl
from atom_models.ops.quant import FP8_DTYPE
from atom_models.ops.triton_kernels.common import (
    FP8_MAX_C,
    cdiv,
    inline_scale_operands,
    last_to_arrive,
    multiprocessors,
    next_power_of_2,
    pdl_launch,
    prefetch_to_l2,
    ticket_counters,
    wait_for_previous_kernel,
)

LOG2E = 1.4426950408889634
# An empty split's log-sum-exp: finite, so merging never computes inf - inf, and far below any real one.
EMPTY_LSE = tl.constexpr(-1.0e30)
MAX_SPLITS = 64
# Inline PTX where the kernels are compiled for NVIDIA GPUs; the interpreter (CPU tests) and ROCm run the same
# arithmetic through Triton's own conversion.
PTX_ASM = tl.constexpr(not triton.knobs.runtime.interpret and torch.version.hip is None)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch parameters.

    `block_m` rows (tokens x heads of a group) and `block_n` keys per prefill tile, `num_warps` for launches
    with prefill tiles; `decode_block_n` keys per decode tile, `unsplit_block_n` where the batch fills the grid
    without splitting a context (each program then walks a whole context, many tiles); the decode grid aims at
    `decode_waves` programs per multiprocessor (at most MAX_SPLITS splits a sequence), `lone_decode_waves` for a
    batch of one sequence; `decode_warps` for decode-only launches; in a batch of several sequences a context
    takes a split for every `split_keys` keys (rounded to whole tiles), up to the launch's splits;
    `lone_decode_stages` pipeline stages of a lone sequence's decode launch (split by the tile: up to MAX_SPLITS
    tiles of context a split walks one tile, where stages buy no overlap and cost shared memory and a prologue;
    longer contexts, several tiles a split, are unmeasured); a split launch's merge loads `merge_elements` fp32
    partial outputs at once (every head of the group, as many splits as fit).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    decode_block_n: int
    decode_waves: int
    decode_warps: int
    lone_decode_waves: int
    unsplit_block_n: int
    split_keys: int
    lone_decode_stages: int
    # 64 a thread at 4 warps: Llama-3's 4 heads a group at head_dim 128 merge 16 splits at once (a lone context of up
    # to 2048 keys in one round trip), Qwen3's 2 heads 32.
    merge_elements: int = 8192
    # Prefill tiles of a step whose tokens make fewer `block_m` tiles than the GPU has multiprocessors.
    small_block_m: int = 64
    small_warps: int = 4
    # Tiles on a stream of their own, beside the decode programs of the step.
    tiles_beside_decodes: bool = True


@functools.cache
def default_config(head_dim: int) -> AttentionConfig:
    # From `benchmarks/bench_kernels.py --sweep` on H100 (head_dim 128, GQA 32/8). Prefill (5055e01): 256x64 tiles with
    # 8 warps led both cases (8x1024 causal 261 TFLOP/s against 255 for the 128x32 / 4 warps of before, 1x8192 426
    # against 351); 128x128 / 8 warps 238 / 388. Decode (2026-11-26): 128-key tiles, 4 warps (8 lost everywhere), splits
    # for one program a multiprocessor: fewer, longer splits than with 4 (batch 8 at context 4096 2.10 TB/s against
    # 1.96, batch 32 at 2048 2.52 / 2.28), except for a lone sequence (below). Where the batch alone fills the grid (no
    # split), 64-key tiles: batch 64 at 2048 2.75 against 2.62, batch 128-256 even or better; in the model batch 64
    # 2.781 -> 2.494 ms a step with the merge sized to the launch. In a batch, a split every 512 keys (batch 8 at
    # context 432 takes one, no merge: 1.289 -> 1.246 ms a step); a lone sequence split by 256 or 512 lost (0.936 /
    # 0.963 against 0.879). A lone sequence's launch in one pipeline stage, not 3 (H100, twelfth session): batch 1 at
    # context 4096 0.0187 -> 0.0153 ms (0.90 -> 1.10 TB/s), at 432 9.5 -> 8.9 us; Qwen3-0.6B's batch-1 graph 0.842 ->
    # 0.834 ms; one stage for batch 8's launch lost (2.10 -> 2.02 TB/s, 1.24 -> 1.27 ms a step: its splits walk several
    # tiles). A lone sequence's grid at 2 programs a multiprocessor, not 4 (H100, nineteenth session): 33 splits
    # launched, where a context of 4096 keys uses 32 and 4 launched 64 (the idle half, at two programs a multiprocessor,
    # a second wave); batch 1 at 4096 1.38 -> 1.52 TB/s, Qwen3-0.6B's batch-1 step even (0.747-0.757 ms, splits without
    # keys ending before the PDL wait). Larger head dims halve the tiles (unmeasured).
    if head_dim > 128:
        return AttentionConfig(64, 32, 4, 2, 64, 4, 4, 4, 64, 256, 2)
    return AttentionConfig(256, 64, 8, 3, 128, 1, 4, 2, 64, 512, 1)


@triton.jit
def _fp8_to_f16(x):
    """e4m3 to fp16 (exact) in an opaque (impure) asm op: Triton moves the MMA operand's layout above its own
    conversions and pure unary asm, down to the fp8 bytes in shared memory, which a value tile (keys-major, and
    ldmatrix transposes only 16-bit elements) then leaves a byte a load. Here it is converted in the layout it
    was loaded in, and the fp16 tile goes through shared memory by ldmatrix."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _held(x):
    """16-bit x unchanged, through an opaque (impure) asm op: Triton converts a loaded tile to its MMA layout right
    after the load, which waits for the data; a tile passed through here is converted only after this point."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _attend(
    acc,
    l_i,
    m_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head_offset,
    k_scales_ptr,
    v_scales_ptr,
    scales_offset,
    lo,
    mask_from,
    hi,
    q_pos,
    qk_scale,
    stride_kb,
    stride_ks,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    VALUES_WITH_KEYS: tl.constexpr,
):
    """Online-softmax attention of q over keys [lo, hi) gathered from the paged cache.

    Every row sees every key before `mask_from`; in the tiles from there on (a causal diagonal, a context's
    last partial tile), key n is visible to row r only if n <= q_pos[r]. Pages past `hi` are never looked up.
    One loop, the masked tiles its last iterations: a second loop for them cost every prefill tile and
    every context's last split a second pipeline prologue, with nothing to overlap it (H100: prefill 8x1024
    282 -> 297 TFLOP/s, batch 8 decode at 4096 2.09 -> 2.15 TB/s).
    INLINE_SCALES: each key's and value's scale is read from its block's scale slot (the cache as fp32 at
    `k/v_scales_ptr`; this head's row at `scales_offset` into a block) and multiplies its scores and its p.
    VALUES_WITH_KEYS: a tile's values are asked for with its keys, not after the scores. For launches in one
    pipeline stage (a lone sequence's decode), where nothing else overlaps the two loads: Qwen3-0.6B batch 1
    0.854 -> 0.841-0.844 ms a step (H100, thirteenth session); pipelined launches already load them early. The
    values are asked for first and held out of their MMA layout until the second product (`_held`): Triton
    moves a loaded tile into shared memory right after its load, and the keys' move, waiting for the keys,
    came before the values' loads were issued (sm_90 PTX), so the two loads took a round trip each. The queries
    likewise, whose move sat between their load and the first page's: after the wait, a lone split now waits for
    its length, then its queries and pages, then its keys and values (three round trips, not five; with the length
    read before the PDL wait, two): Llama-3 batch 1 at context 4096 1.35 -> 1.37-1.38 TB/s, Qwen3-0.6B batch-1
    decoder layer 23.56 -> 23.12 us (H100, nineteenth session).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        page = tl.load(table_ptr + n // BLOCK_SIZE, mask=n < hi, other=0)
        offs = page.to(tl.int64)[:, None] * stride_kb + ((n % BLOCK_SIZE) * stride_ks + kv_head_offset)[:, None]
        if VALUES_WITH_KEYS:
            v = tl.load(v_cache_ptr + offs + offs_d[None, :])
        k = tl.load(k_cache_ptr + offs + offs_d[None, :]).to(q.dtype)
        if VALUES_WITH_KEYS and PTX_ASM and q.dtype.primitive_bitwidth == 16:  # q's move after these loads too
            qk = tl.dot(_held(q), tl.trans(k))
        else:
            qk = tl.dot(q, tl.trans(k))
        if INLINE_SCALES:
            scale_at = page.to(tl.int64) * (stride_kb // 4) + scales_offset + n % BLOCK_SIZE
            qk = qk * tl.load(k_scales_ptr + scale_at, mask=n < hi, other=0.0)[None, :]
        if start + BLOCK_N > mask_from:
            qk = tl.where(n[None, :] <= q_pos[:, None], qk, float("-inf"))
        # Scale inside the exponent (one FMA an element), and accumulate in place in the second
        # product, so no second [BLOCK_M, HEAD_DIM] fp32 tile is live.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        if not VALUES_WITH_KEYS:
            v = tl.load(v_cache_ptr + offs + offs_d[None, :])
        elif PTX_ASM and v.dtype.primitive_bitwidth == 16:  # (an FP8 tile's conversion below is as opaque)
            v = _held(v)
        if INLINE_SCALES:  # p times each value's amax (its scale x 448, undone at the end: scales can lie below fp16's
            # range), in q's dtype
            v_amax = tl.load(v_scales_ptr + scale_at, mask=n < hi, other=0.0) * FP8_MAX_C
            p_v = (p * v_amax[None, :]).to(q.dtype)
            v = (_fp8_to_f16(v) if PTX_ASM else v.to(tl.float16)).to(q.dtype)
        elif v.dtype == tl.float8e4nv and q.dtype != tl.float32:  # fp16 products: e4m3 fits, p in [0, 1] gains bits
            v = _fp8_to_f16(v) if PTX_ASM else v.to(tl.float16)
            p_v = p.to(tl.float16)
        else:
            v = v.to(q.dtype)
            p_v = p.to(q.dtype)
        acc = tl.dot(p_v, v, acc * alpha[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_context(
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    k_scales_ptr,
    v_scales_ptr,
    lo,
    full_end,
    hi,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    VALUES_WITH_KEYS: tl.constexpr,
):
    """Attention of KV head `kv_head` over keys [lo, hi): [lo, full_end) unmasked, [full_end, hi) masked by q_pos."""
    kv_head_offset = kv_head * stride_kh
    scales_offset = kv_head * BLOCK_SIZE + BLOCK_SIZE * (stride_ks // 4)  # inline scales: this head's, in a block
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    return _attend(
        acc,
        l_i,
        m_i,
        q,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        kv_head_offset,
        k_scales_ptr,
        v_scales_ptr,
        scales_offset,
        lo,
        full_end,
        hi,
        q_pos,
        qk_scale,
        stride_kb,
        stride_ks,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM,
        INLINE_SCALES,
        VALUES_WITH_KEYS,
    )


@triton.jit
def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    first_part,
    token,
    kv_head,
    num_splits,
    active,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """out[token] = the `active` split partials of one sequence's query heads, weighted by their sum-exp.

    Partials are laid out `num_splits` a head. Every head's partials of SPLITS splits are loaded at once, bypassing
    L1 (other multiprocessors wrote them during this launch), and merged online SPLITS at a time: a context of up
    to SPLITS splits takes one round trip. A load a head took GROUP round trips in a row, each behind the store of
    the head before it (sm_90 PTX; H100, one sequence of Llama-3's heads: context 4096 1.08 -> 1.35 TB/s, 432 9.1 ->
    5.4 us). SPLITS sizes that load (`AttentionConfig.merge_elements`), and with it the registers the merge holds,
    which are the whole kernel's: launches that split no context are compiled with 1, and never reach the merge.
    """
    g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for first in range(0, active, SPLITS):
        splits = first + tl.arange(0, SPLITS)
        used = (g < GROUP)[:, None] & (splits < active)[None, :]
        part = first_part + g[:, None] * num_splits + splits[None, :]
        # empty lanes weigh nothing against a real split (EMPTY_LSE is finite: no inf - inf)
        lse = tl.load(part_lse_ptr + part, mask=used, other=EMPTY_LSE, cache_modifier=".cg")
        o = tl.load(
            part_out_ptr + part.to(tl.int64)[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=used[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_i, tl.max(lse, axis=1))
        w = tl.math.exp2(lse - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        m_i = m_new
    head = kv_head * GROUP + g
    ptrs = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


@triton.jit
def _decode_program(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    table_ptr,
    part_out_ptr,
    part_lse_ptr,
    ticket_ptr,
    k_scales_ptr,
    v_scales_ptr,
    seq,
    split,
    kv_head,
    num_kv_heads,
    q_start,
    seq_len,
    num_splits,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    VALUES_WITH_KEYS: tl.constexpr,
):
    """One split of one decode token's attention (see `_split_range`); the last split to finish merges them all."""
    active, lo, hi = _split_range(seq_len, split, num_splits, BLOCK_N, SPLIT_KEYS)
    if split < active:
        full_end = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)
        g = tl.arange(0, ROWS)
        head = kv_head * GROUP + g
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )
        q_pos = tl.full([ROWS], 0, tl.int32) + hi - 1
        acc, l_i, m_i = _attend_context(
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            k_scales_ptr,
            v_scales_ptr,
            lo,
            full_end,
            hi,
            qk_scale,
            stride_kb,
            stride_ks,
            stride_kh,
            ROWS,
            BLOCK_N,
            BLOCK_SIZE,
            HEAD_DIM,
            INLINE_SCALES,
            VALUES_WITH_KEYS,
        )
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None] * v_scale
        if SPLITS == 1 or active == 1:  # (a launch compiled with SPLITS 1 never splits: no merge code in it)
            ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
        else:
            lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), EMPTY_LSE)
            first_part = (seq * num_kv_heads + kv_head) * GROUP * num_splits
            part = first_part + g * num_splits + split
            tl.store(part_lse_ptr + part, lse, mask=g < GROUP)
            tl.store(
                part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], out, mask=(g < GROUP)[:, None]
            )
            if last_to_arrive(ticket_ptr, active):  # every split has arrived
                _merge_splits(
                    part_out_ptr,
                    part_lse_ptr,
                    out_ptr,
                    first_part,
                    q_start,
                    kv_head,
                    num_splits,
                    active,
                    stride_ot,
                    stride_oh,
                    GROUP,
                    GROUP_P,
                    HEAD_DIM,
                    SPLITS,
                )


@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """(the splits a sequence uses, and `split`'s keys [lo, hi)): whole BLOCK_N tiles, spread as evenly as they go.

    A sequence uses only as many of the launched splits as it has SPLIT_KEYS keys (a multiple of BLOCK_N): a
    short context is not spread over dozens of nearly empty programs and a merge of all of them.
    """
    active = tl.minimum(num_splits, tl.cdiv(seq_len, SPLIT_KEYS))
    chunk = tl.cdiv(tl.cdiv(seq_len, tl.maximum(active, 1)), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return active, lo, tl.minimum(lo + chunk, seq_len)


@triton.jit
def _prefetch_decode_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    seq_len_ptr,
    split,
    num_splits,
    kv_offset,
    stride_kb,
    stride_ks,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
):
    """The sequence's length, read past L1 before the PDL wait (a step input: no kernel of the step writes it), for
    the program to use after the wait; and its split's first key and value tile asked of L2, from pages read the
    same way.

    While the kernel before (which writes q and the newest key) may still run: the lines are only a hint, and the
    split's program reads them again, in order, after the wait. Also returns whether the split has keys.
    """
    seq_len = tl.load(seq_len_ptr, cache_modifier=".cg")
    active, lo, _ = _split_range(seq_len, split, num_splits, BLOCK_N, SPLIT_KEYS)
    if split < active:
        n = tl.minimum(lo + tl.arange(0, BLOCK_N), seq_len - 1)  # past the end: the last key again, no stray lines
        page = tl.load(table_ptr + n // BLOCK_SIZE, cache_modifier=".cg")
        LINE: tl.constexpr = 128 // k_cache_ptr.dtype.element_ty.primitive_bitwidth * 8  # elements a 128-byte line
        LINES: tl.constexpr = max(1, HEAD_DIM // LINE)
        rows = page.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_offset
        offs = rows[:, None] + (tl.arange(0, LINES) * LINE)[None, :]
        prefetch_to_l2(k_cache_ptr + offs)
        prefetch_to_l2(v_cache_ptr + offs)
    return seq_len, split < active


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
    """The last sequence whose first tile is <= `tile` (num_seqs for tiles past every sequence).

    First tiles never decrease along the batch, so that is the count of sequences starting at or
    before `tile`, less one: a few wide loads instead of a chain of dependent ones.
    """
    count = tl.zeros([], tl.int32)
    for start in range(0, num_seqs + 1, SEARCH):
        seqs = start + tl.arange(0, SEARCH)
        starts = tl.load(query_start_loc_ptr + seqs, mask=seqs <= num_seqs, other=0)
        count += tl.sum(((starts // BLOCK_Q + seqs <= tile) & (seqs <= num_seqs)).to(tl.int32), axis=0)
    return count - 1


@triton.jit
def _tile_program(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scales_ptr,
    v_scales_ptr,
    tile,
    kv_head,
    num_seqs,
    num_tokens,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
):
    """Causal attention of one query tile of a prefill chunk, or zeros for a tile of padding tokens."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q, 512)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + rows % GROUP_P
    head_ok = rows % GROUP_P < GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    local = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, within its sequence
    token = q_start + local + rows // GROUP_P
    out_offs = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if seq == num_seqs:  # padding tokens past the last sequence read as zeros
        mask = (head_ok & (token < num_tokens))[:, None]
        tl.store(out_ptr + out_offs, tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty), mask=mask)
    else:
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if (local < q_len) & (q_len > 1):  # one-token sequences are the decode programs' work
            seq_len = tl.load(seq_lens_ptr + seq)
            context = seq_len - q_len  # keys cached before this chunk
            row_ok = head_ok & (local + rows // GROUP_P < q_len)
            q_pos = context + local + rows // GROUP_P
            q_offs = token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
            hi = context + tl.minimum(local + BLOCK_Q, q_len)
            full_end = (context + local + 1) // BLOCK_N * BLOCK_N  # every row sees every key before this
            acc, l_i, m_i = _attend_context(
                q,
                q_pos,
                k_cache_ptr,
                v_cache_ptr,
                block_tables_ptr + seq.to(tl.int64) * stride_bt,
                kv_head,
                k_scales_ptr,
                v_scales_ptr,
                0,
                full_end,
                hi,
                qk_scale,
                stride_kb,
                stride_ks,
                stride_kh,
                BLOCK_M,
                BLOCK_N,
                BLOCK_SIZE,
                HEAD_DIM,
                INLINE_SCALES,
                False,
            )
            out = acc / l_i[:, None] * v_scale
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bt"])
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_seqs,
    num_tokens,
    num_splits,
    num_kv_heads,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_ROWS: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr,
    DECODE_SPLIT_KEYS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    KV_SCALES: tl.constexpr,
    INLINE_SCALES: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    DECODE_VALUES_WITH_KEYS: tl.constexpr,
    USE_PDL: tl.constexpr,
    TILES: tl.constexpr = False,
    LONE: tl.constexpr = False,
):
    """One launch of `run_paged_attention`: its decode programs (one a sequence, split and KV head: the sequences of
    one query token), or with TILES its prefill tile programs (the rest)."""
    kv_head = tl.program_id(0) % num_kv_heads  # the fastest-varying index
    pid = tl.program_id(0) // num_kv_heads
    # A lone sequence's pid is its split: a short context fills only the first few, here taken alternately from the
    # grid's first and second half. Measured, the placement's why not pinned down (the block scheduler spreads
    # consecutive ids over multiprocessor pairs of different GPCs): Qwen3-0.6B batch 1 at context 400 0.754 -> 0.747
    # ms a step (H100); splits fastest across the ids instead lost (0.762-0.769).
    if LONE:
        pid = (pid % 2) * ((num_splits + 1) // 2) + pid // 2
    seq_len_before_wait = 0
    has_keys = True
    if USE_PDL and DECODE_ONLY:  # decode programs only
        seq = pid % num_seqs
        seq_len_before_wait, has_keys = _prefetch_decode_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            seq_lens_ptr + seq,
            pid // num_seqs,
            num_splits,
            kv_head * stride_kh,
            stride_kb,
            stride_ks,
            HEAD_DIM,
            DECODE_BLOCK_N,
            BLOCK_SIZE,
            DECODE_SPLIT_KEYS,
        )
    # A split without keys does nothing: it ends here, not after the kernel before, and leaves its place to those
    # with keys (Qwen3-0.6B batch 1 at context 400, 4 of 64 splits with keys: 0.758-0.765 -> 0.747-0.749 ms a step).
    if has_keys:
        wait_for_previous_kernel(USE_PDL)
    if KV_SCALES:  # an FP8 cache holds k / k_scale and v / v_scale: scale the scores and the output back
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    elif INLINE_SCALES:  # p was multiplied by each value's scale x 448 (see `_attend`)
        v_scale = 1.0 / FP8_MAX_C
    else:
        v_scale = 1.0
    if not TILES:
        seq = pid % num_seqs
        if DECODE_ONLY:  # one query token a sequence: sequence i's token is token i
            q_start = seq
            q_end = seq + 1
        else:
            q_start = tl.load(query_start_loc_ptr + seq)
            q_end = tl.load(query_start_loc_ptr + seq + 1)
        if USE_PDL and DECODE_ONLY:  # one round trip less after the wait
            seq_len = seq_len_before_wait
        else:
            seq_len = tl.load(seq_lens_ptr + seq)  # loaded with the others: one round trip, not two
        if q_end - q_start == 1:
            _decode_program(
                q_ptr,
                k_cache_ptr,
                v_cache_ptr,
                out_ptr,
                block_tables_ptr + seq.to(tl.int64) * stride_bt,
                part_out_ptr,
                part_lse_ptr,
                tickets_ptr + seq * num_kv_heads + kv_head,
                k_scale_ptr,
                v_scale_ptr,
                seq,
                pid // num_seqs,
                kv_head,
                num_kv_heads,
                q_start,
                seq_len,
                num_splits,
                qk_scale,
                v_scale,
                stride_qt,
                stride_qh,
                stride_ot,
                stride_oh,
                stride_kb,
                stride_ks,
                stride_kh,
                GROUP,
                GROUP_P,
                DECODE_ROWS,
                HEAD_DIM,
                DECODE_BLOCK_N,
                BLOCK_SIZE,
                SPLITS,
                DECODE_SPLIT_KEYS,
                INLINE_SCALES,
                DECODE_VALUES_WITH_KEYS,
            )
    else:
        # Last tiles first: in causal prefill a sequence's later tiles carry the most work.
        _tile_program(
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            out_ptr,
            block_tables_ptr,
            seq_lens_ptr,
            query_start_loc_ptr,
            k_scale_ptr,
            v_scale_ptr,
            tl.num_programs(0) // num_kv_heads - 1 - pid,
            kv_head,
            num_seqs,
            num_tokens,
            qk_scale,
            v_scale,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_bt,
            GROUP,
            GROUP_P,
            HEAD_DIM,
            BLOCK_Q,
            BLOCK_N,
            BLOCK_SIZE,
            INLINE_SCALES,
        )


def decode_splits(
    num_seqs: int, num_kv_heads: int, config: AttentionConfig, device: torch.device, max_keys: int | None = None
) -> int:
    """Splits a sequence's decode programs: `decode_waves` programs a multiprocessor over the batch's heads.

    A lone sequence splits by the tile, so it takes no more splits than `max_keys` (what its block table can hold)
    has tiles (more would hold no keys), and at least 2 (one is the unsplit variant, another kernel). The runner's
    short batch-1 graph (`atom_runtime.cuda_graphs`) passes a narrow table, so a short context's launch has no idle
    programs past its table's tiles: with 8 KV heads on an H100, 16 splits, one program a multiprocessor, where the
    full table's 33 put two on some. The sweep's grid of one program a multiprocessor (17 splits) read 1024 and 2048
    keys in 5.8 and 7.3 us against 6.2 and 8.2, where 4096 keys want the full table's two (11.1 against 14.2; H100,
    `bench_kernels.py --only decode --sweep`, twenty-first session); Qwen3-0.6B batch 1 at context 1536, 0.806 ->
    0.786 ms a step. (A served max_model_len under 33 tiles trims the full graph's launch the same way: unmeasured.)
    """
    waves = config.lone_decode_waves if num_seqs == 1 else config.decode_waves
    splits = min(MAX_SPLITS, cdiv(waves * multiprocessors(device), num_seqs * num_kv_heads))
    if num_seqs == 1 and max_keys is not None:
        splits = min(splits, max(2, cdiv(max_keys, config.decode_block_n)))
    return splits


def _decode_variant(
    num_seqs: int, num_splits: int, group_p: int, head_dim: int, config: AttentionConfig
) -> tuple[int, int, int]:
    """(keys a decode tile, keys a context takes a split for, partials the merge loads at once) of a launch. One
    that splits no context is the unsplit variant: its own tiles, a merge of one. Otherwise a lone sequence splits
    by the tile (its splits are its only parallelism), a batch every `split_keys` keys in whole tiles (their merges
    cost more than the parallelism gains), and the merge loads as many splits of every head as `merge_elements`
    holds (a power of two, at least 2: a merge of 1 is the unsplit variant's)."""
    if num_splits == 1:
        return config.unsplit_block_n, config.unsplit_block_n, 1
    block_n = config.decode_block_n
    split_keys = block_n if num_seqs == 1 else max(block_n, config.split_keys // block_n * block_n)
    fit = max(2, config.merge_elements // (group_p * head_dim))
    return block_n, split_keys, min(MAX_SPLITS, 1 << (fit.bit_length() - 1))


def unsplit_decode_batch(num_kv_heads: int, head_dim: int, device: torch.device) -> int:
    """The fewest sequences (at least 2) whose decode launch splits no context: the kernel's unsplit variant (its
    own tile size, no merge), which the export's warm-up compiles too."""
    config = default_config(head_dim)
    return next(n for n in itertools.count(2) if decode_splits(n, num_kv_heads, config, device) == 1)


def prefill_tiles(
    num_tokens: int, num_seqs: int, num_kv_heads: int, group_p: int, config: AttentionConfig, device: torch.device
) -> tuple[int, int]:
    """(query tokens a tile, warps) of a step's prefill tiles: `block_m` rows where the step's prefill tokens make at
    least a wave of such tiles, `small_block_m` rows otherwise. From shapes alone: a step's prefill tokens are at least
    `num_tokens - num_seqs + 1` (a decode has one token, a prefill chunk of a step with tiles at least one more).
    H100, Llama-3-8B, 167 decodes beside a 345-token chunk: 256-row tiles made 48 programs for 132 multiprocessors,
    0.339 ms a layer against 0.316 with 64-row tiles at 4 warps, 0.295 launched beside the decodes (which take 0.280
    alone); a 1024-token prompt alone 47.5 -> 36.3 us; a 2048-token chunk keeps the large tiles (0.748 against 0.773
    ms; `bench_kernels.py --only decode`, twenty-sixth and twenty-seventh sessions)."""
    block_q = max(1, config.block_m // group_p)
    if num_kv_heads * cdiv(num_tokens - num_seqs + 1, block_q) >= multiprocessors(device):
        return block_q, config.num_warps
    return max(1, config.small_block_m // group_p), config.small_warps


def large_tile_tokens(num_kv_heads: int, num_q_heads: int, head_dim: int, device: torch.device) -> int:
    """The fewest prefill tokens of a one-sequence step with the large tiles (the export's warm-up compiles both)."""
    config = default_config(head_dim)
    block_q = max(1, config.block_m // next_power_of_2(num_q_heads // num_kv_heads))
    return block_q * cdiv(multiprocessors(device), num_kv_heads)


class _TilesStream(NamedTuple):
    """A device's stream for prefill tiles, and the events that fork it from the step's stream and join it back
    (reused: a wait takes an event's latest record, and each is waited on right after it is recorded)."""

    stream: torch.cuda.Stream
    fork: torch.cuda.Event
    join: torch.cuda.Event


@functools.cache
def _tiles_stream(device: torch.device) -> _TilesStream:
    return _TilesStream(torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event())


def run_paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    config: AttentionConfig,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """`paged_attention` with explicit tile sizes (the benchmark sweeps them)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = cache_block_size(kv_cache), kv_cache.shape[3]
    if head_dim < 16 or head_dim & (head_dim - 1) or kv_cache.shape[4] != head_dim:
        raise ValueError(f"triton paged attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if kv_cache.stride(4) != 1 or q.stride(2) != 1:
        raise ValueError("triton paged attention needs q and the KV cache contiguous along head_dim")
    group = num_q_heads // num_kv_heads
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    inline = inline_scales(kv_cache)
    if inline:
        (k_cache, k_scale), (v_cache, v_scale) = inline_scale_operands(k_cache), inline_scale_operands(v_cache)
    group_p = next_power_of_2(group)
    num_splits = decode_splits(num_seqs, num_kv_heads, config, q.device, block_tables.shape[1] * block_size)
    decode_block_n, split_keys, merge_splits = _decode_variant(num_seqs, num_splits, group_p, head_dim, config)
    part_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    tickets = ticket_counters(q.device, num_seqs * num_kv_heads)
    kv_scales = kv_cache.dtype == FP8_DTYPE and k_scale is not None
    # Only decode tokens (one a sequence; empty sequences, a FULL graph's padding of a mixed step, come with more
    # tokens than sequences): no tile launch, and the decode programs index the query by sequence. Otherwise prefill
    # tiles get a launch of their own: in one launch the tile program's 8 warps and 255 registers held the decode
    # programs to one a multiprocessor (4 warps, 163 registers alone). H100, Llama-3-8B, a step of 167 decodes and a
    # 345-token chunk: 409 -> 385 us a layer.
    decode_only = num_tokens == num_seqs
    num_stages = config.lone_decode_stages if decode_only and num_seqs == 1 else config.num_stages
    args = (
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        tickets,
        k_scale if kv_scales or inline else tickets,
        v_scale if kv_scales or inline else tickets,
        num_seqs,
        num_tokens,
        num_splits,
        num_kv_heads,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    # Each launch is given only the constexprs its programs read (the others fixed), so that a tile launch compiles
    # once for all decode variants and a decode launch once for all tile sizes.
    constexprs = dict(
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        KV_SCALES=kv_scales,
        INLINE_SCALES=inline,
        **pdl_launch(q.device),
    )
    decode = dict(
        BLOCK_Q=1,
        DECODE_ROWS=max(16, group_p),
        DECODE_BLOCK_N=decode_block_n,
        DECODE_SPLIT_KEYS=split_keys,
        SPLITS=merge_splits,
        DECODE_VALUES_WITH_KEYS=num_stages == 1,
        DECODE_ONLY=decode_only,
        LONE=decode_only and num_seqs == 1,
    )
    if decode_only:
        _attention_kernel[(num_kv_heads * num_seqs * num_splits,)](
            *args, **constexprs, **decode, num_warps=config.decode_warps, num_stages=num_stages
        )
        return out
    block_q, tile_warps = prefill_tiles(num_tokens, num_seqs, num_kv_heads, group_p, config, q.device)
    tiles = dict(
        BLOCK_Q=block_q,
        DECODE_ROWS=16,
        DECODE_BLOCK_N=16,
        DECODE_SPLIT_KEYS=16,
        SPLITS=1,
        DECODE_VALUES_WITH_KEYS=False,
        DECODE_ONLY=False,
        TILES=True,
    )
    tile_grid = (num_kv_heads * (cdiv(num_tokens, block_q) + num_seqs),)
    launch_tiles = functools.partial(
        _attention_kernel[tile_grid], *args, **constexprs, **tiles, num_warps=tile_warps, num_stages=config.num_stages
    )
    beside = _tiles_stream(q.device) if config.tiles_beside_decodes and q.is_cuda else None
    if beside is not None:  # tiles launched first: their programs take multiprocessors before the decode programs do
        main = torch.cuda.current_stream()  # (Triton launches on the current device's: q's, as everywhere)
        beside.fork.record(main)
        beside.stream.wait_event(beside.fork)
        torch.cuda.set_stream(beside.stream)  # (a stream context costs more host time, in a host-bound step)
        try:
            launch_tiles()
        finally:
            torch.cuda.set_stream(main)
        beside.join.record(beside.stream)
    _attention_kernel[(num_kv_heads * num_seqs * num_splits,)](
        *args, **constexprs, **decode, num_warps=config.decode_warps, num_stages=num_stages
    )
    if beside is not None:
        main.wait_event(beside.join)
    else:
        launch_tiles()
    return out


@register_impl("paged_attention", "triton")
def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    config = default_config(q.shape[-1])
    return run_paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, config, k_scale, v_scale)
