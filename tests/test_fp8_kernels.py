"""FP8 numerics: quantize/dequantize error bounds, the scaled-matmul kernels and the FP8 KV cache against
their references.

Kernels run under Triton's interpreter on CPU (tests/conftest.py) on small inputs, with fp32
activations (the interpreter multiplies bf16 `tl.dot` operands wrongly) and torch's fp32 -> fp8
rounding (`exact_fp8_casts_in_interpreter`); the GPU-only cases add real sizes and cuBLASLt.
"""

from __future__ import annotations

import pytest
import torch

from atom_models.ops.attention import (
    inline_cache_views,
    inline_scale_cache_shape,
    paged_attention_reference,
    qk_norm_rope_and_cache_reference,
    reshape_and_cache_reference,
    rope_and_cache_reference,
)
from atom_models.ops.quant import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    fp8_linear_reference,
    fused_add_rms_norm_fp8_linear_reference,
    quant_fp8_per_token_reference,
    quantize_fp8_static,
    quantize_weight,
    rms_norm_fp8_linear_reference,
    scaled_mm_blockwise_reference,
    scaled_mm_reference,
    silu_and_mul_fp8_linear_reference,
)

triton = pytest.importorskip("triton")
from atom_models.ops.triton_kernels import attention, common, gemm, rotary_cache  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402, F401  (the fixture applies to this module too)
    ATTN_TOL,
    CUDA,
    DEVICE,
    DTYPE,
    MIXED,
    assert_close,
    attention_batch,
    exact_fp8_casts_in_interpreter,
    fused_qkv,
    kv_cache_and_slots,
    randn,
    rope_table,
    splitting_config,
)

gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself; below 2^-6 (subnormal)
# the spacing is 2^-9, so the error is at most 2^-10 of the scale.
FP8_REL, FP8_SUBNORMAL = 2.0**-4, 2.0**-10


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def assert_fp8_bound(x: torch.Tensor, dequantized: torch.Tensor, scale: torch.Tensor) -> None:
    """Every element within e4m3's rounding bound of the original, given its scale."""
    bound = torch.maximum(x.abs() * FP8_REL, scale * FP8_SUBNORMAL) * (1 + 1e-6)
    excess = ((x - dequantized).abs() - bound).max().item()
    assert excess <= 0, f"an element is {excess:.3g} beyond the fp8 rounding bound"


