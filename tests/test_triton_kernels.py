"""Every Triton kernel against its plain-torch reference, on random inputs at odd sizes.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) on small fp32 inputs; on a GPU the same tests run in bf16, and the
GPU-only cases add larger shapes. The kernels are called directly: the custom-op dispatch
would send CPU tensors to the reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atom_models.ops.activation import silu_and_mul_reference
from atom_models.ops.attention import (
    paged_attention_reference,
    qk_norm_rope_and_cache_reference,
    qkv_rope_and_cache_reference,
    reshape_and_cache_reference,
    rope_and_cache_reference,
)
from atom_models.ops.linear import (
    fused_add_rms_norm_linear_reference,
    linear_reference,
    logits_reference,
    rms_norm_linear_reference,
    silu_and_mul_linear_reference,
)
from atom_models.ops.mlp import fused_add_rms_norm_mlp_reference
from atom_models.ops.norm import fused_add_rms_norm_reference, fused_add_rms_norm_rows_reference, rms_norm_reference
from atom_models.ops.quant import (
    FP8_DTYPE,
    expand_group_scale,
    fused_add_rms_norm_fp8_linear_reference,
    fused_add_rms_norm_quant_fp8_reference,
    num_scale_groups,
    quant_fp8_per_token_reference,
    quantize_weight,
    rms_norm_quant_fp8_reference,
    silu_and_mul_quant_fp8_reference,
)
from atom_models.ops.rotary import rope_cos_sin_cache, rope_inv_freq, rotary_embedding_reference
from atom_models.ops.sampling import carry_tokens_reference, sample_rows_reference

triton = pytest.importorskip("triton")
from atom_models.ops.triton_kernels import (  # noqa: E402
    activation,
    attention,
    common,
    gemm,
    norm,
    quant,
    rotary_cache,
    sampling,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter multiplies bf16 tl.dot operands wrongly and rounds bf16 by truncation: fp32 there.
DTYPE = torch.bfloat16 if CUDA else torch.float32
# Elementwise kernels round like the reference, so they differ only where fp32 math differs by an ulp
# before rounding; attention rounds probabilities to DTYPE for the second product (flash attention does).
TOL = 1e-2 if torch.bfloat16 == DTYPE else 1e-5
ATTN_TOL = 2e-2 if torch.bfloat16 == DTYPE else 1e-5
gpu_only = pytest.mark.skipif(not CUDA, reason="larger shapes need a CUDA device")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert torch.isfinite(out.float()).all(), "non-finite output (unwritten or NaN)"
    assert rel_err(out.float(), ref.float()) < tol, rel_err(out.float(), ref.float())


def assert_fp8_close(
    out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], group_size: int = 0
) -> None:
    """fp8 values may differ by one step where rounding ties fall differently: compare dequantized."""
    (q, scale), (q_ref, scale_ref) = out, ref
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    assert scale.shape[-1] == num_scale_groups(q.shape[-1], group_size)
    assert_close(scale, scale_ref)
    cols = q.shape[-1]
    dequantized = q.float() * expand_group_scale(scale, group_size, cols)
    assert_close(dequantized, q_ref.float() * expand_group_scale(scale_ref, group_size, cols), tol=max(TOL, 1e-2))


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Leave NaNs where the caching allocator will place the next output of this size."""
    torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype = DTYPE, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float32, device=DEVICE) * scale).to(dtype)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def exact_fp8_casts_in_interpreter():
    """Triton's interpreter rounds fp32 -> fp8 without carrying into the exponent (126.8 -> 64).

    GPUs convert in hardware; under the interpreter, convert with torch instead so the
    tests check the kernels, not that bug.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if CUDA or original is None:
        yield
        return

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype == triton.language.float8e4nv and input_dtype == triton.language.float32:
            return torch.from_numpy(values).to(FP8_DTYPE).view(torch.uint8).numpy()
        return original(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    yield
    interpreter._convert_float = original


NORM_SHAPES = [(7, 40), (1, 16)] + ([(37, 4096), (3, 5, 1000)] if CUDA else [])


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape):
    x, w = randn(*shape, scale=3.0), randn(shape[-1])
    poison_allocator(x.shape, x.dtype)
    assert_close(norm.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    for group in (0, 16):  # a scale per row, and per 16 columns
        quantized = norm.rms_norm_quant_fp8(x, w, 1e-6, group)
        assert_fp8_close(quantized, rms_norm_quant_fp8_reference(x, w, 1e-6, group), group)


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rms_norm(shape):
    x, res, w = randn(*shape), randn(*shape), randn(shape[-1])
    out, summed = norm.fused_add_rms_norm(x, res, w, 1e-5)
    out_ref, summed_ref = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert_close(out, out_ref)
    assert_close(summed, summed_ref, tol=1e-6 if torch.float32 == DTYPE else TOL)
    for group in (0, 16):
        *quantized, summed = norm.fused_add_rms_norm_quant_fp8(x, res, w, 1e-5, group)
        *quantized_ref, summed_ref = fused_add_rms_norm_quant_fp8_reference(x, res, w, 1e-5, group)
        assert_fp8_close(tuple(quantized), tuple(quantized_ref), group)
        assert_close(summed, summed_ref)


@pytest.mark.parametrize("shape", [shape for shape in NORM_SHAPES if len(shape) == 2])
def test_fused_add_rms_norm_rows(shape):
    """A model's final norm over the rows a step samples: one, all in reverse, repeated ones, none."""
    x, res, w = randn(*shape), randn(*shape), randn(shape[-1])
    n = shape[0]
    for rows in ([n - 1], list(range(n))[::-1], [0, n - 1, 0], []):
        rows = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        out = norm.fused_add_rms_norm_rows(x, res, w, 1e-5, rows)
        assert_close(out, fused_add_rms_norm_rows_reference(x, res, w, 1e-5, rows))


