"""`sample_rows` as one launch: each row is split into BLOCK-wide slices, each slice's program finds its largest
score (the logits, or for a drawn row logits / T - log(E) with Philox noise; the first of equal ones, NaN first
of all), and the slice that arrives last picks among the partials.

H100, 151,936-wide fp32 rows, CUDA-graph replays (2026-11-26). The argmax kernel this grew from: 1 row 4.3 us against
torch's 10.7, 8 rows 6.7 against 13.1, 64 rows 20.5 against 31.8, 256 rows 58.6 against 73.3 (2.7 TB/s); slices of
2048 with 4 warps led at 1-8 rows, 4096 and 8192 wide, or 8 warps, were within 2 us everywhere else. With the
noise, four argmax reductions a slice (`bench_kernels.py --only sample`): greedy 9.3 us at 1 row, 124 at 256; drawn
12.9 and 224 against torch's five passes' 67.8 and 661. Today's single reduction a slice (b0ea425): greedy 7.4 and
71.2, drawn 10.9 and 157 against 68.4 and 662; in the engine a drawn step costs what a greedy one does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.backend import register_impl
from atom_models.ops.sampling import (
    NOISE_QUARTER,
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
)
from atom_models.ops.triton_kernels.common import cdiv, last_to_arrive, next_power_of_2, ticket_counters

BLOCK = 4 * NOISE_QUARTER  # a slice: one noise block
# As constexpr globals, so the kernel sees the reference's constants.
KEY_A, KEY_B = tl.constexpr(PHILOX_KEY_A), tl.constexpr(PHILOX_KEY_B)
ROUND_A, ROUND_B = tl.constexpr(PHILOX_ROUND_A), tl.constexpr(PHILOX_ROUND_B)


@triton.jit
def _pick(value_a, index_a, value_b, index_b):
    """The larger of two (value, index) pairs as torch.argmax ranks them: a NaN above anything, the smaller index
    among equal values (or NaNs)."""
    nan_a, nan_b = value_a != value_a, value_b != value_b
    earlier = index_b < index_a
    take_b = tl.where(nan_a | nan_b, nan_b & (~nan_a | earlier), (value_b > value_a) | ((value_b == value_a) & earlier))
    return tl.where(take_b, value_b, value_a), tl.where(take_b, index_b, index_a)


@triton.jit
def _largest(values, indices):
    """(value, index) of the largest of `values` (see `_pick`), in one reduction."""
    return tl.reduce((values, indices), 0, _pick)


@triton.jit
def _philox(counter, position, seed):
    """Philox4x32-10 of counters (counter, position, 0, 0) under the 64-bit key `seed`: four uint32 words, as
    `atom_models.ops.sampling.philox_bits` computes them (spelled out rather than `tl.randint4x`, whose counter
    layout is Triton's to change)."""
    c0 = counter.to(tl.uint32)
    c1 = tl.zeros_like(c0) + position.to(tl.uint32)  # a non-negative int32
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    round_a = tl.full([], ROUND_A, tl.uint32)
    round_b = tl.full([], ROUND_B, tl.uint32)
    for _ in tl.static_range(10):
        a0, b2 = c0, c2
        c0 = tl.math.umulhi(round_b, b2) ^ c1 ^ k0
        c2 = tl.math.umulhi(round_a, a0) ^ c3 ^ k1
        c1 = b2 * round_b
        c3 = a0 * round_a
        k0 = k0 + tl.full([], KEY_A, tl.uint32)
        k1 = k1 + tl.full([], KEY_B, tl.uint32)
    return c0, c1, c2, c3


@triton.jit
def _score(x, bits, temperature):
    """logits / T - log(E) of a drawn row, E = -log(u) ~ Exp(1) from a uniform u in (0, 1) of the bits' top 23."""
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1): see `sample_rows_reference`
    return tl.math.div_rn(x, temperature) - tl.log(-tl.log(uniform))