@pytest.mark.parametrize("scheme,block", [("per_tensor", None), ("per_channel", None), ("block", (128, 128))])
@pytest.mark.parametrize("shape", [(300, 200), (64, 128), (1, 7)])
def test_weight_round_trip(scheme, block, shape):
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitudes
    w_q, scale = quantize_weight(w, scheme, block)
    assert w_q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    expected_scale = {"per_tensor": (1,), "per_channel": (shape[0], 1)}.get(scheme)
    if block:
        expected_scale = (-(-shape[0] // 128), -(-shape[1] // 128))
    assert tuple(scale.shape) == expected_scale
    dequantized = dequantize_weight(w_q, scale, block)
    if block:
        per_element = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    else:
        per_element = scale.expand_as(w) if scale.numel() > 1 else scale
    assert_fp8_bound(w, dequantized, per_element)
    assert w_q.float().abs().max() <= FP8_MAX
    # the largest element of each scale group lands on ±448 exactly
    assert (w_q.float().abs() == FP8_MAX).any()


def test_activation_round_trips():
    x = torch.randn(9, 77) * 5
    x[3] = 0.0  # a zero row quantizes to zeros (the scale has a floor)
    q, scale = quant_fp8_per_token_reference(x)
    assert_fp8_bound(x, q.float() * scale, scale)
    assert torch.equal(q[3].float(), torch.zeros(77))
    static_scale = torch.tensor([x.abs().max().item() / 100.0])  # calibrated on a smaller range: saturates
    dequantized = quantize_fp8_static(x, static_scale).float() * static_scale
    inside = x.abs() <= FP8_MAX * static_scale
    assert_fp8_bound(x[inside], dequantized[inside], static_scale)
    assert torch.equal(dequantized[~inside].abs(), (FP8_MAX * static_scale).expand_as(x)[~inside])


def test_scaled_matmul_references_against_float():
    x, w = torch.randn(5, 300), torch.randn(200, 300)
    expected = x @ w.t()
    x_q, x_scale = quant_fp8_per_token_reference(x)
    schemes = [("per_tensor", None, 0), ("per_channel", None, 0), ("block", (128, 128), 0), ("block", (128, 128), 128)]
    for scheme, block, x_group in schemes:
        w_q, w_scale = quantize_weight(w, scheme, block)
        if block:
            x_q, x_scale = quant_fp8_per_token_reference(x, x_group)
            out = scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, None, torch.float32, *block)
        else:
            out = scaled_mm_reference(x_q, x_scale, w_q, w_scale, None, torch.float32)
        # two operands each within 2^-4 (about 2.5% rms for random values): a few percent
        assert ((out - expected).norm() / expected.norm()).item() < 0.06


def gemm_inputs(m: int, n: int, k: int, scheme: str, block, static: bool = False, x_group: int = 0):
    """x quantized per tensor (static), per token, or per token and `x_group` columns; w per `scheme`."""
    x, w = randn(m, k, dtype=torch.float32, scale=3.0), torch.randn(n, k, device=DEVICE)
    if static:
        x_scale = torch.tensor([x.abs().max().item() / FP8_MAX], device=DEVICE)
        x_q = quantize_fp8_static(x, x_scale)
    else:
        x_q, x_scale = quant_fp8_per_token_reference(x, x_group)
    w_q, w_scale = quantize_weight(w, scheme, block)
    return x_q, x_scale, w_q, w_scale, randn(n)


# (m, n, k): decode rows (the skinny kernel) and prefill rows (the tile kernel), N and K not multiples
# of the 128 block (partial edge blocks)
GEMM_SHAPES = [(1, 200, 300), (5, 136, 256), (33, 64, 130), (80, 48, 260)] + (
    [(64, 14336, 4096), (300, 4096, 1000)] if CUDA else []
)


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_triton_blockwise_gemm(m, n, k):
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, "block", (128, 128))
    out = gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)
    ref = scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)
    assert_close(out, ref)


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_blockwise_gemm_with_grouped_activation_scales(m, n, k):
    """x scaled per token and 128 columns (DeepSeek-V3's 1x128), through the skinny and the tile kernel."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, "block", (128, 128), x_group=128)
    assert x_scale.shape == (m, -(-k // 128))
    out = gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)
    assert_close(out, scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128))


def test_activation_scale_layouts():
    """A 0-dim per-tensor scale, and column-major grouped scales (DeepGEMM's layout), read as their values."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(5, 72, 256, "block", (128, 128), x_group=128)
    column_major = x_scale.t().contiguous().t()
    out = gemm.scaled_mm_blockwise(x_q, column_major, w_q, w_scale, bias, DTYPE, 128, 128)
    assert_close(out, scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128))
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(5, 72, 256, "per_channel", None, static=True)
    out = gemm.scaled_mm(x_q, x_scale.reshape(()), w_q, w_scale, bias, DTYPE)
    assert_close(out, scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE))


def test_grouped_activation_scales_must_match_the_weight_blocks():
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(3, 64, 256, "block", (128, 128), x_group=64)
    with pytest.raises(ValueError, match="4 groups fit neither one a token nor the weight's 2 blocks"):
        gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)


@pytest.mark.parametrize("scheme,static", [("per_channel", False), ("per_tensor", True), ("per_channel", True)])
@pytest.mark.parametrize("m,n,k", [(3, 40, 72), (17, 24, 33)])
def test_triton_gemm_with_row_and_tensor_scales(m, n, k, scheme, static):
    """The Triton kernel also covers scaled_mm's scales (cuBLASLt's fallback for odd shapes)."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, scheme, None, static)
    out = gemm.run_scaled_mm(x_q, x_scale, w_q, w_scale, bias, DTYPE, (1, k))
    assert_close(out, scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE))


def test_triton_gemm_small_k_blocks():
    """Scale blocks narrower than a K tile: the tile shrinks to the block."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(4, 48, 96, "block", (16, 32))
    config = gemm.default_config(4, 48, 96, 32, torch.device(DEVICE))
    assert config.block_k == 32
    out = gemm.run_scaled_mm(x_q, x_scale, w_q, w_scale, bias, DTYPE, (16, 32))
    assert_close(out, scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, 16, 32))