def test_rms_norm_strided_rows():
    x = randn(9, 64)[:, :48]  # rows 64 apart
    w = randn(48)
    assert_close(norm.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("shape", [(7, 2 * 48), (1, 2 * 20)] + ([(37, 2 * 5000), (2, 3, 2 * 1400)] if CUDA else []))
def test_silu_and_mul(shape):
    x = randn(*shape, scale=2.0)
    poison_allocator((*shape[:-1], shape[-1] // 2), x.dtype)
    assert_close(activation.silu_and_mul(x), silu_and_mul_reference(x))
    for group in (0, 16):
        assert_fp8_close(activation.silu_and_mul_quant_fp8(x, group), silu_and_mul_quant_fp8_reference(x, group), group)


def draws(rows: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sample_rows' per-row inputs: one temperature, seeds from 2^40 up, positions 1000 on."""
    return (
        torch.full((rows,), temperature, device=DEVICE),
        torch.arange(rows, device=DEVICE) + 2**40,
        torch.arange(rows, dtype=torch.int32, device=DEVICE) + 1000,
    )


@pytest.mark.parametrize("rows,cols", [(1, 5000), (6, 4099), (3, 2048), (2, 7)] + ([(37, 151936)] if CUDA else []))
def test_sample_rows_greedy(rows, cols):
    """At temperature 0, torch.argmax: ties go to the first (also across slices), a NaN wins, an all -inf row
    gives 0."""
    x = torch.randn(rows, cols, device=DEVICE)
    x[0, cols // 2], x[0, cols - 1] = 50.0, 50.0  # equal largest values, in different slices where there are two
    if rows > 2:
        x[1, cols - 1] = float("nan")  # after the largest value: still the answer
        x[2] = float("-inf")
    x[-1, : cols // 3] = x[-1].max() + 1  # a run of equal largest values at the start
    assert torch.equal(sampling.sample_rows(x, *draws(rows, 0.0)), x.argmax(-1))
    strided = x[:, : cols - 1]
    assert torch.equal(sampling.sample_rows(strided, *draws(rows, 0.0)), strided.argmax(-1))


@pytest.mark.parametrize("rows,cols", [(5, 5000), (3, 2048), (4, 7)] + ([(37, 151936)] if CUDA else []))
def test_sample_rows_draws(rows, cols):
    """Drawn rows: the reference's token (the same Philox noise, the same division), strided rows too, never a
    -inf logit; greedy rows of the same launch keep their argmax."""
    x = torch.randn(rows, cols, device=DEVICE) * 3
    x[0, 1::2] = float("-inf")  # half the vocabulary out: never drawn
    temperature, seeds, positions = draws(rows, 0.7)
    temperature[-1] = 0.0
    tokens = sampling.sample_rows(x, temperature, seeds, positions)
    assert torch.equal(tokens, sample_rows_reference(x, temperature, seeds, positions))
    assert tokens[0] % 2 == 0 and tokens[-1] == x[-1].argmax()
    strided = x[:, : cols - 1]
    assert torch.equal(
        sampling.sample_rows(strided, temperature, seeds, positions),
        sample_rows_reference(strided, temperature, seeds, positions),
    )


def test_sample_rows_into_out():
    """A decode graph draws into a buffer of its own (where the next replay carries its tokens from)."""
    x = torch.randn(5, 3000, device=DEVICE)
    draw = draws(5, 0.7)
    buffer = torch.full((9,), -1, dtype=torch.int64, device=DEVICE)
    assert sampling.sample_rows(x, *draw, out=buffer[:5]).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:5], sample_rows_reference(x, *draw)) and buffer[5:].eq(-1).all()
    assert torch.equal(sample_rows_reference(x, *draw, out=buffer[:5]), buffer[:5])
    with pytest.raises(ValueError, match="5 contiguous int64 tokens"):
        sampling.sample_rows(x, *draw, out=buffer[:4])


@pytest.mark.parametrize("rows,cols", [(5, 3000), (3, 700)] + ([(37, 151936)] if CUDA else []))
def test_sample_rows_advance_a_decode_graphs_inputs(rows, cols):
    """With `advance`, the rows draw what they draw without it (at the draw positions before the advance), then
    every row whose slot is not -1 moves its token position, slot, sequence length and draw position one on;
    padding rows (slot -1) keep theirs. Several slices a row (3000 columns) and one (700)."""
    x = torch.randn(rows, cols, device=DEVICE)
    temperature, seeds, positions = draws(rows, 0.7)
    temperature[0] = 0.0
    expected = sample_rows_reference(x, temperature, seeds, positions)
    token_positions = torch.arange(rows, device=DEVICE) * 10 + 3
    slots = torch.arange(rows, device=DEVICE) * 16 + 5
    slots[-1] = -1  # padding
    seq_lens = (token_positions + 1).int()
    before = [t.clone() for t in (positions, token_positions, slots, seq_lens)]
    for impl in (sampling.sample_rows, sample_rows_reference):
        fields = [t.clone() for t in before]
        out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        impl(x, temperature, seeds, fields[0], out=out, advance=tuple(fields[1:]))
        assert torch.equal(out, expected)
        for field, old in zip(fields, before, strict=True):
            step = torch.ones_like(old)
            step[-1] = 0
            assert field.dtype == old.dtype and torch.equal(field, old + step)
    with pytest.raises(ValueError, match="advances a contiguous token position"):
        sampling.sample_rows(x, temperature, seeds, positions, advance=(token_positions[:1], slots, seq_lens))


@pytest.mark.parametrize("n", [1, 7, 300])
def test_carry_tokens(n):
    """Carried rows take their sampled token, in any order and across programs; rows of -1 change nothing."""
    generator = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1000, (n + 5,), generator=generator).to(DEVICE)
    carry_to = torch.randperm(n + 5, generator=generator)[:n].to(DEVICE)
    carry_to[torch.rand(n, generator=generator).to(DEVICE) < 0.3] = -1
    carry_from = torch.randint(0, 2 * n, (n,), generator=generator).to(DEVICE)
    sampled = torch.randint(5000, 6000, (2 * n,), generator=generator).to(DEVICE)
    expected = ids.clone()
    carry_tokens_reference(expected, carry_to, carry_from, sampled)
    for i in range(n):  # the reference, spelled out
        if carry_to[i] >= 0:
            assert expected[carry_to[i]] == sampled[carry_from[i]]
    untouched = torch.ones_like(ids, dtype=torch.bool)
    untouched[carry_to[carry_to >= 0]] = False
    assert torch.equal(expected[untouched], ids[untouched])
    sampling.carry_tokens(ids, carry_to, carry_from, sampled)
    assert torch.equal(ids, expected)


@pytest.mark.parametrize("seed,position,column", [(35266, 7, 1415), (1, 26, 1058)])
def test_sample_rows_noise_of_all_ones_stays_finite(seed, position, column):
    """Entries whose noise bits are all ones but the last few (found by search; 0xffffffcc, 0xffffff9d): a uniform of
    24 bits rounded them to 1.0 (a score of +inf, NaN at a -inf logit), which drew columns past the row (the next
    step's embedding read out of bounds) and -inf logits. Past the row, or at -inf, such an entry is never drawn."""
    temperature = torch.tensor([0.8], device=DEVICE)
    seeds, positions = torch.tensor([seed], device=DEVICE), torch.tensor([position], dtype=torch.int32, device=DEVICE)
    short = torch.randn(1, column - 100, device=DEVICE)  # the entry lies in the slice's masked columns
    masked = torch.randn(1, column + 500, device=DEVICE)
    masked[0, column] = float("-inf")
    for x in (short, masked):
        token = sampling.sample_rows(x, temperature, seeds, positions)
        assert torch.equal(token, sample_rows_reference(x, temperature, seeds, positions))
        assert token.item() < x.shape[1] and x[0, token.item()] > float("-inf")


def test_sample_rows_reference_draws_from_softmax():
    """The reference (which the kernel matches) draws from softmax(logits / T): 20,000 draws of a 6-way
    distribution, each frequency within 5 standard deviations; one (seed, position) always draws the same token,
    and the draws of neighbouring seeds or positions are not the same."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, float("-inf")])
    n, temperature = 20_000, 0.8
    rows = logits.expand(n, -1)
    seeds = torch.arange(n) * 7919 + 3
    tokens = sample_rows_reference(rows, torch.full((n,), temperature), seeds, torch.full((n,), 17))
    frequencies = torch.bincount(tokens, minlength=6).double() / n
    expected = (logits / temperature).double().softmax(-1)
    assert frequencies[5] == 0
    assert ((frequencies - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt()).all(), frequencies
    again = sample_rows_reference(rows[:64], torch.full((64,), temperature), seeds[:64], torch.full((64,), 17))
    assert torch.equal(again, tokens[:64])
    moved = sample_rows_reference(rows[:64], torch.full((64,), temperature), seeds[:64], torch.full((64,), 18))
    assert not torch.equal(moved, tokens[:64])


@pytest.mark.parametrize("group", [0, 16, 128])
@pytest.mark.parametrize("shape", [(7, 40), (5, 3, 24)] + ([(37, 4096), (3, 1000)] if CUDA else []))
def test_quant_fp8_per_token(shape, group):
    """A scale per token, or per token and `group` columns (the last group partial, or wider than the row)."""
    x = randn(*shape, scale=5.0)
    x[0] = 0  # an all-zero row takes the scale floor
    q, scale = quant.quant_fp8_per_token(x, group)
    q_ref, scale_ref = quant_fp8_per_token_reference(x, group)
    assert torch.equal(scale[0], scale_ref[0]) and torch.equal(q[0].float(), q_ref[0].float())
    assert_fp8_close((q, scale), (q_ref, scale_ref), group)


LINEAR_CONFIGS = [  # (m, config): the one-token GEMV (weight first: K slices of one tile), uneven K splits, MMAs
    (1, None),
    (1, gemm.SkinnyConfig(8, 128, 3, 2, 2, False)),
    (1, gemm.SkinnyConfig(4, 64, 4, 4, 1, False)),
    (3, None),
    (5, gemm.SkinnyConfig(32, 64, 3, 4, 3, True)),
    (16, gemm.SkinnyConfig(64, 32, 2, 4, 2, True)),
]


@pytest.mark.parametrize("m,config", LINEAR_CONFIGS)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(m, config, bias):
    """The skinny GEMM without scales: `linear` for decode-sized M (same-dtype x and weight)."""
    n, k = 70, 200  # partial row tiles, K not a multiple of any tile
    x, w = randn(m, k), randn(n, k, scale=0.05)
    b = randn(n) if bias else None
    poison_allocator((m, n), DTYPE)
    out = gemm.run_skinny_mm(x, None, w, None, b, DTYPE, (1, k), config)
    assert_close(out, linear_reference(x, w, b))
    assert not common.ticket_counters(x.device, 1).any()  # split-K merges reset their tickets


PROLOGUES = ["rms_norm", "add_rms_norm", "silu_mul"]


def fused_linear_case(prologue: str, m: int, n: int, k: int, dtype: torch.dtype = DTYPE):
    """Inputs of a fused linear, the reference outputs, and the skinny kernel's prologue (with its sum buffer)."""
    w, b, g = randn(n, k, dtype=dtype, scale=0.05), randn(n, dtype=dtype), randn(k, dtype=dtype)
    if prologue == "silu_mul":
        x = randn(m, 2 * k, dtype=dtype, scale=2.0)
        return (x, w, b), (silu_and_mul_linear_reference(x, w, b),), gemm.SiluMulPrologue()
    x, residual = randn(m, k, dtype=dtype, scale=3.0), randn(m, k, dtype=dtype)
    if prologue == "rms_norm":
        return (x, g, 1e-6, w, b), (rms_norm_linear_reference(x, g, 1e-6, w, b),), gemm.RMSNormPrologue(g, 1e-6)
    summed = torch.full_like(x, float("nan"))
    reference = fused_add_rms_norm_linear_reference(x, residual, g, 1e-6, w, b)
    return (x, residual, g, 1e-6, w, b), reference, gemm.RMSNormPrologue(g, 1e-6, residual, summed)


GEMV_CONFIGS = [  # weight-first (one tile a program; and split in K slices of one tile), and a pipelined loop
    None,
    gemm.SkinnyConfig(4, 64, 4, 4, 1, False),
    gemm.SkinnyConfig(8, 128, 3, 2, 2, False),
    gemm.SkinnyConfig(16, 64, 1, 4, 3, False),
    gemm.SkinnyConfig(8, 256, 1, 4, 1, False, max_registers=80),
    gemm.SkinnyConfig(8, 128, 2, 4, 1, False, max_registers=80),  # split, which the norm and the gated GEMV undo
]


@pytest.mark.parametrize("n,k,weight_bytes", [(1024, 3072, 2), (4096, 1024, 2), (1024, 2048, 1), (4096, 4096, 2)])
def test_gemv_config(n, k, weight_bytes):
    """One token: weights up to GEMV_WEIGHT_FIRST_MAX_BYTES take K slices of one tile (weight first), larger ones
    the loop."""
    config = gemm.skinny_config(1, n, k, k, torch.device("cpu"), weight_bytes)
    assert not config.dot
    slice_cols = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    tile_bytes = config.block_n * config.block_k * weight_bytes
    weight_first = slice_cols == config.block_k and tile_bytes <= gemm.GEMV_TILE_BYTES
    assert weight_first == (n * k * weight_bytes <= gemm.GEMV_WEIGHT_FIRST_MAX_BYTES)


def test_gemv_register_cap():
    """A weight-first GEMV whose programs would not all be resident gets its registers capped so they are, but not
    below what compiles without spills, and not where they fit anyway."""
    gate_up = gemm._weight_first_gemv_config(6144, 1024, 2, 132)  # Qwen3-0.6B: 768 programs, 6 a multiprocessor
    assert (gate_up.block_n, gate_up.max_registers) == (8, 80)
    assert gemm._weight_first_gemv_config(4096, 1024, 2, 132).max_registers is None  # 512 programs: 4 fit anyway
    assert gemm._weight_first_gemv_config(6144, 1024, 2, 66).max_registers is None  # 12 a multiprocessor: too few


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("dtype", [DTYPE, torch.float16])
def test_skinny_linear_prologue(config, prologue, dtype):
    """The one-token GEMV with the op in front of a projection fused in (a split-K config: RMSNorm runs unsplit)."""
    n, k = 70, 200  # partial row tiles, K not a multiple of any tile
    args, reference, fused = fused_linear_case(prologue, 1, n, k, dtype)
    out = gemm.run_skinny_mm(args[0], None, args[-2], None, args[-1], dtype, (1, k), config, prologue=fused)
    assert_close(out, reference[0], tol=TOL if dtype == DTYPE else 1e-2)
    if prologue == "add_rms_norm":
        assert_close(fused.summed, reference[1], tol=1e-6)  # the residual sum rounds as torch's add does
    assert not common.ticket_counters(DEVICE, 1).any()
    with pytest.raises(ValueError, match="one-token GEMV"):
        mma = gemm.SkinnyConfig(32, 64, 1, 4, 3, True)
        gemm.run_skinny_mm(args[0], None, args[-2], None, args[-1], dtype, (1, k), mma, prologue=fused)


def test_skinny_linear_prologue_refuses_buffers_it_cannot_write():
    args, _, _ = fused_linear_case("add_rms_norm", 1, 8, 64)
    x, residual, g, eps, w, _ = args
    strided_sum = torch.empty(1, 128, dtype=DTYPE, device=DEVICE)[:, ::2]
    for prologue in (gemm.RMSNormPrologue(g, eps, residual), gemm.RMSNormPrologue(g, eps, residual, strided_sum)):
        with pytest.raises(ValueError, match="sum buffer"):
            gemm.run_skinny_mm(x, None, w, None, None, DTYPE, (1, 64), prologue=prologue)
    with pytest.raises(ValueError, match="contiguous vector"):
        strided_weight = torch.ones(128, dtype=DTYPE, device=DEVICE)[::2]
        gemm.run_skinny_mm(x, None, w, None, None, DTYPE, (1, 64), prologue=gemm.RMSNormPrologue(strided_weight, eps))


@pytest.mark.parametrize("m", [1, 2] + ([13, 16, 17, 300] if CUDA else []))
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fused_linear_dispatch(m, prologue):
    """The triton fused linears match their references for one token (the fused GEMV) and more (the op's kernel,
    then `linear`: the skinny MMA, or cuBLAS beyond 16); bf16, on CPU M = 2 in fp32 (the fallback)."""
    dtype = torch.bfloat16 if CUDA or m == 1 else torch.float32
    args, reference, _ = fused_linear_case(prologue, m, 40, 136, dtype)
    run = {"rms_norm": gemm.rms_norm_linear, "add_rms_norm": gemm.fused_add_rms_norm_linear}
    outputs = run.get(prologue, gemm.silu_and_mul_linear)(*args)
    for out, ref in zip(outputs if prologue == "add_rms_norm" else (outputs,), reference, strict=True):
        assert_close(out, ref, tol=1e-2)


@pytest.mark.parametrize("m", [1, 2] + ([13, 16, 17, 300] if CUDA else []))
def test_linear_dispatch(m):
    """The triton `linear` matches F.linear on both sides of its skinny-kernel threshold (3-D input, bf16).

    On CPU only the one-token GEMV runs the kernel (the interpreter's bf16 `tl.dot` is wrong); M = 2 there
    checks that the dispatch falls back for an fp32 weight."""
    dtype = torch.bfloat16 if CUDA or m == 1 else torch.float32
    x, w = randn(1, m, 136, dtype=dtype), randn(40, 136, dtype=dtype, scale=0.05)
    assert_close(gemm.linear(x, w, None), linear_reference(x, w, None), tol=1e-2)


@pytest.mark.parametrize("m,config", LINEAR_CONFIGS[:3] + ([(5, None), (300, None)] if CUDA else []))
def test_logits(m, config):
    """The LM head's fp32 logits: each one x's dtype (bf16) rounded, as `linear` then `.float()`; the one-token GEMV
    on CPU (split, weight-first and pipelined configs), MMAs and cuBLAS on the GPU."""
    x, w = randn(m, 136, dtype=torch.bfloat16), randn(300, 136, dtype=torch.bfloat16, scale=0.05)
    if config is None:
        out = gemm.logits(x, w)
    else:
        out = gemm.run_skinny_mm(x, None, w, None, None, torch.float32, (1, 136), config, round_to_x=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, out.bfloat16().float(), rtol=0, atol=0)  # rounded to bf16 values
    assert_close(out, logits_reference(x, w), tol=1e-2)


def mlp_case(m: int, hidden: int, inter: int, fp8_gate_up: bool, fp8_down: bool, dtype: torch.dtype = DTYPE):
    """`fused_add_rms_norm_mlp`'s arguments: x, residual, norm weight, eps, then gate_up's and down's weight, scale
    (per channel where FP8, else None) and bias, and the output dtype."""
    x, residual, g = randn(m, hidden, dtype=dtype, scale=3.0), randn(m, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    projections = []
    for rows, cols, fp8 in ((2 * inter, hidden, fp8_gate_up), (hidden, inter, fp8_down)):
        w = randn(rows, cols, dtype=dtype, scale=0.05)
        w, scale = quantize_weight(w, "per_channel") if fp8 else (w, None)
        projections += [w, scale, randn(rows, dtype=dtype)]
    return (x, residual, g, 1e-6, *projections, dtype)


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("fp8", [False, True])
def test_gated_gemv(config, fp8):
    """The one-token gate_up GEMV with SiLU·mul in its epilogue (and the norm prologue): odd sizes (partial row
    tiles, K not a multiple of any tile); split configs run unsplit."""
    x, residual, g, eps, w, scale, bias, *_ = mlp_case(1, 200, 35, fp8, False)
    summed = torch.full_like(x, float("nan"))
    prologue = gemm.RMSNormPrologue(g, eps, residual, summed)
    act = gemm.run_skinny_mm(x, None, w, scale, bias, DTYPE, (1, 200), config, prologue=prologue, gated=True)
    if fp8:
        gate_up, reference_sum = fused_add_rms_norm_fp8_linear_reference(x, residual, g, eps, w, scale, bias, DTYPE)
    else:
        gate_up, reference_sum = fused_add_rms_norm_linear_reference(x, residual, g, eps, w, bias)
    assert_close(act, silu_and_mul_reference(gate_up))
    assert_close(summed, reference_sum, tol=1e-6)
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemm.run_skinny_mm(x, None, w[:-1], None if scale is None else scale[:-1], None, DTYPE, (1, 200), gated=True)


@pytest.mark.parametrize("m", [1, 2] + ([13, 17, 300] if CUDA else []))
@pytest.mark.parametrize("fp8_gate_up,fp8_down", [(False, False), (True, True), (True, False)])
def test_mlp_dispatch(m, fp8_gate_up, fp8_down):
    """`fused_add_rms_norm_mlp`'s Triton implementation against its reference (the two fused ops in a row): one
    token through the gated GEMV and the plain down GEMV; more through the two ops (on CPU: M = 2 in fp32 for bf16
    projections, the fallback; FP8 ones need the GPU's `scaled_mm`)."""
    if m > 1 and not CUDA and (fp8_gate_up or fp8_down):
        pytest.skip("FP8 projections of several tokens run scaled_mm, which needs a GPU")
    dtype = torch.bfloat16 if CUDA or m == 1 else torch.float32
    args = mlp_case(m, 136, 40, fp8_gate_up, fp8_down, dtype)
    for out, ref in zip(gemm.fused_add_rms_norm_mlp(*args), fused_add_rms_norm_mlp_reference(*args), strict=True):
        assert_close(out, ref, tol=2e-2 if fp8_gate_up or fp8_down else 1e-2)


@gpu_only
@pytest.mark.parametrize("hidden,inter", [(1024, 3072), (4096, 14336)])
@pytest.mark.parametrize("fp8", [False, True])
def test_mlp_gpu_shapes(hidden, inter, fp8):
    """Qwen3-0.6B's and Llama-3-8B's MLP, one token (weight-first and pipelined gate_up GEMVs)."""
    args = mlp_case(1, hidden, inter, fp8, fp8)
    for out, ref in zip(gemm.fused_add_rms_norm_mlp(*args), fused_add_rms_norm_mlp_reference(*args), strict=True):
        assert_close(out, ref, tol=2e-2)


@gpu_only
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (4, 6144, 4096), (16, 1024, 3072), (8, 151936, 1024)])
def test_skinny_linear_gpu_shapes(m, n, k):
    x, w = randn(m, k), randn(n, k, scale=0.02)
    assert_close(gemm.run_skinny_mm(x, None, w, None, None, DTYPE, (1, k)), linear_reference(x, w, None))


@gpu_only
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 4096), (1024, 3072), (4096, 14336)])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_skinny_linear_prologue_gpu_shapes(n, k, prologue):
    args, reference, fused = fused_linear_case(prologue, 1, n, k)
    out = gemm.run_skinny_mm(args[0], None, args[-2], None, args[-1], DTYPE, (1, k), prologue=fused)
    assert_close(out, reference[0])


