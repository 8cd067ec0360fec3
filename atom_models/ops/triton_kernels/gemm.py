"""Matmuls on CUDA: FP8 `scaled_mm` (cuBLASLt) and `scaled_mm_blockwise` (Triton), and `linear`'s decode GEMM.

`scaled_mm` (per-tensor or per-row scales on both sides) calls `torch._scaled_mm`: one scale
on each side is cuBLASLt's tensor-wise mode, anything per row its row-wise mode (activation
scales [M, 1], weight scales [1, N]; bf16 output). Shapes cuBLASLt rejects (K or N not a
multiple of 16) take the Triton kernel, which covers those scales too.

`scaled_mm_blockwise` has one weight scale per (bn, bk) block; cuBLASLt rejects block scales
(torch 2.11 on H100), so it runs the Triton kernel below. The kernel streams [BLOCK_K] slices of
x and w through fp8 `tl.dot` (native on Hopper) with fp32 accumulation; a weight scale that
changes along K (block scales) multiplies each slice's partial product, one that does not
(per tensor, per channel) multiplies once at the end; so does a per-token activation scale, while
one per token and block of columns (DeepSeek-V3's 1x128) multiplies each slice with the weight's.

Decode (M up to SKINNY_MAX_M) is bandwidth-bound and takes `_skinny_mm_kernel` instead, from both
dispatch functions: at M = 1 on Llama-3-8B's projections cuBLASLt reached 42-75% of the weight-read
roofline and the tile kernel above 47-85%, the skinny kernel 67-92% (H100, CUDA-graph replays; the
rest is mostly a fixed ~2.5 us a launch). `benchmarks/bench_fp8.py --sweep` measures the alternatives.

The same skinny kernel, without scales, serves `linear` (bf16/fp16 weights) for decode-sized M, where
cuBLAS picks tiles that leave most multiprocessors idle (4096 x 4096 at M = 1: 64 programs on 132
multiprocessors, 20.6 us against an 11.2 us roofline); `benchmarks/bench_gemm.py` measures it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from atom_models.ops.attention import QKVRopeCache, inline_scales
from atom_models.ops.backend import register_impl
from atom_models.ops.mlp import Projections
from atom_models.ops.quant import FP8_DTYPE, one_token
from atom_models.ops.triton_kernels.activation import silu_and_mul, silu_and_mul_quant_fp8
from atom_models.ops.triton_kernels.common import (
    as_rows,
    cdiv,
    last_to_arrive,
    launch_next_kernel,
    multiprocessors,
    next_power_of_2,
    pdl_launch,
    silu,
    ticket_counters,
    wait_for_previous_kernel,
)
from atom_models.ops.triton_kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_quant_fp8,
    rms_norm,
    rms_norm_quant_fp8,
)
from atom_models.ops.triton_kernels.quant import quant_fp8_per_token
from atom_models.ops.triton_kernels.rotary_cache import rope_and_cache, rotate_halves, to_fp8_range


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch parameters of `_scaled_mm_kernel` (block_k must divide the scale block's k)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_config(m: int, n: int, k: int, scale_k: int, device: torch.device) -> GemmConfig:
    """Small M: short tiles and the widest N tile that still fills the GPU; large M: 128x128 tiles.

    K tiles of 128, or the largest power of two dividing a smaller K scale block.
    """
    block_k = 128 if scale_k >= k else min(128, scale_k & -scale_k)
    if m > 64:
        return GemmConfig(128, 128, block_k, 8, 8, 3)
    block_m = max(16, next_power_of_2(m))
    programs_wanted = multiprocessors(device)
    block_n = next((b for b in (128, 64) if cdiv(n, b) >= programs_wanted), 32)
    return GemmConfig(block_m, block_n, block_k, 8, 4, 4)


@triton.jit(do_not_specialize=["M"])  # the token count: one compiled variant per tile config, not per step
def _scaled_mm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_ALONG_K: tl.constexpr,
    X_GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """out[m, n] = sum_k xs[m(, k // SCALE_K)] x[m, k] w[n, k] ws[n // SCALE_N, k // SCALE_K] (+ bias[n]).

    X_GROUPED: x has a scale per SCALE_K columns too (block weights only), applied with the weight's.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each weight tile while it is in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    ws_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_wsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE_ALONG_K:
            part = tl.dot(x, w) * tl.load(ws_ptrs + (k0 // SCALE_K) * stride_wsk, mask=n_ok, other=0.0)[None, :]
            if X_GROUPED:
                part *= tl.load(xs_ptr + offs_m * stride_xsm + k0 // SCALE_K, mask=m_ok, other=0.0)[:, None]
            acc += part
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not SCALE_ALONG_K:
        acc *= tl.load(ws_ptrs, mask=n_ok, other=0.0)[None, :]
    if not X_GROUPED:
        acc *= tl.load(xs_ptr + offs_m * stride_xsm, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _weights(w_q: Tensor, w_scale: Tensor | None, k: int, scale_k: int, block_k: int) -> tuple[Tensor, Tensor | None]:
    """w with unit K stride and its scales as 2-D; checks that a K tile lies in one scale block."""
    if w_q.stride(1) != 1:
        w_q = w_q.contiguous()
    if scale_k < k and scale_k % block_k:
        raise ValueError(f"block_k {block_k} must divide the weight scale block's {scale_k} columns")
    if w_scale is None:
        return w_q, None
    return w_q, w_scale.reshape(-1, 1) if w_scale.dim() < 2 else w_scale


def _activation_scales(x_scale: Tensor) -> Tensor:
    """x_scale as [rows, groups] with unit stride along the groups, as the kernels index it.

    x_scale: [] or [1] (per tensor), [..., 1] (per token) or, with block scales, [..., cdiv(K, scale_k)]
    (per token and group of scale_k columns; a column-major one is copied).
    """
    xs = x_scale.reshape(-1, x_scale.shape[-1] if x_scale.dim() else 1)
    return xs if xs.shape[1] == 1 or xs.stride(1) == 1 else xs.contiguous()


def _scale_arguments(x, xs, w_q, ws, bias, out, scale_block: tuple[int, int], config) -> tuple[tuple, dict]:
    """The strides and scale/bias constants both GEMM kernels take (a stride of 0 broadcasts one scale).

    xs: the activation scales from `_activation_scales`.
    """
    scale_n, scale_k = scale_block
    k = w_q.shape[1]
    along_k = scale_k < k
    grouped = xs.shape[1] > 1
    if grouped and (not along_k or xs.shape[1] != cdiv(k, scale_k)):
        raise ValueError(
            f"activation scales of {xs.shape[1]} groups fit neither one a token nor the weight's "
            f"{cdiv(k, scale_k)} blocks of {scale_k} columns"
        )
    strides = (
        x.stride(0),
        xs.stride(0) if xs.shape[0] > 1 else 0,
        w_q.stride(0),
        ws.stride(0) if ws.shape[0] > 1 else 0,
        ws.stride(1) if ws.shape[1] > 1 else 0,
        out.stride(0),
    )
    constants = dict(
        SCALE_N=scale_n,
        SCALE_K=scale_k if along_k else config.block_k,
        SCALE_ALONG_K=along_k,
        X_GROUPED=grouped,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return strides, constants


def run_scaled_mm(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    scale_block: tuple[int, int],
    config: GemmConfig | None = None,
) -> Tensor:
    """The Triton GEMM. x_scale: [1], [..., 1] per token, or [..., cdiv(K, sk)] per token and block of columns
    (block scales only); w_scale: [cdiv(N, sn), cdiv(K, sk)] for
    scale_block (sn, sk), where sk >= K means one scale along K (per channel: (1, K); per tensor: [1])."""
    x = as_rows(x_q)
    (m, k), n = x.shape, w_q.shape[0]
    config = config or default_config(m, n, k, scale_block[1], x.device)
    w_q, ws = _weights(w_q, w_scale, k, scale_block[1], config.block_k)
    x_scale = _activation_scales(x_scale)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        strides, constants = _scale_arguments(x, x_scale, w_q, ws, bias, out, scale_block, config)
        grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n),)
        _scaled_mm_kernel[grid](
            x,
            x_scale,
            w_q,
            ws,
            bias if bias is not None else ws,
            out,
            m,
            n,
            k,
            *strides,
            BLOCK_M=config.block_m,
            GROUP_M=config.group_m,
            **constants,
        )
    return out.reshape(*x_q.shape[:-1], n)


# Largest token count the skinny kernel serves: up to 64 it beat what the dispatch ran before (cuBLASLt for
# per-row scales, the tile kernel for block scales) on every Llama-3-8B projection (H100 and H200, graph
# replays); at 64 the tile kernel is even with it on gate_up, and beyond that tiles reuse x enough to win.
SKINNY_MAX_M = 64
# The largest weight the one-token GEMV loads before its PDL wait (`_weight_first_gemv_config`: Qwen3-0.6B's
# 2-12 MB projections 2.7-3.9 us against 3.9-5.2 in the loop, H100, a272b27). Above it the pipelined loop: FP8
# Llama-3-8B's o_proj (16.8 MB) took 13.8 us with its weight first (8 x 4096 tiles, 255 registers, 2 programs a
# multiprocessor; ncu, H100) where qkv's 25 MB took 13.5 in the loop; with the limit here, batch 1 3.830 -> 3.650
# ms (H100). The loop's launches use PDL too, but a loop of several waves lets the next kernel launch only after its
# loop (`launch_next_kernel`; one wave: GEMV_ONE_WAVE): letting it launch at the start cost Llama-3-8B batch 1 5.867
# -> 6.242 ms (its waiting programs take the multiprocessors of later waves); after the loop, 5.787 -> 5.736, and
# FP8 3.659 -> 3.602 (H100, 2026-11-26).
GEMV_WEIGHT_FIRST_MAX_BYTES = 12 << 20
# A pipelined GEMV of one wave (at most GEMV_ONE_WAVE programs a multiprocessor, all resident at once: Llama-3-8B's
# qkv, o and down at 768 / 512 / 512 programs, not gate_up's 3584) leaves no later wave a multiprocessor to take,
# so it lets the next kernel launch at its wait. H100, 2026-11-27: Llama-3-8B FP8 batch-1 step 3.277-3.280 ->
# 3.202-3.203 ms (one artifact, alternating); `bench_layer.py --preset llama-3-8b --quantization fp8` 90.8-90.9 ->
# 90.1-90.3 us a layer, bf16 157.4 -> 157.3 (branch `gemv-early`, at 4 programs a multiprocessor, o and down only,
# lost).
GEMV_ONE_WAVE = 8


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of `_skinny_mm_kernel`.

    `split_k`: K slices per N tile (1: none); `dot`: fp8 `tl.dot` with the token rows padded to 16
    (tensor cores), else (one token, per-row weight scales) an fp32 multiply-and-sum on the CUDA cores.
    `max_registers`: ptxas's cap on registers a thread (None: its own choice).
    """

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool
    max_registers: int | None = None


def skinny_config(m: int, n: int, k: int, scale_k: int, device: torch.device, weight_bytes: int = 1) -> SkinnyConfig:
    """The launch `run_skinny_mm` uses, from graph-replay timings with the weight streamed from HBM
    (`benchmarks/bench_fp8.py --sweep`, H100 and H200).

    One token with per-row weight scales: the CUDA-core GEMV, 8 weight rows x 512 columns a program; its
    many small programs end together (folding block scales into it, a gather along K, ran 2-3x slower).
    Otherwise the fp8 MMA over 64 weight rows (one warpgroup's MMA height), 128 when many
    tokens would re-read x for each of a long N's tiles; K tiles of 256, or of the 128 a block scale
    allows. Pipelines 5 stages deep, or 4 when N gives several programs a multiprocessor, so two fit in
    its shared memory. K is split while programs x block_k stays within multiprocessors x 256 (one
    program of 256-wide tiles a multiprocessor, two of 128-wide ones) and each slice keeps 4 K tiles.
    Wider weights (`weight_bytes` 2: bf16) take K tiles of as many bytes, half as many columns, and split
    K only up to half as many programs: in `bench_gemm.py --sweep` (H100, M = 8) splitting further lost
    on every shape (Qwen3-0.6B qkv 5.6 -> 6.4 us, Llama-3-8B o_proj 15.6 -> 16.1) and won on none.
    """
    sms = multiprocessors(device)
    long_n = cdiv(n, 64) >= 2 * sms
    if m == 1 and scale_k >= k and n * k * weight_bytes <= GEMV_WEIGHT_FIRST_MAX_BYTES:
        return _weight_first_gemv_config(n, k, weight_bytes, sms)
    if m == 1 and scale_k >= k:
        block_n, block_k, num_warps, num_stages, dot = 8, 512 // weight_bytes, 2, 4, False
    else:
        block_n = 128 if long_n and m > 16 else 64
        block_k = 256 // weight_bytes if scale_k >= k else min(128, scale_k & -scale_k)
        num_warps, num_stages, dot = 4, 4 if long_n else 5, True
    programs, split_k, budget = cdiv(n, block_n), 1, sms * 256 // weight_bytes
    while programs * split_k * 2 * block_k * weight_bytes <= budget and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k, num_warps, num_stages, dot)


# Weight bytes a program of the weight-first GEMV holds in registers.
GEMV_TILE_BYTES = 32 << 10
# A weight-first GEMV's programs should all hold their tiles at once (a second wave starts loading only after the
# wait): where more than 4 programs a multiprocessor need it, registers are capped to fit them in its register file
# (with the tile compiled in one trip, `_skinny_mm_kernel`'s ONE_TRIP), down to the fewest that compile without
# spills (sm_90: 8 x 1024 bf16 tiles with the RMSNorm prologue, 92 registers uncapped, spill at 72). Not above:
# ptxas takes a cap as a target (down_proj 96 -> 120 under a cap of 128).
REGISTERS_PER_SM = 64 << 10
GEMV_MIN_REGISTERS = 80


def _weight_first_gemv_config(n: int, k: int, weight_bytes: int, sms: int) -> SkinnyConfig:
    """The one-token GEMV of a small weight: each program's K slice is one tile, loaded
    before it waits for the kernel that writes x, so the weight streams in while that kernel finishes.

    Slices of up to 4096 columns; tiles of at most 8 rows and GEMV_TILE_BYTES, narrowed to 2 programs a
    multiprocessor. Qwen3-0.6B's projections at M = 1 (H100, a272b27, graph replays): 2.7-3.9 us against 3.9-5.2
    for the pipelined loop, except gate_up (6.6 against 6.3); tile shapes other than single rows within ~7%.
    More than 4 programs a multiprocessor (gate_up's 768) take a register cap that fits them all at once
    (REGISTERS_PER_SM): Qwen3-0.6B batch 1, graph replay 0.849-0.852 -> 0.837-0.843 ms (H100, fa913bc, 3 runs).
    """
    block_k = min(next_power_of_2(k), 4096)
    block_n = max(1, min(8, GEMV_TILE_BYTES // (block_k * weight_bytes)))
    while block_n > 1 and cdiv(n, block_n) * cdiv(k, block_k) < 2 * sms:
        block_n //= 2
    num_warps = 4
    programs_per_sm = cdiv(cdiv(n, block_n) * cdiv(k, block_k), sms)
    max_registers = REGISTERS_PER_SM // (programs_per_sm * num_warps * 32) // 8 * 8
    if not GEMV_MIN_REGISTERS <= max_registers < 128:
        max_registers = None
    return SkinnyConfig(block_n, block_k, cdiv(k, block_k), num_warps, 1, False, max_registers)


# What `_skinny_mm_kernel`'s one-token GEMV does to x before multiplying: the op in front of a decode projection,
# fused into it, so its output never makes a round trip through memory and a step has one kernel less a layer.
NO_PROLOGUE, RMS_NORM, SILU_MUL = 0, 1, 2
RMS_NORM_C, SILU_MUL_C = tl.constexpr(RMS_NORM), tl.constexpr(SILU_MUL)  # as the kernels see them


@dataclass(frozen=True)
class RMSNormPrologue:
    """x -> rms_norm(x (+ residual), weight, eps) in front of the GEMM; `summed` receives x + residual."""

    kind: ClassVar[int] = RMS_NORM
    weight: Tensor
    eps: float
    residual: Tensor | None = None
    summed: Tensor | None = None


@dataclass(frozen=True)
class SiluMulPrologue:
    """x = [gate | up] -> silu(gate) * up in front of the GEMM."""

    kind: ClassVar[int] = SILU_MUL


@dataclass(frozen=True)
class RopeCacheEpilogue:
    """The one-token GEMV of a Llama attention's fused [q; k; v] weight rotates q and k and writes k and v to the
    layer's cache (`qkv_rope_and_cache`); its output is the rotated q."""

    positions: Tensor
    cos_sin_cache: Tensor
    kv_cache: Tensor  # [2, blocks, block_size, kv_heads, head_dim], contiguous, not inline-scaled
    slot_mapping: Tensor
    num_q_heads: int
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    @property
    def head_dim(self) -> int:
        return self.kv_cache.shape[-1]


@triton.jit
def _gemv_operand(x_ptr, res_ptr, g_ptr, sum_ptr, cols, k_ok, K, store_sum, PROLOGUE: tl.constexpr):
    """The token's columns `cols` as the GEMV's fp32 operand, after the prologue, and (RMS_NORM) their squares.

    RMS_NORM multiplies by the norm weight only: 1/rms is a factor of the whole dot product, so the kernel
    applies it once at the end, from the squares it accumulates over the loop (one pass over x). The residual
    sum rounds to x's dtype first, as torch's add does, and is stored (where `store_sum`) as the next residual.
    """
    x = tl.load(x_ptr + cols, mask=k_ok, other=0.0)
    squares = 0.0
    if PROLOGUE == SILU_MUL_C:  # the up half starts K columns after the gate
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + cols + K, mask=k_ok, other=0.0).to(tl.float32)
        a = silu(gate) * up
    elif PROLOGUE == RMS_NORM_C:
        if res_ptr is not None:
            x = (x.to(tl.float32) + tl.load(res_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + cols, x, mask=k_ok & store_sum)
        h = x.to(tl.float32)
        squares = h * h
        a = h * tl.load(g_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
    else:
        a = x.to(tl.float32)
    return a, squares


@triton.jit
def _row_pairs(rows, dtype, HALF: tl.constexpr):
    """A program's 2 x HALF rows as two [HALF] vectors, row r beside row r + HALF (gate and up; a RoPE pair), each
    rounded to `dtype` as the unfused ops' outputs are."""
    return tl.split(tl.permute(tl.reshape(rows.to(dtype).to(tl.float32), [2, HALF]), [1, 0]))


@triton.jit
def _store_pairs(head_ptr, x1, x2, cols, HEAD_DIM: tl.constexpr):
    """Columns `cols` of a head's first half and their partners HEAD_DIM / 2 on, in the head's dtype."""
    tl.store(head_ptr + cols, x1.to(head_ptr.dtype.element_ty))
    tl.store(head_ptr + HEAD_DIM // 2 + cols, x2.to(head_ptr.dtype.element_ty))


@triton.jit
def _rope_cache_epilogue(
    acc,
    cos_sin,
    head,
    first_pair,
    slot,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_q_heads,
    num_kv_heads,
    stride_cache_slot,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """ROPE_CACHE's epilogue: a program's HALF pairs of one head, rotated (q, k) and stored (q to q_ptr, k and v to
    their caches at `slot`, unless it is -1: padding)."""
    dtype = q_ptr.dtype.element_ty
    x1, x2 = _row_pairs(acc, dtype, HALF)
    cos, sin = _row_pairs(cos_sin, dtype, HALF)
    cols = first_pair + tl.arange(0, HALF)
    if head < num_q_heads + num_kv_heads:  # q and k heads rotate, v heads do not
        x1, x2 = rotate_halves(x1, x2, cos, sin, dtype)
    if head < num_q_heads:
        _store_pairs(q_ptr + head * HEAD_DIM, x1, x2, cols, HEAD_DIM)
    elif slot >= 0:
        is_v = head >= num_q_heads + num_kv_heads
        kv_head = head - num_q_heads - is_v * num_kv_heads
        offset = slot * stride_cache_slot + kv_head * HEAD_DIM
        if is_v:
            if FP8_CACHE:
                x1, x2 = to_fp8_range(x1, x2, v_scale_ptr, KV_SCALED)
            _store_pairs(v_cache_ptr + offset, x1, x2, cols, HEAD_DIM)
        else:
            if FP8_CACHE:
                x1, x2 = to_fp8_range(x1, x2, k_scale_ptr, KV_SCALED)
            _store_pairs(k_cache_ptr + offset, x1, x2, cols, HEAD_DIM)


@triton.jit(do_not_specialize=["M"])
def _skinny_mm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    res_ptr,
    g_ptr,
    sum_ptr,
    pos_ptr,
    cos_sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    num_q_heads,
    num_kv_heads,
    stride_cos,
    stride_cache_slot,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_ALONG_K: tl.constexpr,
    X_GROUPED: tl.constexpr,
    X_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
    ONE_TRIP: tl.constexpr,
    GATED: tl.constexpr,
    ONE_WAVE: tl.constexpr,
    ROUND_TO_X: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROPE_CACHE: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 2,
    FP8_CACHE: tl.constexpr = False,
    KV_SCALED: tl.constexpr = False,
):
    """The GEMM for M <= BLOCK_M tokens, computed transposed: acc[n, m] = sum_k w[n, k] x[m, k].

    SCALED: fp8 operands with the scales of `_scaled_mm_kernel`; else plain bf16/fp16 ones (`linear`).
    SCALED without X_SCALED (one token, the CUDA-core GEMV): x is unquantized (bf16/fp16) and only the fp8
    weight is scaled, the weight-only product of `fp8_linear` (it takes prologues, as the bf16 GEMV does).
    PROLOGUE (one token, the CUDA-core GEMV only; see `_gemv_operand`): RMS_NORM normalises x (plus the
    residual at res_ptr, if given, whose sum goes to sum_ptr) with weight g_ptr and eps first; SILU_MUL takes
    x = [gate | up] of 2K columns. GATED (the one-token GEMV, unsplit): the weight is [gate; up], N = 2 x the
    output's columns, and a program takes BLOCK_N / 2 rows of each half, so its epilogue writes SiLU(gate) * up
    (rounded as `silu_and_mul` rounds) instead of both: the activation is computed once, not in every program of
    the down projection's prologue. ROPE_CACHE (the one-token GEMV, unsplit; `qkv_rope_and_cache`): the weight is a
    Llama attention's [q; k; v] of HEAD_DIM-wide heads, a program takes BLOCK_N / 2 rows of a head's first half and
    the rows HEAD_DIM / 2 further (the pairs neox RoPE rotates together), and its epilogue rotates q and k heads
    (as `rope_and_cache` rounds), stores q heads to out_ptr ([num_q_heads, HEAD_DIM]) and k and v heads to the
    cache at the token's slot (FP8_CACHE: over the cache's scales where KV_SCALED, saturated to e4m3).

    A decode GEMM reads each weight byte once and does almost no arithmetic on it, so what counts
    is bytes in flight: many programs (narrow N tiles, and K split in `num_splits` slices when N alone
    gives too few), wide contiguous K tiles of the fp8 weight, and a deep load pipeline. USE_DOT:
    weight rows are the fp8 MMA's M side (swap AB), so the tokens pad only its narrow N side (16).
    Else one token with per-row weight scales (BLOCK_M = 1): the weight tile is widened to fp32 and
    multiplied by x on the CUDA cores; no padding at all, a few percent faster at M = 1. Block scales
    (MMA only) multiply each K tile's partial, so a K tile must lie in one scale block.

    WEIGHT_FIRST: each K slice is one tile, loaded before the PDL wait (the weight does not depend on the
    kernel before; on a small weight its stream then overlaps that kernel's tail instead of following it).
    Otherwise the one-token GEMV lets the next kernel launch only after its loop (a large weight's many waves),
    or at its wait where ONE_WAVE (all of its programs resident at once).
    ONE_TRIP (weight first): the tile's loop of one trip gets constant bounds, so the compiler drops it. In a
    runtime loop ptxas hoists the loop-invariant tile's unpacking out of it, twice its registers (Qwen3-0.6B's
    gate_up 125 a thread, 92 without; capped at 80 it spills nothing, the loop form does), but it schedules the
    loop form better: without the cap's need, one trip lost (H100, M = 1, qkv 3.9 -> 4.6 us, o 2.7 -> 3.1).

    Split K: program (n tile, slice) stores its fp32 partial to `part_ptr` [num_splits, M, N] and takes
    a ticket; the slice that arrives last sums the partials in slice order (deterministic) and
    writes the output, so one launch does it all and nothing synchronises with the host.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_N // 2
    if GATED:  # rows r < HALF of the gate half, the rest the same rows of the up half
        rows = tl.arange(0, BLOCK_N)
        offs_n = pid_n * HALF + rows % HALF + (rows // HALF) * (N // 2)
        n_ok = pid_n * HALF + rows % HALF < N // 2
    elif ROPE_CACHE:  # rows r < HALF of a head's first half, the rest their partners HEAD_DIM / 2 on
        rows = tl.arange(0, BLOCK_N)
        head = pid_n // (HEAD_DIM // BLOCK_N)
        first_pair = (pid_n % (HEAD_DIM // BLOCK_N)) * HALF
        pair = first_pair + rows % HALF
        offs_n = head * HEAD_DIM + pair + (rows // HALF) * (HEAD_DIM // 2)
        n_ok = offs_n < N  # all rows (tiles divide whole heads)
        # the step's position and slot: nothing the kernel before writes (see `wait_for_previous_kernel`), so their
        # round trips happen while it may still run; the pairs' cos/sin wait for the epilogue (held across the loop
        # they cost 96 registers against 72, and timed 10 us a step slower)
        cos_sin_row = cos_sin_ptr + tl.load(pos_ptr).to(tl.int64) * stride_cos
        slot = tl.load(slot_ptr).to(tl.int64)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if WEIGHT_FIRST:  # nothing writes the weight: load it while the kernel that writes x may still run
        w_first = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k < k_end - k_start)[None, :], other=0.0)
    wait_for_previous_kernel(USE_PDL, LAUNCH_NEXT=WEIGHT_FIRST or USE_DOT or ONE_WAVE)
    ws_ptrs = ws_ptr + (offs_n // SCALE_N) * stride_wsn

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # RMS_NORM's, summed after the loop
    # The pipelined one-token GEMV sums each tile's products within runs of RUN columns, those a thread loads (16
    # bytes), and across the runs once after the loop, so the shuffles between threads leave the loop: sm_90 SASS of
    # the FP8 loop a tile 282 -> 245 instructions bare, 389 -> 351 with the RMSNorm prologue (20 SHFL and ~20 FADD
    # fewer). H100 (`bench_layer.py --preset llama-3-8b`, batch 1): FP8 92.1 -> 90.7 us a layer, bf16 159.4 -> 157.5;
    # Llama-3-8B FP8 batch-1 step 3.315 -> 3.279 ms. (Multiplying the FP8 runs in f16x2 as well, 245 -> 210
    # instructions, gained 0.1 us more: the loop is no longer issue-bound; branch `gemv-f16`.)
    RUN: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth
    RUNS: tl.constexpr = 1 if USE_DOT or WEIGHT_FIRST or BLOCK_K < RUN else BLOCK_K // RUN
    runs = tl.zeros([BLOCK_N, RUNS], dtype=tl.float32)
    store_sum = pid_n == 0  # one program writes the residual sum
    loop_start = 0 if ONE_TRIP else k_start
    loop_end = BLOCK_K if ONE_TRIP else k_end
    for k in tl.range(loop_start, loop_end, BLOCK_K, num_stages=NUM_STAGES):
        k0 = k_start + k if ONE_TRIP else k
        k_ok = offs_k < k_end - k0
        if WEIGHT_FIRST:
            w = w_first
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
            part = tl.dot(w, tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0))
            if SCALE_ALONG_K:  # the K tile lies in one scale block
                part *= tl.load(ws_ptrs + (k0 // SCALE_K) * stride_wsk, mask=n_ok, other=0.0)[:, None]
                if X_GROUPED:  # and in one group of x's scales
                    part *= tl.load(xs_ptr + offs_m * stride_xsm + k0 // SCALE_K, mask=m_ok, other=0.0)[None, :]
            acc += part
        else:  # one token, per-row weight scales
            x, tile_squares = _gemv_operand(x_ptr, res_ptr, g_ptr, sum_ptr, k0 + offs_k, k_ok, K, store_sum, PROLOGUE)
            runs += tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, RUNS, BLOCK_K // RUNS]), axis=2)
            if PROLOGUE == RMS_NORM_C:
                squares += tile_squares
        w_ptrs += BLOCK_K
    if not USE_DOT:
        acc += tl.sum(runs, axis=1)[:, None]
    if not (WEIGHT_FIRST or USE_DOT or ONE_WAVE):  # a large weight's waves: the next kernel launches as the last end
        launch_next_kernel(USE_PDL)

    last = True  # without a split, every program stores its own tile
    if SPLIT:
        part_ptrs = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        ok = m_ok[None, :] & n_ok[:, None]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=ok)
        last = last_to_arrive(ticket_ptr + pid_n, num_splits)  # the slice that arrives last sums the partials
        if last:
            acc = tl.load(part_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, num_splits):
                acc += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
    if last:  # the norm, the scales not applied yet, then bias
        if PROLOGUE == RMS_NORM_C:  # never split: each program sums all of K's squares
            acc *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if SCALED:
            if not SCALE_ALONG_K:
                acc *= tl.load(ws_ptrs, mask=n_ok, other=0.0)[:, None]
            if X_SCALED and not X_GROUPED:
                acc *= tl.load(xs_ptr + offs_m * stride_xsm, mask=m_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if ROPE_CACHE:
            _rope_cache_epilogue(
                acc,
                tl.load(cos_sin_row + pair + (rows // HALF) * (HEAD_DIM // 2)),  # [cos; sin] of the pairs
                head,
                first_pair,
                slot,
                out_ptr,
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                num_q_heads,
                num_kv_heads,
                stride_cache_slot,
                HALF,
                HEAD_DIM,
                FP8_CACHE,
                KV_SCALED,
            )
        elif GATED:  # one token (BLOCK_M 1): [gate rows; up rows] -> SiLU(gate) * up
            dtype = out_ptr.dtype.element_ty
            gate, up = _row_pairs(acc, dtype, HALF)
            cols = pid_n * HALF + tl.arange(0, HALF)
            tl.store(out_ptr + cols, (silu(gate).to(dtype).to(tl.float32) * up).to(dtype), mask=cols < N // 2)
        else:
            if ROUND_TO_X:
                acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
            out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def run_skinny_mm(
    x_q: Tensor,
    x_scale: Tensor | None,
    w_q: Tensor,
    w_scale: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    scale_block: tuple[int, int],
    config: SkinnyConfig | None = None,
    prologue: RMSNormPrologue | SiluMulPrologue | None = None,
    gated: bool = False,
    rope_cache: RopeCacheEpilogue | None = None,
    round_to_x: bool = False,
) -> Tensor:
    """`run_scaled_mm` for at most SKINNY_MAX_M tokens (same arguments), through `_skinny_mm_kernel`.

    Without scales (both None) it is the plain GEMM x @ w^T + bias of same-dtype x and w; for one token it may
    take a prologue (x is then [..., 2K] for SiLU·mul; an RMSNorm prologue's residual has x's shape). One
    unquantized token (x_scale None) may also go through an fp8 weight with per-row scales: weight-only.
    `gated` (one token): w is [gate; up] and the output SiLU(gate) * up, half w's rows wide. `rope_cache` (one
    token): w is [q; k; v] and the output the rotated q, the k and v heads going to the cache. `round_to_x`: the
    output rounds to x's dtype before it is stored as `out_dtype` (the LM head's fp32 logits).
    """
    if x_scale is not None and w_scale is None:
        raise ValueError("the skinny GEMM takes activation scales only with weight scales (fp8)")
    if prologue is not None and x_scale is not None:
        raise ValueError("the skinny GEMM's prologues take unscaled (bf16/fp16) operands")
    x = as_rows(x_q)
    m, (n, k) = x.shape[0], w_q.shape
    if x.shape[1] != (2 * k if isinstance(prologue, SiluMulPrologue) else k):
        raise ValueError(f"x's {x.shape[1]} columns do not fit the weight's {k}")
    if m > SKINNY_MAX_M:
        raise ValueError(f"the skinny GEMM serves at most {SKINNY_MAX_M} tokens, got {m}")
    scale_k = scale_block[1]
    config = config or skinny_config(m, n, k, scale_k, x.device, w_q.element_size())
    if not config.dot and (m > 1 or scale_k < k):
        raise ValueError(f"the CUDA-core GEMV serves one token with per-row weight scales, got {m} tokens")
    if w_scale is not None and x_scale is None and config.dot:
        raise ValueError("an unquantized x through an fp8 weight runs in the one-token GEMV, not in the MMA")
    if prologue is not None and config.dot:
        raise ValueError("the skinny GEMM's prologues run in the one-token GEMV, not in the MMA")
    if gated + (rope_cache is not None) + round_to_x > 1:
        raise ValueError("the skinny GEMM takes one epilogue: gated, rope_cache or round_to_x")
    if gated:
        if config.dot or n % 2:
            raise ValueError(f"the gated GEMV takes one token and an even number of weight rows, got {m} and {n}")
        # a program holds matching gate and up rows, and writes the activation whole (no split of K)
        config = dataclasses.replace(config, block_n=max(2, config.block_n), split_k=1)
    if rope_cache is not None:
        head_dim, heads = rope_cache.head_dim, rope_cache.num_q_heads + 2 * rope_cache.kv_cache.shape[-2]
        if config.dot or n != heads * head_dim or head_dim % 2 or not rope_epilogue_fits(rope_cache):
            raise ValueError(
                f"the RoPE epilogue takes one token, {heads} heads of {head_dim} rows and a contiguous cache of e4m3 "
                f"or plain entries with full-width RoPE; got {m} tokens and {n} rows"
            )
        # a program holds pairs of one head (a tile divides it), and writes them whole (no split of K)
        config = dataclasses.replace(config, block_n=math.gcd(max(2, config.block_n), head_dim), split_k=1)
    residual = norm_weight = summed = None
    if isinstance(prologue, RMSNormPrologue):
        if config.split_k > 1:  # each program needs the squares of the whole row
            config = dataclasses.replace(config, split_k=1)
        norm_weight = prologue.weight
        if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
            raise ValueError(f"the RMSNorm prologue's weight must be a contiguous vector of {k}")
        if prologue.residual is not None:
            residual, summed = as_rows(prologue.residual), prologue.summed
            if summed is None or summed.shape != prologue.residual.shape or not summed.is_contiguous():
                raise ValueError("the RMSNorm prologue's residual needs a contiguous sum buffer of its shape")
            if residual.shape != x.shape:
                raise ValueError("the RMSNorm prologue's residual must have x's shape")
    w_q, ws = _weights(w_q, w_scale, k, scale_k, config.block_k)
    width = n // 2 if gated else n
    if rope_cache is not None:  # the output is q, the heads before k and v
        width = rope_cache.num_q_heads * rope_cache.head_dim
    out = torch.empty((m, width), dtype=out_dtype, device=x.device)
    scaled, x_scaled = ws is not None, x_scale is not None
    unused = out[:1, :1]  # for the scale pointers a launch does not read: one element, so nothing looks grouped
    x_scale = _activation_scales(x_scale) if x_scaled else unused
    ws = ws if scaled else unused
    # Slices of whole K tiles; rounding may leave fewer slices than asked for, never an empty one.
    k_per_split = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = cdiv(k, k_per_split)
    weight_first = k_per_split == config.block_k  # a slice is one tile (the norm or gating may have undone a split)
    n_tiles = cdiv(n, config.block_n)
    part = tickets = out  # unused without a split
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        tickets = ticket_counters(x.device, n_tiles)
    rope = _rope_cache_arguments(rope_cache, unused)
    if m:
        strides, constants = _scale_arguments(x, x_scale, w_q, ws, bias, out, scale_block, config)
        pdl = pdl_launch(x.device)
        _skinny_mm_kernel[(n_tiles, split_k)](
            x,
            x_scale,
            w_q,
            ws,
            bias if bias is not None else ws,
            out,
            part,
            tickets,
            residual,
            norm_weight,
            summed,
            *rope.pointers,
            prologue.eps if isinstance(prologue, RMSNormPrologue) else 0.0,
            m,
            n,
            k,
            k_per_split,
            split_k,
            *rope.sizes,
            *strides,
            BLOCK_M=max(16, next_power_of_2(m)) if config.dot else 1,
            SCALED=scaled,
            X_SCALED=x_scaled,
            SPLIT=split_k > 1,
            USE_DOT=config.dot,
            PROLOGUE=prologue.kind if prologue is not None else NO_PROLOGUE,
            WEIGHT_FIRST=weight_first,
            ONE_TRIP=weight_first and config.max_registers is not None,  # a capped weight-first config: its one tile
            GATED=gated,
            **rope.constants,
            ROUND_TO_X=round_to_x,
            # where it changes anything: a pipelined GEMV under PDL
            ONE_WAVE=pdl["USE_PDL"]
            and not (weight_first or config.dot)
            and n_tiles * split_k <= GEMV_ONE_WAVE * multiprocessors(x.device),
            **constants,
            **({"maxnreg": config.max_registers} if config.max_registers else {}),
            **pdl,
        )
    return out.reshape(*x_q.shape[:-1], out.shape[1])


@dataclass(frozen=True)
class _RopeCacheArguments:
    pointers: tuple  # positions, cos/sin, slots, k and v caches, k and v scales
    sizes: tuple  # num_q_heads, num_kv_heads, stride_cos, stride_cache_slot
    constants: dict


def rope_epilogue_fits(epilogue: RopeCacheEpilogue) -> bool:
    """Whether the GEMV can write this cache (contiguous, plain or per-tensor e4m3 entries) with this RoPE (full
    width)."""
    cache = epilogue.kv_cache
    return cache.is_contiguous() and not inline_scales(cache) and epilogue.cos_sin_cache.shape[-1] == epilogue.head_dim


def _rope_cache_arguments(epilogue: RopeCacheEpilogue | None, unused: Tensor) -> _RopeCacheArguments:
    """`_skinny_mm_kernel`'s ROPE_CACHE arguments (`unused` and zeros without the epilogue)."""
    if epilogue is None:
        return _RopeCacheArguments((unused,) * 7, (0, 0, 0, 0), {})
    cache = epilogue.kv_cache
    fp8, scaled = cache.dtype == FP8_DTYPE, epilogue.k_scale is not None
    scales = (epilogue.k_scale, epilogue.v_scale) if fp8 and scaled else (unused, unused)
    pointers = (epilogue.positions, epilogue.cos_sin_cache, epilogue.slot_mapping, cache[0], cache[1], *scales)
    sizes = (epilogue.num_q_heads, cache.shape[-2], epilogue.cos_sin_cache.stride(0), cache.stride(2))
    constants = {"ROPE_CACHE": True, "HEAD_DIM": epilogue.head_dim, "FP8_CACHE": fp8, "KV_SCALED": fp8 and scaled}
    return _RopeCacheArguments(pointers, sizes, constants)


@register_impl("scaled_mm_blockwise", "triton")
def scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, out_dtype, block_n, block_k) -> Tensor:
    run = run_skinny_mm if 0 < x_q.numel() // x_q.shape[-1] <= SKINNY_MAX_M else run_scaled_mm
    return run(x_q, x_scale, w_q, w_scale, bias, out_dtype, (block_n, block_k))


def cublas_scaled_mm(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`torch._scaled_mm` on 2-D x_q [M, K]: tensor-wise when both scales are single, else row-wise."""
    m, n = x_q.shape[0], w_q.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()), out_dtype=out_dtype
        )
    scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
    out = torch._scaled_mm(x_q, w_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


@register_impl("scaled_mm", "triton")
def scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor:
    x = as_rows(x_q)
    (m, k), n = x.shape, w_q.shape[0]
    if 0 < m <= SKINNY_MAX_M:
        return run_skinny_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype, (1, k))
    if m == 0 or k % 16 or n % 16 or w_q.stride(1) != 1:
        return run_scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype, (1, k))
    out = cublas_scaled_mm(x, x_scale, w_q, w_scale, out_dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x_q.shape[:-1], n)


# Largest token count `linear` sends to the skinny kernel rather than cuBLAS (bf16 weights).
SKINNY_LINEAR_MAX_M = 16


def _skinny_linear(x: Tensor, weight: Tensor, max_rows: int = SKINNY_LINEAR_MAX_M) -> bool:
    """Whether x's rows (at most `max_rows`) take the skinny kernel (else cuBLAS)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= max_rows and x.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)


@register_impl("linear", "triton")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if _skinny_linear(x, weight):
        return run_skinny_mm(x, None, weight, None, bias, x.dtype, (1, weight.shape[1]))
    return F.linear(x, weight, bias)


@register_impl("logits", "triton")
def logits(x: Tensor, weight: Tensor) -> Tensor:
    """The skinny GEMM writes the fp32 logits itself, each rounded to x's dtype first (as `linear` then `.float()`)."""
    if _skinny_linear(x, weight):
        return run_skinny_mm(x, None, weight, None, None, torch.float32, (1, weight.shape[1]), round_to_x=True)
    return F.linear(x, weight).float()


# The fused linears take the prologue for one token only, in the CUDA-core GEMV; at 2 to 16 they run the op
# and then `linear`. In the MMA path the prologue stalls every K tile between its loads and the MMA: Llama-3-8B's
# down projection at M = 8 took 128 us fused against 51 us for SiLU·mul's kernel and the GEMM (H100, graphs).
FUSED_LINEAR_MAX_M = 1


def _gemv(x, w, w_scale, bias, out_dtype, prologue=None) -> Tensor:
    """One token through `w` (fp8 with per-row `w_scale`, or unscaled) on the CUDA cores, after `prologue`."""
    return run_skinny_mm(x, None, w, w_scale, bias, out_dtype, (1, w.shape[1]), prologue=prologue)


@register_impl("rms_norm_linear", "triton")
def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    if _skinny_linear(x, weight, FUSED_LINEAR_MAX_M):
        return _gemv(x, weight, None, bias, x.dtype, RMSNormPrologue(norm_weight, eps))
    return linear(rms_norm(x, norm_weight, eps), weight, bias)


@register_impl("fused_add_rms_norm_linear", "triton")
def fused_add_rms_norm_linear(
    x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    if _skinny_linear(x, weight, FUSED_LINEAR_MAX_M):
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _gemv(x, weight, None, bias, x.dtype, RMSNormPrologue(norm_weight, eps, residual, summed)), summed
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), summed


@register_impl("silu_and_mul_linear", "triton")
def silu_and_mul_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if _skinny_linear(x, weight, FUSED_LINEAR_MAX_M):
        return _gemv(x, weight, None, bias, x.dtype, SiluMulPrologue())
    return linear(silu_and_mul(x), weight, bias)


# The FP8 linears (quant.py's fp8_linear ops): one token through the weight-only GEMV, its norm or SiLU·mul as the
# prologue, so a decoder layer of an FP8 model runs the kernels of a bf16 one; more tokens through the quantizer
# kernel and then `scaled_mm`.
@register_impl("fp8_linear", "triton")
def fp8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    if one_token(x):
        return _gemv(x, w_q, w_scale, bias, out_dtype)
    return scaled_mm(*quant_fp8_per_token(x), w_q, w_scale, bias, out_dtype)


@register_impl("rms_norm_fp8_linear", "triton")
def rms_norm_fp8_linear(x, norm_weight, eps, w_q, w_scale, bias, out_dtype) -> Tensor:
    if one_token(x):
        return _gemv(x, w_q, w_scale, bias, out_dtype, RMSNormPrologue(norm_weight, eps))
    return scaled_mm(*rms_norm_quant_fp8(x, norm_weight, eps), w_q, w_scale, bias, out_dtype)


@register_impl("fused_add_rms_norm_fp8_linear", "triton")
def fused_add_rms_norm_fp8_linear(
    x, residual, norm_weight, eps, w_q, w_scale, bias, out_dtype
) -> tuple[Tensor, Tensor]:
    if one_token(x):
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        prologue = RMSNormPrologue(norm_weight, eps, residual, summed)
        return _gemv(x, w_q, w_scale, bias, out_dtype, prologue), summed
    x_q, x_scale, summed = fused_add_rms_norm_quant_fp8(x, residual, norm_weight, eps)
    return scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype), summed


@register_impl("silu_and_mul_fp8_linear", "triton")
def silu_and_mul_fp8_linear(x, w_q, w_scale, bias, out_dtype) -> Tensor:
    if one_token(x):
        return _gemv(x, w_q, w_scale, bias, out_dtype, SiluMulPrologue())
    return scaled_mm(*silu_and_mul_quant_fp8(x), w_q, w_scale, bias, out_dtype)


_two_projections = Projections(
    fused_add_rms_norm_linear, fused_add_rms_norm_fp8_linear, silu_and_mul_linear, silu_and_mul_fp8_linear
)


@register_impl("fused_add_rms_norm_mlp", "triton")
def fused_add_rms_norm_mlp(x, residual, norm_weight, eps, w1, s1, b1, w2, s2, b2, out_dtype) -> tuple[Tensor, Tensor]:
    """One token: the gate_up GEMV (norm prologue, SiLU·mul epilogue), then the down GEMV; else the two fused ops."""
    act_dtype = out_dtype if s1 is not None else x.dtype
    gemvs = s1 is not None or _skinny_linear(x, w1, FUSED_LINEAR_MAX_M)
    if not (one_token(x) and gemvs and (s2 is not None or w2.dtype == act_dtype)):
        return _two_projections(x, residual, norm_weight, eps, w1, s1, b1, w2, s2, b2, out_dtype)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    prologue = RMSNormPrologue(norm_weight, eps, residual, summed)
    act = run_skinny_mm(x, None, w1, s1, b1, act_dtype, (1, w1.shape[1]), prologue=prologue, gated=True)
    return _gemv(act, w2, s2, b2, out_dtype if s2 is not None else act_dtype), summed


_qkv_then_rope = QKVRopeCache(
    rms_norm_linear, fused_add_rms_norm_linear, rms_norm_fp8_linear, fused_add_rms_norm_fp8_linear, rope_and_cache
)


@register_impl("qkv_rope_and_cache", "triton")
def qkv_rope_and_cache(*args) -> tuple[Tensor, Tensor]:
    """One token into a contiguous cache of plain or e4m3 entries: the qkv GEMV (norm prologue) rotates q and k and
    writes k and v to the cache in its epilogue. Otherwise the fused projection op, then `rope_and_cache`."""
    x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype, *rope_args = args  # the op's, in its order
    positions, cos_sin_cache, kv_cache, slot_mapping, num_q_heads, k_scale, v_scale = rope_args
    rope = RopeCacheEpilogue(positions, cos_sin_cache, kv_cache, slot_mapping, num_q_heads, k_scale, v_scale)
    gemv = weight_scale is not None or _skinny_linear(x, weight, FUSED_LINEAR_MAX_M)
    if not (one_token(x) and gemv and rope_epilogue_fits(rope)):
        return _qkv_then_rope(*args)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x.new_empty(0)
    prologue = RMSNormPrologue(norm_weight, eps, residual, summed if residual is not None else None)
    dtype = out_dtype if weight_scale is not None else x.dtype
    q = run_skinny_mm(
        x, None, weight, weight_scale, bias, dtype, (1, weight.shape[1]), prologue=prologue, rope_cache=rope
    )
    return q.unflatten(-1, (num_q_heads, rope.head_dim)), summed