# decode-sized M at N and K that are not powers of two: partial N tiles, and K tiles that cross the end
@pytest.mark.parametrize("m", [1, 3, 7, 16])
@pytest.mark.parametrize("n,k", [(96, 384), (160, 256)])
@pytest.mark.parametrize("scheme", ["per_channel", "block"])
def test_skinny_gemm(m, n, k, scheme):
    """Both dispatch functions send decode-sized M to the skinny kernel (its default launch)."""
    block = (128, 128) if scheme == "block" else None
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, scheme, block)
    if block:
        out = gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, *block)
        ref = scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, *block)
    else:
        out = gemm.scaled_mm(x_q, x_scale, w_q, w_scale, bias, DTYPE)
        ref = scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE)
    assert_close(out, ref)


SKINNY_CONFIGS = [  # (m, config): split K into uneven slices, narrow and wide tiles, the one-token GEMV
    (5, gemm.SkinnyConfig(32, 128, 3, 4, 3, True)),
    (2, gemm.SkinnyConfig(64, 64, 4, 4, 2, True)),
    (1, gemm.SkinnyConfig(16, 256, 2, 2, 2, False)),
    (1, gemm.SkinnyConfig(8, 512, 1, 2, 3, False)),  # one K tile past the end of K
]
SKINNY_CASES = [
    (m, config, scheme, static)
    for m, config in SKINNY_CONFIGS
    for scheme, static in [("block", False), ("per_channel", False), ("per_tensor", True)]
    if config.dot or scheme != "block"  # the GEMV takes per-row scales only
]


@pytest.mark.parametrize("m,config,scheme,static", SKINNY_CASES)
def test_skinny_gemm_configs(m, config, scheme, static):
    """Block scales take activations scaled per token and 128 columns here: split-K slices start mid-group."""
    block = (128, 128) if scheme == "block" else None
    n, k = 72, 448
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, scheme, block, static, x_group=128 if block else 0)
    out = gemm.run_skinny_mm(x_q, x_scale, w_q, w_scale, bias, DTYPE, block or (1, k), config)
    if block:
        ref = scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, *block)
    else:
        ref = scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE)
    assert_close(out, ref)
    # the slice that merged each N tile reset its ticket, ready for the next launch
    assert not common.ticket_counters(x_q.device, 1).any()


# prologue -> (the fp8_linear op's Triton implementation, its reference)
FP8_LINEARS = {
    "none": (gemm.fp8_linear, fp8_linear_reference),
    "rms_norm": (gemm.rms_norm_fp8_linear, rms_norm_fp8_linear_reference),
    "add_rms_norm": (gemm.fused_add_rms_norm_fp8_linear, fused_add_rms_norm_fp8_linear_reference),
    "silu_mul": (gemm.silu_and_mul_fp8_linear, silu_and_mul_fp8_linear_reference),
}
FP8_PROLOGUES = list(FP8_LINEARS)


def fp8_linear_case(prologue: str, n: int, k: int, m: int = 1, per_tensor: bool = False):
    """`m` tokens' unquantized x and an fp8 weight (per-channel or per-tensor scales) with bias, as the arguments
    of the fp8_linear op for `prologue`, and the GEMV's prologue that does the same."""
    w_q, w_scale = quantize_weight(torch.randn(n, k, device=DEVICE), "per_tensor" if per_tensor else "per_channel")
    bias, g = randn(n, dtype=DTYPE), randn(k, dtype=DTYPE)
    x = randn(m, 2 * k if prologue == "silu_mul" else k, dtype=DTYPE, scale=3.0)
    residual = randn(m, k, dtype=DTYPE)
    args, kernel_prologue = (x,), None
    if prologue == "silu_mul":
        kernel_prologue = gemm.SiluMulPrologue()
    elif prologue == "rms_norm":
        args, kernel_prologue = (x, g, 1e-6), gemm.RMSNormPrologue(g, 1e-6)
    elif prologue == "add_rms_norm":
        args = (x, residual, g, 1e-6)
        kernel_prologue = gemm.RMSNormPrologue(g, 1e-6, residual, torch.full_like(x, float("nan")))
    return (*args, w_q, w_scale, bias, DTYPE), kernel_prologue