def fused_qkv(tokens: int, q_heads: int, kv_heads: int, head_dim: int):
    """q, k, v as [tokens, heads, head_dim] views into one fused projection, as models slice them."""
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def rope_table(head_dim: int, max_positions: int = 300) -> torch.Tensor:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return rope_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, scaling), max_positions).to(DEVICE)


# (one token: its heads spread over a program a KV head, see `head_programs`)
ROPE_CASES = [(7, 4, 2, 16), (5, 3, 3, 32), (6, 8, 2, 12), (1, 4, 2, 16), (1, 7, 1, 32)] + (
    [(37, 32, 8, 128), (19, 16, 4, 64)] if CUDA else []
)


@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", ROPE_CASES)
def test_rotary_embedding(tokens, q_heads, kv_heads, head_dim):
    q, k, _ = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    table = rope_table(head_dim)
    positions = torch.randint(0, table.shape[0], (tokens,), device=DEVICE)
    q_out, k_out = rotary_cache.rotary_embedding(positions, q, k, table)
    q_ref, k_ref = rotary_embedding_reference(positions, q, k, table)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)


def kv_cache_and_slots(tokens: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """A random (not zero) cache and scattered slots, two of them -1 (padding) where there are more than two."""
    num_blocks = tokens // block_size + 3
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    if tokens > 2:
        slots[1] = -1
        slots[-1] = -1
    return cache, slots


CACHE_DTYPES = [DTYPE, FP8_DTYPE]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", ROPE_CASES)
def test_reshape_and_cache(tokens, q_heads, kv_heads, head_dim, cache_dtype):
    _, k, v = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, 4, cache_dtype)
    expected = cache.clone()
    rotary_cache.reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_reference(k, v, expected, slots)
    if cache_dtype == FP8_DTYPE:  # conversion to fp8 may round a tie differently from torch's
        assert_close(cache, expected)
    else:
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", ROPE_CASES)
def test_rope_and_cache(tokens, q_heads, kv_heads, head_dim, cache_dtype):
    q, k, v = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    table = rope_table(head_dim)
    positions = torch.randint(0, table.shape[0], (tokens,), device=DEVICE)
    cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, 8, cache_dtype)
    expected = cache.clone()
    q_out = rotary_cache.rope_and_cache(positions, q, k, v, table, cache, slots)
    q_ref = rope_and_cache_reference(positions, q, k, v, table, expected, slots)
    assert_close(q_out, q_ref)
    assert_close(cache, expected)