@triton.jit
def _sample_kernel(
    x_ptr,
    temperature_ptr,
    seed_ptr,
    position_ptr,
    part_value_ptr,
    part_index_ptr,
    out_ptr,
    ticket_ptr,
    token_position_ptr,
    slot_ptr,
    seq_len_ptr,
    n_cols,
    stride_row,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    QUARTER: tl.constexpr,
    ADVANCE: tl.constexpr,
):
    """Slice `split` of a row is a noise block (see `atom_models.ops.sampling.philox_bits`): four quarters, each the
    words of one Philox output of the block's QUARTER counters, so the noise takes a quarter of the Philox rounds
    and registers it would a word at a time.

    ADVANCE: the program that writes the row's token then moves its step inputs one token on (`sample_rows`); it
    writes the draw position once every slice has read it (after the ticket). Every program reads them up front,
    so the writes add no round trip to the launch's tail."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if ADVANCE:
        token_position = tl.load(token_position_ptr + row)
        slot = tl.load(slot_ptr + row)
        seq_len = tl.load(seq_len_ptr + row)
        draw_position = tl.load(position_ptr + row)
    offs = tl.arange(0, QUARTER)
    cols = split * 4 * QUARTER + offs
    x_row = x_ptr + row.to(tl.int64) * stride_row
    x0 = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    x1 = tl.load(x_row + cols + QUARTER, mask=cols + QUARTER < n_cols, other=float("-inf")).to(tl.float32)
    x2 = tl.load(x_row + cols + 2 * QUARTER, mask=cols + 2 * QUARTER < n_cols, other=float("-inf")).to(tl.float32)
    x3 = tl.load(x_row + cols + 3 * QUARTER, mask=cols + 3 * QUARTER < n_cols, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:  # a draw: the exponential race (see `atom_models.ops.sampling`)
        position = tl.load(position_ptr + row)
        bits0, bits1, bits2, bits3 = _philox(split * QUARTER + offs, position, tl.load(seed_ptr + row))
        x0 = _score(x0, bits0, temperature)
        x1 = _score(x1, bits1, temperature)
        x2 = _score(x2, bits2, temperature)
        x3 = _score(x3, bits3, temperature)
    # the quarters entry by entry, then one reduction over the slice
    value, index = _pick(x0, cols, x1, cols + QUARTER)
    value, index = _pick(value, index, x2, cols + 2 * QUARTER)
    value, index = _largest(*_pick(value, index, x3, cols + 3 * QUARTER))
    last = True  # of one slice a row, the program writes its token
    if SPLITS > 1:
        tl.store(part_value_ptr + row * SPLITS + split, value)
        tl.store(part_index_ptr + row * SPLITS + split, index)
        last = last_to_arrive(ticket_ptr + row, SPLITS)
        if last:  # slices in order, so the first of equal ones wins
            s = tl.arange(0, SPLITS_P)
            values = tl.load(
                part_value_ptr + row * SPLITS + s, mask=s < SPLITS, other=float("-inf"), cache_modifier=".cg"
            )
            indices = tl.load(part_index_ptr + row * SPLITS + s, mask=s < SPLITS, other=0, cache_modifier=".cg")
            _, index = _largest(values, indices)
    if last:
        tl.store(out_ptr + row, index.to(tl.int64))
        if ADVANCE:  # one token on, unless the slot is -1 (padding)
            step = (slot >= 0).to(slot.dtype)
            tl.store(token_position_ptr + row, token_position + step)
            tl.store(slot_ptr + row, slot + step)
            tl.store(seq_len_ptr + row, seq_len + step.to(seq_len.dtype))
            tl.store(position_ptr + row, draw_position + step.to(draw_position.dtype))


@register_impl("sample_rows", "triton")
def sample_rows(
    logits: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    out: Tensor | None = None,
    advance: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sample_rows takes rows contiguous along the last dimension, got shape {tuple(logits.shape)}")
    rows, n_cols = logits.shape
    if not temperature.shape == seeds.shape == positions.shape == (rows,):
        raise ValueError(f"sample_rows takes a temperature, seed and position for each of the {rows} rows")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.stride(0) != 1:
        raise ValueError(f"sample_rows writes {rows} contiguous int64 tokens, got out of shape {tuple(out.shape)}")
    if advance is not None and any(t.shape != (rows,) or t.stride(0) != 1 for t in advance):
        raise ValueError(f"sample_rows advances a contiguous token position, slot and sequence length a row ({rows})")
    if rows == 0:
        return out
    if n_cols == 0:
        raise ValueError("sample_rows of empty rows")
    splits = cdiv(n_cols, BLOCK)
    part_value = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    part_index = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows, splits)](
        logits,
        temperature,
        seeds,
        positions,
        part_value,
        part_index,
        out,
        ticket_counters(logits.device, rows),
        *(advance or (positions,) * 3),
        n_cols,
        logits.stride(0),
        SPLITS=splits,
        SPLITS_P=next_power_of_2(splits),
        QUARTER=NOISE_QUARTER,
        ADVANCE=advance is not None,
        num_warps=4,
    )
    return out


CARRY_BLOCK = 128  # entries a program: one compiled variant whatever the batch


@triton.jit(do_not_specialize=["n"])
def _carry_kernel(ids_ptr, to_ptr, from_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    to = tl.load(to_ptr + offs, mask=offs < n, other=-1)
    carried = to >= 0
    source = tl.load(from_ptr + offs, mask=carried, other=0)
    tl.store(ids_ptr + to, tl.load(sampled_ptr + source, mask=carried), mask=carried)


@register_impl("carry_tokens", "triton")
def carry_tokens(input_ids: Tensor, carry_to: Tensor, carry_from: Tensor, sampled: Tensor) -> None:
    n = carry_to.shape[0]
    if carry_from.shape != (n,) or input_ids.dtype != sampled.dtype:
        raise ValueError("carry_tokens takes a source row for each target and tokens of the input ids' dtype")
    if n:
        _carry_kernel[(cdiv(n, CARRY_BLOCK),)](input_ids, carry_to, carry_from, sampled, n, BLOCK=CARRY_BLOCK)