@pytest.mark.parametrize("prologue", FP8_PROLOGUES)
@pytest.mark.parametrize(
    "config", [None, gemm.SkinnyConfig(8, 64, 2, 2, 2, False), gemm.SkinnyConfig(4, 256, 1, 4, 1, False)]
)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_skinny_gemv_weight_only(prologue, config, per_tensor):
    """One unquantized token through an fp8 weight (no activation scales), after each prologue, with K split
    (the RMSNorm prologue never is) or one tile a slice (weight-first): the fp8_linear ops' reference."""
    n, k = 70, 200
    args, kernel_prologue = fp8_linear_case(prologue, n, k, per_tensor=per_tensor)
    x, (w_q, w_scale, bias, out_dtype) = args[0], args[-4:]
    out = gemm.run_skinny_mm(x, None, w_q, w_scale, bias, out_dtype, (1, k), config, kernel_prologue)
    reference = FP8_LINEARS[prologue][1](*args)
    if prologue == "add_rms_norm":
        reference, summed = reference
        assert_close(kernel_prologue.summed, summed, tol=1e-6)
    assert_close(out, reference)  # bf16: the reference rounds the prologue's output, the GEMV does not
    assert not common.ticket_counters(x.device, 1).any()


@pytest.mark.parametrize("prologue", FP8_PROLOGUES)
@pytest.mark.parametrize("m", [1, 2] + ([5, 80] if CUDA else []))
def test_fp8_linear_ops(prologue, m):
    """The fp8_linear ops' Triton implementations against their references: one token weight-only (the GEMV with
    the prologue), more through the quantizer kernel and `scaled_mm`."""
    args, _ = fp8_linear_case(prologue, 40, 136, m)
    fused, reference = FP8_LINEARS[prologue]
    out, expected = fused(*args), reference(*args)
    if prologue == "add_rms_norm":
        (out, summed), (expected, expected_summed) = out, expected
        assert_close(summed, expected_summed, tol=1e-6)
    assert_close(out, expected)


def test_fp8_linear_quantizes_x_for_more_than_one_token():
    """The reference's two cases: one token is x @ dequantized w^T; every row of more is scaled_mm of x
    quantized per token (so a token's output differs, by its activation's rounding, between the two)."""
    (x, w_q, w_scale, bias, out_dtype), _ = fp8_linear_case("none", 24, 64, m=3)
    many = fp8_linear_reference(x, w_q, w_scale, bias, out_dtype)
    torch.testing.assert_close(
        many, scaled_mm_reference(*quant_fp8_per_token_reference(x), w_q, w_scale, bias, out_dtype)
    )
    one = fp8_linear_reference(x[:1], w_q, w_scale, bias, out_dtype)
    unquantized = x[:1].float() @ dequantize_weight(w_q, w_scale).t() + bias.float()
    torch.testing.assert_close(one, unquantized.to(out_dtype))
    assert not torch.equal(one, many[:1])


def test_skinny_gemv_weight_only_refusals():
    (x, w_q, w_scale, _, _), _ = fp8_linear_case("none", 16, 64)
    with pytest.raises(ValueError, match="activation scales only with weight scales"):
        gemm.run_skinny_mm(x, w_scale[:1], w_q.float(), None, None, DTYPE, (1, 64))
    with pytest.raises(ValueError, match="runs in the one-token GEMV, not in the MMA"):
        mma = gemm.SkinnyConfig(32, 64, 1, 4, 3, True)
        gemm.run_skinny_mm(x, None, w_q, w_scale, None, DTYPE, (1, 64), mma)