def qkv_case(tokens, hidden, q_heads, kv_heads, head_dim, fp8, residual, cache_dtype, dtype, block_size=4):
    """`qkv_rope_and_cache`'s arguments: x, residual (or None), norm weight, eps, the [q; k; v] weight, its scale (per
    channel where FP8) and bias, out_dtype, positions, cos/sin, cache, slots, q heads, and per-tensor scales for an FP8
    cache."""
    x, g = randn(tokens, hidden, dtype=dtype, scale=3.0), randn(hidden, dtype=dtype)
    rows = (q_heads + 2 * kv_heads) * head_dim
    w, scale = randn(rows, hidden, dtype=dtype, scale=0.05), None
    if fp8:
        w, scale = quantize_weight(w, "per_channel")
    table = rope_table(head_dim)
    positions = torch.randint(0, table.shape[0], (tokens,), device=DEVICE)
    cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, block_size, cache_dtype)
    scales = [torch.tensor([s], device=DEVICE) for s in (0.5, 2.0)] if cache_dtype == FP8_DTYPE else [None, None]
    residual = randn(tokens, hidden, dtype=dtype) if residual else None
    bias = randn(rows, dtype=dtype)
    return (
        x,
        residual,
        g,
        1e-6,
        w,
        scale,
        bias,
        dtype if fp8 else None,
        positions,
        table,
        cache,
        slots,
        q_heads,
        *scales,
    )