@gpu_only
@pytest.mark.parametrize(
    "prologue,n,k",
    [("add_rms_norm", 6144, 4096), ("none", 4096, 4096), ("add_rms_norm", 28672, 4096), ("silu_mul", 4096, 14336)],
)
def test_skinny_gemv_weight_only_gpu_shapes(prologue, n, k):
    """Llama-3-8B's projections with the op in front of each (qkv, o, gate_up, down): o_proj's 16 MB through the
    weight-first GEMV, the others pipelined."""
    args, _ = fp8_linear_case(prologue, n, k)
    fused, reference = FP8_LINEARS[prologue]
    out, expected = fused(*args), reference(*args)
    if prologue == "add_rms_norm":
        out, expected = out[0], expected[0]
    assert_close(out, expected)


def test_skinny_gemm_rejects_mismatched_tiles():
    x_q, x_scale, w_q, w_scale, _ = gemm_inputs(1, 64, 256, "block", (128, 128))
    gemv = gemm.SkinnyConfig(8, 256, 1, 2, 2, False)
    with pytest.raises(ValueError, match="per-row weight scales"):
        gemm.run_skinny_mm(x_q, x_scale, w_q, w_scale, None, DTYPE, (128, 128), gemv)
    with pytest.raises(ValueError, match="must divide"):
        gemm.run_skinny_mm(
            x_q, x_scale, w_q, w_scale, None, DTYPE, (128, 128), gemm.SkinnyConfig(64, 256, 1, 4, 2, True)
        )
    x_q, x_scale, w_q, w_scale, _ = gemm_inputs(2, 64, 256, "per_channel", None)
    with pytest.raises(ValueError, match="one token"):
        gemm.run_skinny_mm(x_q, x_scale, w_q, w_scale, None, DTYPE, (1, 256), gemv)


@gpu_only
@pytest.mark.parametrize("scheme", ["per_channel", "block"])
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (8, 4096, 14336), (64, 28672, 4096), (33, 4096, 4096)])
def test_skinny_gemm_gpu_shapes(m, n, k, scheme):
    block = (128, 128) if scheme == "block" else None
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, scheme, block)
    out = gemm.run_skinny_mm(x_q, x_scale, w_q, w_scale, bias, DTYPE, block or (1, k))
    if block:
        ref = scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, *block)
    else:
        ref = scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE)
    assert_close(out, ref)


@gpu_only
def test_skinny_gemm_cuda_graph():
    """Captured once and replayed on new activations: split-K merges stay right (tickets reset)."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(4, 4096, 4096, "block", (128, 128))
    assert gemm.skinny_config(4, 4096, 4096, 128, x_q.device).split_k > 1
    gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm.scaled_mm_blockwise(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128)
    for _ in range(3):
        new_q, new_scale = quant_fp8_per_token_reference(randn(4, 4096, dtype=torch.float32, scale=3.0))
        x_q.copy_(new_q)
        x_scale.copy_(new_scale)
        graph.replay()
        assert_close(out, scaled_mm_blockwise_reference(x_q, x_scale, w_q, w_scale, bias, DTYPE, 128, 128))


@gpu_only
@pytest.mark.parametrize("scheme,static", [("per_tensor", True), ("per_channel", False), ("per_tensor", False)])
@pytest.mark.parametrize("m,n,k", [(1, 14336, 4096), (16, 4096, 14336), (200, 6144, 4096)])
def test_cublas_scaled_mm(m, n, k, scheme, static):
    """The dispatch: the skinny kernel up to SKINNY_MAX_M rows, then torch._scaled_mm, tensor-wise
    (static x, per-tensor w) or row-wise (anything per row)."""
    x_q, x_scale, w_q, w_scale, bias = gemm_inputs(m, n, k, scheme, None, static)
    out = gemm.scaled_mm(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16)
    assert_close(out, scaled_mm_reference(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16))


@gpu_only
@pytest.mark.parametrize("m", [8, 80])
def test_cublas_scaled_mm_packed_per_tensor_rows(m):
    """A packed layer's per-shard scales on its rows: row-wise even though each shard is per tensor."""
    x_q, x_scale, w_q, _, _ = gemm_inputs(m, 3072, 4096, "per_tensor", None)
    w_scale = torch.cat([torch.full((1024, 1), s, device=DEVICE) for s in (0.01, 0.02, 0.03)])
    out = gemm.scaled_mm(x_q, x_scale, w_q, w_scale, None, torch.bfloat16)
    assert_close(out, scaled_mm_reference(x_q, x_scale, w_q, w_scale, None, torch.bfloat16))


# ---- FP8 KV cache ---------------------------------------------------------------------------


def kv_scales(k_scale: float = 0.05, v_scale: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k_scale], device=DEVICE), torch.tensor([v_scale], device=DEVICE)


def test_cache_round_trip_with_scales():
    """The reference write then read gives back k and v within fp8 rounding, saturating past 448 * scale."""
    k, v = randn(6, 2, 16, dtype=torch.float32), randn(6, 2, 16, dtype=torch.float32)
    k[0, 0, 0] = 100.0  # beyond 448 * k_scale
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=FP8_DTYPE, device=DEVICE)
    slots = torch.arange(6, device=DEVICE)
    k_scale, v_scale = kv_scales()
    reshape_and_cache_reference(k, v, cache, slots, k_scale, v_scale)
    flat = cache.view(2, -1, 2, 16)[:, :6].float()
    assert flat[0, 0, 0, 0] == FP8_MAX
    k_back, v_back = flat[0] * k_scale, flat[1] * v_scale
    k[0, 0, 0] = FP8_MAX * k_scale
    assert_fp8_bound(k, k_back, k_scale)
    assert_fp8_bound(v, v_back, v_scale)


def cache_writes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[tuple]:
    """(Triton op, reference, arguments before the cache) of each cache write: reshape, RoPE, QK-norm and RoPE."""
    tokens, head_dim = k.shape[0], k.shape[-1]
    table = rope_table(head_dim)
    positions = torch.randint(0, table.shape[0], (tokens,), device=DEVICE)
    q_w, k_w = randn(head_dim), randn(head_dim)
    return [
        (rotary_cache.reshape_and_cache, reshape_and_cache_reference, (k, v)),
        (rotary_cache.rope_and_cache, rope_and_cache_reference, (positions, q, k, v, table)),
        (
            rotary_cache.qk_norm_rope_and_cache,
            qk_norm_rope_and_cache_reference,
            (positions, q, k, v, q_w, k_w, 1e-6, table),
        ),
    ]


@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(7, 4, 2, 16), (6, 8, 2, 12)])
def test_cache_writes_quantize_with_scales(tokens, q_heads, kv_heads, head_dim):
    q, k, v = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    scales = kv_scales(0.01, 0.004)  # small scales: values land near the top of e4m3's range
    for kernel, reference, args in cache_writes(q, k, v):
        cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, 4, FP8_DTYPE)
        expected = cache.clone()
        out = kernel(*args, cache, slots, *scales)
        ref = reference(*args, expected, slots, *scales)
        if out is not None:
            assert_close(out, ref)
        # rounding ties may fall differently: compare what the caches stand for
        assert_close(cache.float() * 0.01, expected.float() * 0.01)
        assert (cache.float().abs() > 64).any(), "the scales should spread values over e4m3's range"


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,block_size,lens,padding",
    [(4, 2, 32, 16, MIXED, 3), (8, 2, 16, 4, MIXED, 3), (4, 2, 32, 8, [(1, 23), (1, 5), (1, 40)], 0)],  # decode only
)
def test_attention_reads_scaled_fp8_cache(q_heads, kv_heads, head_dim, block_size, lens, padding):
    q, cache, tables, seq_lens, qsl = attention_batch(lens, q_heads, kv_heads, head_dim, block_size, padding, FP8_DTYPE)
    k_scale, v_scale = kv_scales(0.3, 3.0)
    out = attention.paged_attention(q, cache, tables, seq_lens, qsl, head_dim**-0.5, k_scale, v_scale)
    ref = paged_attention_reference(q, cache, tables, seq_lens, qsl, head_dim**-0.5, k_scale, v_scale)
    assert_close(out, ref, ATTN_TOL)
    unscaled = paged_attention_reference(q, cache, tables, seq_lens, qsl, head_dim**-0.5)
    assert not torch.allclose(ref, unscaled), "the scales must change the result"