def check_qkv_rope_and_cache(args, tol, monkeypatch):
    """The Triton op against its reference; one token must take the GEMV's epilogue, not the composition."""
    if args[0].shape[0] == 1:
        monkeypatch.setattr(gemm, "_qkv_then_rope", lambda *_: pytest.fail("one token took the composition"))
    expected = args[10].clone()
    q, summed = gemm.qkv_rope_and_cache(*args)
    monkeypatch.undo()
    q_ref, summed_ref = qkv_rope_and_cache_reference(*args[:10], expected, *args[11:])
    assert_close(q, q_ref, tol)
    assert summed.shape == summed_ref.shape and torch.equal(summed, summed_ref)  # the sum rounds as torch's add
    assert_close(args[10], expected, tol)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_qkv_rope_and_cache(tokens, fp8, residual, cache_dtype, monkeypatch):
    """The qkv GEMV with RoPE and the cache write in its epilogue (one token; the slot of a padding token, -1, is
    left alone), and the fused projection op then `rope_and_cache` for more; odd sizes (3 q heads, hidden 71)."""
    if tokens > 1 and fp8 and not CUDA:
        pytest.skip("FP8 projections of several tokens run scaled_mm, which needs a GPU")
    dtype = DTYPE if fp8 or CUDA else torch.float16  # bf16/fp16 weights take the GEMV; the interpreter's fp16 is right
    args = qkv_case(tokens, 71, 3, 1, 16, fp8, residual, cache_dtype, dtype)
    check_qkv_rope_and_cache(args, 2e-2, monkeypatch)
    twelve_wide = qkv_case(tokens, 40, 2, 1, 12, fp8, residual, cache_dtype, dtype)  # tiles of 4 rows a program
    check_qkv_rope_and_cache(twelve_wide, 2e-2, monkeypatch)
    if tokens == 1:  # padding: nothing written
        args[11].fill_(-1)
        check_qkv_rope_and_cache(args, 2e-2, monkeypatch)