def test_inline_scale_cache_round_trip():
    """A scale per (token, head), computed as each entry is written: tokens a thousand times apart in size come back
    within e4m3's relative rounding, which one per-tensor scale cannot give both ends of."""
    tokens, kv_heads, head_dim, block_size = 11, 2, 16, 4
    shape = (tokens + 1, kv_heads, head_dim)  # and a padding token, not written
    sizes = torch.logspace(-2, 1, tokens + 1, device=DEVICE)[:, None, None]
    k, v = randn(*shape, dtype=torch.float32) * sizes, randn(*shape, dtype=torch.float32) * sizes.flip(0)
    cache = torch.zeros(inline_scale_cache_shape(4, block_size, kv_heads, head_dim), dtype=torch.uint8, device=DEVICE)
    slots = torch.arange(5, 5 + tokens, device=DEVICE)  # blocks 1-3, from an offset
    reshape_and_cache_reference(k, v, cache, torch.cat([slots, torch.tensor([-1], device=DEVICE)]), None, None)
    entries, scales = inline_cache_views(cache)
    for i, x in enumerate((k[:tokens], v[:tokens])):
        scale = scales[i, slots // block_size, :, slots % block_size]  # [tokens, kv_heads]
        assert torch.equal(scale, x.abs().amax(dim=-1) / FP8_MAX)
        back = entries[i, slots // block_size, slots % block_size].float() * scale[..., None]
        assert ((back - x).abs() <= x.abs().amax(dim=-1, keepdim=True) * 2**-4).all()
    assert not entries[:, 0].float().any() and not scales[:, 0].any(), "block 0 was not written"


def test_attention_reads_inline_scale_cache():
    """The reference over an inline-scale cache equals attention over the values it stands for (in fp32 on any
    device: bf16 values would round what they stand for once more)."""
    lens = [(5, 5), (1, 13), (3, 9)]
    q, cache, tables, seq_lens, qsl = attention_batch(lens, 4, 2, 16, 4, 0, torch.float32)
    q = q.float()
    k, v = cache[0].flatten(0, 1), cache[1].flatten(0, 1)
    inline = torch.zeros(inline_scale_cache_shape(cache.shape[1], 4, 2, 16), dtype=torch.uint8, device=DEVICE)
    reshape_and_cache_reference(k, v, inline, torch.arange(k.shape[0], device=DEVICE), None, None)
    entries, scales = inline_cache_views(inline)
    stands_for = (entries.float() * scales.transpose(2, 3)[..., None]).to(cache.dtype)
    out = paged_attention_reference(q, inline, tables, seq_lens, qsl, 0.25)
    assert_close(out, paged_attention_reference(q, stands_for, tables, seq_lens, qsl, 0.25), 1e-6)
    assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 0.25), 5e-2)