def test_qkv_rope_epilogue_refuses_what_it_cannot_write():
    """Heads that do not add up to the weight's rows, and a second epilogue, are errors, not silent writes."""
    x, residual, g, eps, w, scale, bias, out_dtype, *rope_args = qkv_case(1, 71, 3, 1, 16, True, True, DTYPE, DTYPE)
    positions, table, cache, slots, q_heads, *_ = rope_args
    prologue = gemm.RMSNormPrologue(g, eps, residual, torch.empty_like(x))
    for heads, gated in ((2, False), (q_heads, True)):
        rope = gemm.RopeCacheEpilogue(positions, table, cache, slots, heads)
        with pytest.raises(ValueError, match="RoPE epilogue|one epilogue"):
            gemm.run_skinny_mm(x, None, w, scale, bias, DTYPE, (1, 71), prologue=prologue, rope_cache=rope, gated=gated)


@gpu_only
@pytest.mark.parametrize("hidden,q_heads,kv_heads,head_dim", [(4096, 32, 8, 128), (1024, 16, 8, 128), (512, 8, 2, 64)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_qkv_rope_and_cache_gpu_shapes(hidden, q_heads, kv_heads, head_dim, fp8, cache_dtype, monkeypatch):
    """Llama-3-8B's attention front (pipelined GEMV), smaller ones (weight-first GEMVs) and head_dim 64."""
    args = qkv_case(1, hidden, q_heads, kv_heads, head_dim, fp8, True, cache_dtype, DTYPE, block_size=16)
    check_qkv_rope_and_cache(args, 2e-2, monkeypatch)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", ROPE_CASES)
def test_qk_norm_rope_and_cache(tokens, q_heads, kv_heads, head_dim, cache_dtype):
    q, k, v = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    q_w, k_w = randn(head_dim), randn(head_dim)
    table = rope_table(head_dim)
    positions = torch.randint(0, table.shape[0], (tokens,), device=DEVICE)
    cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, 8, cache_dtype)
    expected = cache.clone()
    args = (positions, q, k, v, q_w, k_w, 1e-6, table)
    q_out = rotary_cache.qk_norm_rope_and_cache(*args, cache, slots)
    q_ref = qk_norm_rope_and_cache_reference(*args, expected, slots)
    assert_close(q_out, q_ref)
    assert_close(cache, expected)


def attention_batch(
    lens: list[tuple[int, int]], q_heads: int, kv_heads: int, head_dim: int, block_size: int, padding: int, kv_dtype
):
    """A mixed batch: (query_len, seq_len) per sequence, scattered blocks, `padding` tokens at the end."""
    max_blocks = max(-(-seq_len // block_size) for _, seq_len in lens) + 2
    num_blocks = len(lens) * max_blocks + 5
    order = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device=DEVICE)  # unused entries 0
    for i, (_, seq_len) in enumerate(lens):
        n = -(-seq_len // block_size)
        block_tables[i, :n] = order[i * max_blocks : i * max_blocks + n].int()
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    query_lens = torch.tensor([q for q, _ in lens])
    query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32, device=DEVICE)
    tokens = int(query_lens.sum()) + padding
    # q as a strided view of a wider tensor, as attention gets it from a fused projection.
    q = randn(tokens, q_heads + kv_heads, head_dim)[:, :q_heads]
    return q, cache, block_tables, seq_lens, query_start_loc


# (query_len, seq_len): fresh prefill, decode, chunk with cached context, one-token sequence,
# an empty sequence (query_len 0), a decode whose context ends exactly on a block boundary.
MIXED = [(5, 5), (1, 23), (4, 19), (1, 1), (0, 7), (1, 16), (9, 30)]
ATTN_CASES = [
    # q_heads, kv_heads, head_dim, block_size, batch
    (4, 4, 16, 4, MIXED),
    (4, 2, 32, 16, MIXED),
    (8, 2, 16, 8, MIXED),
    (2, 1, 16, 16, [(1, 37)]),
    (4, 2, 16, 4, [(13, 13), (3, 40)]),
]


def check_attention(
    q_heads, kv_heads, head_dim, block_size, lens, padding=3, kv_dtype=DTYPE, tol=ATTN_TOL, config=None
):
    q, cache, tables, seq_lens, qsl = attention_batch(lens, q_heads, kv_heads, head_dim, block_size, padding, kv_dtype)
    scale = head_dim**-0.5
    poison_allocator(q.shape, q.dtype)
    config = config or attention.default_config(head_dim)
    out = attention.run_paged_attention(q, cache, tables, seq_lens, qsl, scale, config)
    ref = paged_attention_reference(q, cache, tables, seq_lens, qsl, scale)
    real = int(qsl[-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padding tokens must read as zeros"
    assert_close(out, ref, tol)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,lens", ATTN_CASES)
def test_paged_attention(q_heads, kv_heads, head_dim, block_size, lens):
    check_attention(q_heads, kv_heads, head_dim, block_size, lens)


def test_paged_attention_many_sequences():
    """More sequences than one search block of the tile kernel holds."""
    lens = [(1, 3 + i % 17) for i in range(530)]
    lens[300] = (6, 20)
    check_attention(2, 1, 16, 4, lens)


def splitting_config(head_dim: int) -> attention.AttentionConfig:
    """Decode splits of 16 keys, up to 16 programs a multiprocessor: the CPU tests' short contexts split and merge
    (with the default's one program a multiprocessor and 128-key tiles, a batch on 4 "multiprocessors" never does)."""
    return dataclasses.replace(
        attention.default_config(head_dim), decode_block_n=16, decode_waves=16, lone_decode_waves=16, split_keys=16
    )


@pytest.mark.parametrize("beside", [True, False])
def test_paged_attention_prefill_tile_sizes(beside):
    """Both tile sizes a step's prefill tiles can take, each against the reference: a chunk short of a wave of large
    tiles among decodes, and one past it; on a GPU, launched beside the decode programs on a stream of their own and
    after them on the same one."""
    config = dataclasses.replace(
        attention.default_config(16), block_m=64, small_block_m=16, small_warps=2, tiles_beside_decodes=beside
    )
    wave = 32 * -(-common.multiprocessors(torch.device(DEVICE)) // 2)  # tokens of a wave of 32-token tiles, 2 heads
    for lens, block_q in (([(1, 23), (20, 20), (1, 9)], 8), ([(1, 23), (wave + 1, wave + 1), (1, 3)], 32)):
        tokens = sum(n for n, _ in lens)
        assert attention.prefill_tiles(tokens, len(lens), 2, 2, config, torch.device(DEVICE))[0] == block_q
        check_attention(4, 2, 16, 4, lens, config=config)


def test_paged_attention_trailing_empty_sequences():
    """A FULL graph's mixed step: sequences padded with empty ones (all starting where the step's tokens end), then
    tokens of no sequence; with both tile sizes and split decodes."""
    lens = [(1, 23), (6, 14), (1, 5), (0, 1), (0, 1), (0, 1)]
    for config in (splitting_config(16), dataclasses.replace(attention.default_config(16), small_block_m=16)):
        for padding in (5, 0):  # none: the empty sequences start past the last token
            check_attention(4, 2, 16, 4, lens, padding=padding, config=config)


def test_paged_attention_split_tickets_reset():
    """The last decode split resets its arrival counter, so back-to-back calls merge correctly."""
    for lens in ([(1, 23), (1, 5), (3, 9)], [(1, 40), (2, 7), (1, 12), (1, 2)]):
        check_attention(4, 2, 16, 4, lens, config=splitting_config(16))
    assert not common.ticket_counters(torch.empty(0, device=DEVICE).device, 1).any()


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (8, 1, 32, 16), (4, 4, 16, 8)])
def test_paged_attention_decode_only_batch(q_heads, kv_heads, head_dim, block_size):
    """One query token a sequence and no padding: the decode-only kernel, with several splits to merge."""
    config = splitting_config(head_dim)
    lens = [(1, 23), (1, 5), (1, 40), (1, 1), (1, 16)]
    check_attention(q_heads, kv_heads, head_dim, block_size, lens, padding=0, config=config)
    check_attention(q_heads, kv_heads, head_dim, block_size, [(1, 37)], padding=0, config=config)
    check_attention(q_heads, kv_heads, head_dim, block_size, lens, padding=0)  # the default: no split


@pytest.mark.parametrize("padding", [0, 2])
def test_paged_attention_decode_tiles(padding):
    """Decode splits of one key tile and of several, with a partial last tile (the other CPU tests' contexts fit
    one 128-key tile): 16-key decode tiles and one program a multiprocessor (on CPU, 4: 1-2 splits a sequence);
    32-key tiles where the batch takes no split."""
    config = dataclasses.replace(
        attention.default_config(16),
        decode_block_n=16,
        unsplit_block_n=32,
        decode_waves=1,
        lone_decode_waves=1,
        split_keys=16,
    )
    check_attention(4, 2, 16, 4, [(1, 37)], padding=padding, config=config)  # 2 splits of 2 tiles, the last partial
    check_attention(4, 2, 16, 4, [(1, 30)], padding=padding, config=config)  # 2 splits of one tile
    check_attention(4, 2, 16, 4, [(1, 30), (1, 16), (1, 1), (1, 33)], padding=padding, config=config)  # 1 split


def test_paged_attention_merges_many_splits():
    """32 splits to merge (the other tests' few), in 16-key tiles: of a 1000-key context (2 tiles each, the last
    partial) and of a 530-key one (2 tiles each, so splits 17-31 find no keys); merged all at once, and 8 at a time
    (every head's 8 splits a load)."""
    config = dataclasses.replace(attention.default_config(16), decode_block_n=16, lone_decode_waves=16)
    for merge_elements in (8192, 2 * 16 * 8):
        config = dataclasses.replace(config, merge_elements=merge_elements)
        check_attention(4, 2, 16, 16, [(1, 1000)], padding=0, config=config)
        check_attention(4, 2, 16, 16, [(1, 530)], padding=0, config=config)


def test_paged_attention_lone_odd_splits():
    """A lone sequence's splits come alternately from the grid's two halves (`LONE`): odd split counts (on the
    interpreter's 4 "multiprocessors"), with every split holding keys, and with the last ones empty (chunks rounded
    to whole tiles: 100 keys over 5 splits take chunks of 32)."""
    for waves in (5, 7):
        config = dataclasses.replace(attention.default_config(16), decode_block_n=16, lone_decode_waves=waves)
        if not CUDA:
            assert attention.decode_splits(1, 4, config, DEVICE) == waves
        for seq_len in (200, 100, 37):
            check_attention(8, 4, 16, 16, [(1, seq_len)], padding=0, config=config)


def test_paged_attention_lone_narrow_table(monkeypatch):
    """A lone sequence's launch takes no more splits than its block table has tiles (at least 2): the runner's short
    batch-1 graph passes the first columns of its table, a view whose rows keep the full table's stride (a batch's
    rows too, in a mixed launch)."""
    config = dataclasses.replace(attention.default_config(16), decode_block_n=16, decode_waves=16, lone_decode_waves=16)
    assert attention.decode_splits(1, 4, config, torch.device("cpu")) == 16
    assert attention.decode_splits(1, 4, config, torch.device("cpu"), max_keys=5 * 16) == 5
    assert attention.decode_splits(1, 4, config, torch.device("cpu"), max_keys=8) == 2
    assert attention.decode_splits(2, 4, config, torch.device("cpu"), max_keys=8) > 2  # batches: the waves alone
    splits, decode_splits = [], attention.decode_splits
    monkeypatch.setattr(attention, "decode_splits", lambda *a, **k: splits.append(decode_splits(*a, **k)) or splits[-1])
    cases = [([(1, 37)], 10, 5), ([(1, 80)], 10, 5), ([(1, 16)], 2, 2), ([(1, 30), (4, 20), (1, 45)], 7, None)]
    for lens, columns, expected_splits in cases:
        q, cache, tables, seq_lens, qsl = attention_batch(lens, 4, 2, 16, 8, 0, DTYPE)
        wide = torch.full((len(lens), 40), 10**6, dtype=tables.dtype, device=DEVICE)  # past the contexts: never read
        wide[:, : tables.shape[1]] = tables
        out = attention.run_paged_attention(q, cache, wide[:, :columns], seq_lens, qsl, 16**-0.5, config)
        assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 16**-0.5), ATTN_TOL)
        assert expected_splits is None or splits[-1] == expected_splits


def test_paged_attention_split_keys():
    """In a batch, a split for every 48 keys of 16-key tiles (the case: 100 keys take 3 splits, the last partial; 30
    take 1), in decode-only and mixed launches with padding; a lone sequence splits by the tile (100 keys: 7)."""
    config = dataclasses.replace(attention.default_config(16), decode_block_n=16, decode_waves=16, split_keys=48)
    assert attention.decode_splits(3, 2, config, torch.device("cpu")) >= 3
    check_attention(4, 2, 16, 16, [(1, 100), (1, 30)], padding=0, config=config)
    check_attention(4, 2, 16, 16, [(1, 100), (5, 30), (1, 60)], padding=2, config=config)
    check_attention(4, 2, 16, 16, [(1, 100)], padding=0, config=dataclasses.replace(config, lone_decode_waves=16))


def test_paged_attention_fp8_cache():
    check_attention(4, 2, 32, 16, MIXED, kv_dtype=FP8_DTYPE)


def test_paged_attention_fp8_cache_half_queries():
    """16-bit queries over an FP8 cache: values widened to fp16 and p rounded to fp16 for the second product (the
    GPU's path; fp32 queries above keep fp32). fp16, not bf16: the interpreter's bf16 products are wrong."""
    q, cache, tables, seq_lens, qsl = attention_batch(MIXED, 4, 2, 32, 16, 3, FP8_DTYPE)
    q = q.half()
    out = attention.paged_attention(q, cache, tables, seq_lens, qsl, 32**-0.5)
    assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 32**-0.5), 5e-3)


def test_paged_attention_writes_then_reads_cache():
    """unified_attention's order: reshape_and_cache the new tokens, then attend over them."""
    lens = [(6, 6), (1, 11), (3, 14)]
    q, cache, tables, seq_lens, qsl = attention_batch(lens, 4, 2, 16, 4, 0, DTYPE)
    k, v = randn(q.shape[0], 2, 16), randn(q.shape[0], 2, 16)
    positions = torch.cat([torch.arange(s - n, s) for n, s in lens]).to(DEVICE)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor([n for n, _ in lens])).to(DEVICE)
    slots = tables[seq_of_token, positions // 4].long() * 4 + positions % 4
    expected = cache.clone()
    rotary_cache.reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_reference(k, v, expected, slots)
    out = attention.paged_attention(q, cache, tables, seq_lens, qsl, 0.25)
    assert_close(out, paged_attention_reference(q, expected, tables, seq_lens, qsl, 0.25), ATTN_TOL)


@gpu_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (16, 16), (28, 4)])
def test_paged_attention_gpu_shapes(q_heads, kv_heads, head_dim):
    lens = [(300, 300), (1, 1500), (77, 1100), (1, 33), (1, 4097), (129, 129), (2, 900)]
    check_attention(q_heads, kv_heads, head_dim, 16, lens, padding=5)
    check_attention(q_heads, kv_heads, head_dim, 16, [(1, 1500), (1, 33), (1, 4097), (1, 16)], padding=0)
    for lone in ([(1, 4097)], [(1, 432)], [(1, 16)]):  # a lone sequence's launch: split by the tile, its own stages
        check_attention(q_heads, kv_heads, head_dim, 16, lone, padding=0)
    # enough sequences that the launch splits no context: the unsplit variant (its tiles, a merge of one)
    many = [(1, 37 + 61 * i) for i in range(40)]
    check_attention(q_heads, kv_heads, head_dim, 16, many, padding=0)
    check_attention(q_heads, kv_heads, head_dim, 16, [(50, 50)] + many, padding=3)