@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(7, 4, 2, 16), (6, 6, 3, 32)])
def test_cache_writes_with_inline_scales(tokens, q_heads, kv_heads, head_dim):
    """The Triton cache writes against the reference: entries and their (token, head) scales; an all-zero head
    takes the smallest scale, not 0 (which would store 0 / 0)."""
    q, k, v = fused_qkv(tokens, q_heads, kv_heads, head_dim)
    sizes = torch.logspace(-1, 1, tokens, device=DEVICE)[:, None, None]  # a scale read from another token is far off
    k.mul_(sizes), v.mul_(sizes.flip(0))
    k[0, 0], v[0, -1] = 0.0, 0.0
    for kernel, reference, args in cache_writes(q, k, v):
        fp8_cache, slots = kv_cache_and_slots(tokens, kv_heads, head_dim, 4, FP8_DTYPE)
        shape = inline_scale_cache_shape(fp8_cache.shape[1], 4, kv_heads, head_dim)
        cache = torch.zeros(shape, dtype=torch.uint8, device=DEVICE)
        expected = cache.clone()
        out = kernel(*args, cache, slots)
        ref = reference(*args, expected, slots)
        if out is not None:
            assert_close(out, ref)
        (entries, scales), (ref_entries, ref_scales) = inline_cache_views(cache), inline_cache_views(expected)
        # as `out` may, a rotated element may differ from torch's by an ulp of DTYPE (H100, bf16), and its amax
        assert_close(scales, ref_scales)
        assert not entries.float().isnan().any()
        assert scales.count_nonzero() == 2 * (tokens - 2) * kv_heads  # every written (token, head), no other
        # What the caches stand for, each within e4m3's rounding (2^-4 of a head's amax) of the same values: where a
        # scale differs by an ulp, an entry near a rounding boundary may take the other e4m3 neighbour.
        stands_for = entries.float() * scales.transpose(2, 3)[..., None]
        ref_stands_for = ref_entries.float() * ref_scales.transpose(2, 3)[..., None]
        amax = ref_scales.transpose(2, 3)[..., None] * FP8_MAX
        assert ((stands_for - ref_stands_for).abs() <= amax * 2**-3).all()


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,block_size,lens,padding",
    [(4, 2, 32, 8, MIXED, 3), (8, 2, 16, 4, MIXED, 0), (4, 2, 32, 8, [(1, 23), (1, 5), (1, 40)], 0)],  # decode only
)
def test_attention_reads_inline_scale_cache_triton(q_heads, kv_heads, head_dim, block_size, lens, padding):
    """The Triton kernel over an inline-scale cache against the reference, prefill tiles and split decodes."""
    q, cache, tables, seq_lens, qsl = attention_batch(lens, q_heads, kv_heads, head_dim, block_size, padding, DTYPE)
    sizes = torch.logspace(-1, 1, cache.shape[1] * block_size, device=DEVICE).view(1, -1, block_size, 1, 1)
    k, v = (cache * sizes)[0].flatten(0, 1), (cache * sizes.flip(1))[1].flatten(0, 1)
    shape = inline_scale_cache_shape(cache.shape[1], block_size, kv_heads, head_dim)
    inline = torch.zeros(shape, dtype=torch.uint8, device=DEVICE)
    reshape_and_cache_reference(k, v, inline, torch.arange(k.shape[0], device=DEVICE), None, None)
    ref = paged_attention_reference(q, inline, tables, seq_lens, qsl, head_dim**-0.5)
    for config in (attention.default_config(head_dim), splitting_config(head_dim)):
        out = attention.run_paged_attention(q, inline, tables, seq_lens, qsl, head_dim**-0.5, config)
        assert_close(out, ref, ATTN_TOL)


def test_inline_scales_need_room_in_one_slot():
    with pytest.raises(ValueError, match="4 \\* block_size <= head_dim"):
        inline_scale_cache_shape(8, 32, 2, 64)


def test_scales_ignored_by_unquantized_cache():
    q, cache, tables, seq_lens, qsl = attention_batch([(3, 9), (1, 5)], 4, 2, 16, 4, 0, DTYPE)
    k_scale, v_scale = kv_scales()
    out = attention.paged_attention(q, cache, tables, seq_lens, qsl, 0.25, k_scale, v_scale)
    assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 0.25), ATTN_TOL)


@gpu_only
def test_attention_fp8_cache_gpu_shapes():
    lens = [(200, 700), (1, 2049), (1, 64), (64, 64)]
    q, cache, tables, seq_lens, qsl = attention_batch(lens, 32, 8, 128, 16, 2, FP8_DTYPE)
    k_scale, v_scale = kv_scales(0.5, 2.0)
    out = attention.paged_attention(q, cache, tables, seq_lens, qsl, 128**-0.5, k_scale, v_scale)
    assert_close(out, paged_attention_reference(q, cache, tables, seq_lens, qsl, 128**-0.5, k_scale, v_scale), ATTN_TOL)