@gpu_only
def test_paged_attention_gpu_fp8_cache_and_big_blocks():
    lens = [(200, 700), (1, 2049), (1, 64), (64, 64)]
    check_attention(32, 8, 128, 16, lens, kv_dtype=FP8_DTYPE)
    check_attention(32, 8, 128, 128, lens)


@gpu_only
def test_paged_attention_gpu_cuda_graph():
    """Captured once, replayed with other lengths: no host sync, sizes from shapes alone."""
    lens = [(1, 1000), (1, 5), (1, 2000), (1, 300)]
    q, cache, tables, seq_lens, qsl = attention_batch(lens, 32, 8, 128, 16, 2, DTYPE)
    attention.paged_attention(q, cache, tables, seq_lens, qsl, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.paged_attention(q, cache, tables, seq_lens, qsl, 0.1)
    seq_lens.copy_(torch.tensor([700, 6, 1500, 301], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 0.1), ATTN_TOL)


def test_kernels_lower_to_sm90_machine_code():
    """The kernels compile for an H100 (see tests/sm90_lowering.py), GPU or not."""
    script = Path(__file__).with_name("sm90_lowering.py")
    # this checkout's kernels, not those of wherever atom_models is installed from
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(script.parent.parent)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


KERNEL_KEYS = """
import json, sys
from triton.runtime.jit import JITFunction
from atom_models.ops.triton_kernels import activation, attention, common, gemm, norm, quant, rotary_cache, sampling
modules = (activation, attention, common, gemm, norm, quant, rotary_cache, sampling)
kernels = sorted(
    (f"{m.__name__}.{n}", f)
    for m in modules
    for n, f in vars(m).items()
    if isinstance(f, JITFunction) and n.endswith("_kernel")
)
print(json.dumps({name: f.cache_key for name, f in (reversed(kernels) if sys.argv[1] == "reverse" else kernels)}))
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_kernels_compile_in():
    """Triton adds a global constexpr that a helper reads to a caller's cache key only if the helper's own key was
    computed first. A helper that several kernels call must not read one: the keys would depend on which kernel was
    compiled first, and serving (its own order) would miss the Triton cache the artifact ships and compile (as the
    FP8 case of test_gpu did, the first time `silu` read log2(e) from a global). Kernels are the entry points here:
    nothing computes a helper's key but its callers."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).parent.parent)}
    keys = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", KERNEL_KEYS, order], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for order in ("forward", "reverse")
    ]
    assert len(keys[0]) > 15 and keys[0] == keys[1], [name for name in keys[0] if keys[0][name] != keys[1][name]]
