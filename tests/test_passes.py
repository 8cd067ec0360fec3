"""Each pass: which nodes disappear and appear, outputs unchanged, zero matches where the pattern is absent."""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

import atom_compile as ac
from atom_compile.export import ExportOptions, trace_model_dir
from atom_compile.passes import resolve_pipeline, run_passes
from atom_compile.passes.fp8_linear import FUSED as FUSED_INTO_GEMM
from atom_compile.reference import prompt_step
from atom_compile.trace import graph_arguments, model_weights


def ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "atom" in str(n.target))


def traced(model_dir, quantization=None):
    model, t = trace_model_dir(model_dir, ExportOptions(device="cpu", quantization=quantization))
    return model, t


def run(model, t, seed=0, tokens=13):
    """Logits and KV caches of one `tokens`-token prefill through the traced graph."""
    ids, positions, caches, meta, logits_indices = prompt_step(model.config, tokens, torch.device("cpu"), torch.float32)
    args = graph_arguments(t.inputs, model_weights(model), ids, positions, caches, meta, logits_indices)
    with torch.inference_mode():
        logits = t.graph_module(*args)[0]
    return logits, caches


def apply(t, *names):
    records = run_passes(t.graph_module, list(names))
    return {r.name: r.matches for r in records}


def assert_same_outputs(before, after, rtol=1e-6):
    (logits_a, caches_a), (logits_b, caches_b) = before, after
    torch.testing.assert_close(logits_b, logits_a, rtol=rtol, atol=rtol)
    for a, b in zip(caches_a, caches_b, strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=rtol)


def test_rope_cache_on_llama(tiny_llama):
    model, t = traced(tiny_llama)
    layers = model.config.num_hidden_layers
    before_ops, before = ops(t.graph_module), run(model, t)
    assert before_ops["atom.unified_attention.default"] == layers
    assert apply(t, "rope_cache") == {"rope_cache": layers}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.rotary_embedding.default"] == 0
    assert after_ops["atom.unified_attention.default"] == 0
    assert after_ops["atom.rope_and_cache.default"] == layers
    assert after_ops["atom.paged_attention.default"] == layers
    assert_same_outputs(before, run(model, t))


def test_qk_norm_rope_cache_on_qwen3(tiny_qwen3):
    model, t = traced(tiny_qwen3)
    layers = model.config.num_hidden_layers
    before_ops, before = ops(t.graph_module), run(model, t)
    assert apply(t, "qk_norm_rope_cache", "rope_cache") == {"qk_norm_rope_cache": layers, "rope_cache": 0}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.qk_norm_rope_and_cache.default"] == layers
    assert after_ops["atom.paged_attention.default"] == layers
    # the two per-head norms of every layer went into the fused op
    assert after_ops["atom.rms_norm.default"] == before_ops["atom.rms_norm.default"] - 2 * layers
    assert after_ops["atom.unified_attention.default"] == after_ops["atom.rotary_embedding.default"] == 0
    assert_same_outputs(before, run(model, t))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_qkv_rope_cache_on_llama(tiny_llama, quantization):
    """Each layer's fused qkv projection (the first layer's without a residual) and its RoPE/cache write become one
    op, bf16 or FP8, with the same outputs and caches for several tokens and for one."""
    model, t = traced(tiny_llama, quantization)
    layers = model.config.num_hidden_layers
    apply(t, *resolve_pipeline("-qkv_rope_cache,-cleanup"))
    before, before_one = run(model, t), run(model, t, tokens=1)
    assert apply(t, "qkv_rope_cache") == {"qkv_rope_cache": layers}
    after_ops = ops(t.graph_module)
    suffix = "fp8_linear" if quantization else "linear"
    assert after_ops["atom.qkv_rope_and_cache.default"] == layers
    assert after_ops["atom.rope_and_cache.default"] == 0
    assert after_ops[f"atom.rms_norm_{suffix}.default"] == after_ops[f"atom.fused_add_rms_norm_{suffix}.default"] == 0
    assert_same_outputs(before, run(model, t))
    assert_same_outputs(before_one, run(model, t, tokens=1))


def test_qkv_rope_cache_leaves_qk_norm_and_unfused_projections(tiny_llama, tiny_qwen3):
    """A QK norm between the projection and RoPE keeps them apart (Qwen3, with its own fusion off so `rope_cache`
    makes the rope_and_cache); a qkv projection without its norm fused (pass off) is left alone."""
    _, t = traced(tiny_qwen3)
    matches = apply(t, *resolve_pipeline("-qk_norm_rope_cache,-cleanup"))
    assert matches["rope_cache"] > 0 and matches["qkv_rope_cache"] == 0
    _, t = traced(tiny_llama)
    assert apply(t, *resolve_pipeline("-rms_norm_linear,-cleanup"))["qkv_rope_cache"] == 0


def test_qk_norm_pass_does_not_match_llama(tiny_llama):
    _, t = traced(tiny_llama)
    assert apply(t, "qk_norm_rope_cache") == {"qk_norm_rope_cache": 0}


def test_quant_fusions_on_fp8_model(tiny_llama):
    model, t = traced(tiny_llama, quantization="fp8")
    layers = model.config.num_hidden_layers
    before_ops, before = ops(t.graph_module), run(model, t)
    # every linear quantizes its input: qkv, o, gate_up, down per layer
    assert before_ops["atom.quant_fp8_per_token.default"] == 4 * layers
    matches = apply(t, "rms_norm_quant", "silu_mul_quant")
    # input norm (first layer: no residual) and post-attention norm per layer, then down's input.
    assert matches == {"rms_norm_quant": 2 * layers, "silu_mul_quant": layers}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.rms_norm_quant_fp8.default"] == 1
    assert after_ops["atom.fused_add_rms_norm_quant_fp8.default"] == 2 * layers - 1
    assert after_ops["atom.silu_and_mul_quant_fp8.default"] == layers
    assert after_ops["atom.silu_and_mul.default"] == 0
    assert after_ops["atom.quant_fp8_per_token.default"] == layers  # only o_proj's input stays
    # the final norm feeds the unquantized LM head and is left alone
    assert after_ops["atom.fused_add_rms_norm.default"] == 1
    # references compose the unfused ops exactly; the Triton kernels are held to FP8 tolerance in their own tests
    assert_same_outputs(before, run(model, t), rtol=1e-5)


def test_quantizers_into_their_gemms_on_fp8_model(tiny_llama):
    """After the quant fusions every quantizer feeds one scaled_mm: all four kinds go into it. Several tokens
    compute the same function; one token loses only its activations' fp8 rounding (weight-only)."""
    model, t = traced(tiny_llama, quantization="fp8")
    layers = model.config.num_hidden_layers
    apply(t, "rms_norm_quant", "silu_mul_quant")
    before_ops, before, before_one = ops(t.graph_module), run(model, t), run(model, t, tokens=1)
    assert apply(t, "fp8_linear") == {"fp8_linear": 4 * layers}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.scaled_mm.default"] == 0
    for quantizer, fused in FUSED_INTO_GEMM.items():
        assert after_ops[f"atom.{quantizer}.default"] == 0
        assert after_ops[f"atom.{fused}.default"] == before_ops[f"atom.{quantizer}.default"]
    assert_same_outputs(before, run(model, t))
    # one token: closer to the unquantized model than with quantized activations
    unquantized = run(*traced(tiny_llama), tokens=1)[0]
    error_before, error_after = ((run_[0] - unquantized).norm() for run_ in (before_one, run(model, t, tokens=1)))
    assert 0 < error_after < error_before


def test_fp8_linear_leaves_block_scales_and_shared_quantizers():
    """Grouped scales (block checkpoints), a quantizer feeding two GEMMs, and a residual sum used before the GEMM
    are not fused."""
    w_q = torch.randn(8, 16).to(torch.float8_e4m3fn)

    def graph(group: int = 0, gemms: int = 1, blockwise: bool = False):
        g = torch.fx.Graph()
        x, w, ws = g.placeholder("x"), g.placeholder("w"), g.placeholder("ws")
        quant = g.call_function(torch.ops.atom.quant_fp8_per_token.default, (x, group))
        x_q, x_s = (g.call_function(operator.getitem, (quant, i)) for i in range(2))
        mm, extra = torch.ops.atom.scaled_mm.default, ()
        if blockwise:
            mm, extra = torch.ops.atom.scaled_mm_blockwise.default, (128, 128)
        g.output(tuple(g.call_function(mm, (x_q, x_s, w, ws, None, torch.float32, *extra)) for _ in range(gemms)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    def residual_graph(sum_used_before_gemm: bool):
        g = torch.fx.Graph()
        x, res, norm, w, ws = (g.placeholder(name) for name in ("x", "res", "norm", "w", "ws"))
        quant = g.call_function(torch.ops.atom.fused_add_rms_norm_quant_fp8.default, (x, res, norm, 1e-6, 0))
        x_q, x_s, summed = (g.call_function(operator.getitem, (quant, i)) for i in range(3))
        early = g.call_function(torch.neg, (summed,)) if sum_used_before_gemm else None
        mm = g.call_function(torch.ops.atom.scaled_mm.default, (x_q, x_s, w, ws, None, torch.float32))
        g.output((mm, early if early is not None else g.call_function(torch.neg, (summed,))))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    for unfused in (graph(group=8), graph(gemms=2), graph(blockwise=True), residual_graph(True)):
        assert run_passes(unfused, ["fp8_linear"])[0].matches == 0
    assert run_passes(residual_graph(False), ["fp8_linear"])[0].matches == 1
    gm = graph()
    x, ws = torch.randn(3, 16), torch.rand(8, 1)
    before = gm(x, w_q, ws)
    assert run_passes(gm, ["fp8_linear"])[0].matches == 1
    torch.testing.assert_close(gm(x, w_q, ws), before)
    torch.testing.assert_close(gm(x[:1], w_q, ws)[0], x[:1] @ (w_q.float() * ws).t())  # one token: weight-only


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_linear_fusions(model, request):
    """The norms in front of qkv and gate_up and the SiLU·mul in front of down go into those projections."""
    model, t = traced(request.getfixturevalue(model))
    layers = model.config.num_hidden_layers
    before_ops, before = ops(t.graph_module), run(model, t)
    assert apply(t, "rms_norm_linear", "silu_mul_linear") == {"rms_norm_linear": 2 * layers, "silu_mul_linear": layers}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.rms_norm_linear.default"] == 1  # the first layer's input norm has no residual
    assert after_ops["atom.fused_add_rms_norm_linear.default"] == 2 * layers - 1
    assert after_ops["atom.silu_and_mul_linear.default"] == layers
    assert after_ops["atom.silu_and_mul.default"] == 0
    assert after_ops["atom.linear.default"] == before_ops["atom.linear.default"] - 3 * layers  # o_proj stays
    # the final norm feeds the LM head through the logits gather: left alone; Qwen3's per-head QK norms too
    assert after_ops["atom.fused_add_rms_norm.default"] == 1
    assert after_ops["atom.rms_norm.default"] == before_ops["atom.rms_norm.default"] - 1
    # the references compose the unfused ops exactly; the kernels are held to tolerance in their own tests
    assert_same_outputs(before, run(model, t))


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_gated_mlp(model, quantization, request):
    """Each layer's fused gate_up projection and its fused down projection become one op (bf16 or FP8 weights), with
    the same outputs for several tokens and for one (the fused ops' weight-only case)."""
    model, t = traced(request.getfixturevalue(model), quantization)
    layers = model.config.num_hidden_layers
    fp8 = quantization == "fp8"
    apply(t, *(["rms_norm_quant", "silu_mul_quant", "fp8_linear"] if fp8 else ["rms_norm_linear", "silu_mul_linear"]))
    before, before_one = run(model, t), run(model, t, tokens=1)
    assert apply(t, "gated_mlp") == {"gated_mlp": layers}
    after_ops = ops(t.graph_module)
    suffix = "fp8_linear" if fp8 else "linear"
    assert after_ops["atom.fused_add_rms_norm_mlp.default"] == layers
    assert after_ops[f"atom.silu_and_mul_{suffix}.default"] == 0
    assert after_ops[f"atom.fused_add_rms_norm_{suffix}.default"] == layers - 1  # qkv's input norms but the first
    assert_same_outputs(before, run(model, t))
    assert_same_outputs(before_one, run(model, t, tokens=1))


def test_gated_mlp_leaves_a_sum_used_before_the_down_projection():
    graph = torch.fx.Graph()
    x, residual, norm_weight, w1, w2 = (graph.placeholder(name) for name in ("x", "residual", "g", "w1", "w2"))
    norm = graph.call_function(
        torch.ops.atom.fused_add_rms_norm_linear.default, (x, residual, norm_weight, 1e-6, w1, None)
    )
    gate_up, summed = (graph.call_function(operator.getitem, (norm, i)) for i in (0, 1))
    early = graph.call_function(torch.ops.aten.mul.Tensor, (summed, 2.0))
    down = graph.call_function(torch.ops.atom.silu_and_mul_linear.default, (gate_up, w2, None))
    graph.output((down, early))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = (torch.randn(1, 8), torch.randn(1, 8), torch.randn(8), torch.randn(12, 8), torch.randn(8, 6))
    assert run_passes(gm, ["gated_mlp"])[0].matches == 0
    graph.erase_node(graph.output_node())
    graph.erase_node(early)
    graph.output((down, summed))
    gm.recompile()
    before = gm(*inputs)
    assert run_passes(gm, ["gated_mlp"])[0].matches == 1
    for a, b in zip(gm(*inputs), before, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_final_norm_rows(model, request):
    """The final norm and the gather of the rows a step samples become one op, for a prefill and for one token."""
    model, t = traced(request.getfixturevalue(model))
    before_ops, before, before_one = ops(t.graph_module), run(model, t), run(model, t, tokens=1)
    assert apply(t, "final_norm_rows") == {"final_norm_rows": 1}
    after_ops = ops(t.graph_module)
    assert after_ops["atom.fused_add_rms_norm_rows.default"] == 1
    assert after_ops["atom.fused_add_rms_norm.default"] == before_ops["atom.fused_add_rms_norm.default"] - 1
    targets = {str(n.target) for n in t.graph_module.graph.nodes}
    assert "aten.index_select.default" not in targets
    assert_same_outputs(before, run(model, t))
    assert_same_outputs(before_one, run(model, t, tokens=1))


def norm_then_rows(sum_used: bool) -> torch.fx.GraphModule:
    """fused_add_rms_norm -> index_select of rows; optionally the residual sum is an output too."""
    graph = torch.fx.Graph()
    x, residual, norm_weight, rows = (graph.placeholder(name) for name in ("x", "residual", "norm_weight", "rows"))
    norm = graph.call_function(torch.ops.atom.fused_add_rms_norm.default, (x, residual, norm_weight, 1e-6))
    normed, summed = (graph.call_function(operator.getitem, (norm, i)) for i in (0, 1))
    selected = graph.call_function(torch.ops.aten.index_select.default, (normed, 0, rows))
    graph.output((selected, summed) if sum_used else selected)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_final_norm_rows_leaves_a_norm_whose_sum_is_used():
    inputs = (torch.randn(5, 8), torch.randn(5, 8), torch.randn(8), torch.tensor([4, 1]))
    gm = norm_then_rows(sum_used=False)
    before = gm(*inputs)
    assert run_passes(gm, ["final_norm_rows"])[0].matches == 1
    assert ops(gm) == Counter({"atom.fused_add_rms_norm_rows.default": 1})
    torch.testing.assert_close(gm(*inputs), before, rtol=1e-6, atol=1e-6)
    # the sum is the next residual where anything uses it: a norm over a few rows would not produce it
    assert run_passes(norm_then_rows(sum_used=True), ["final_norm_rows"])[0].matches == 0


def norm_then_linear(sum_used_before_linear: bool = False) -> torch.fx.GraphModule:
    """fused_add_rms_norm -> linear, written with keyword arguments; optionally the residual sum is used before it."""
    graph = torch.fx.Graph()
    x, residual, norm_weight, weight = (graph.placeholder(name) for name in ("x", "residual", "norm_weight", "weight"))
    norm = graph.call_function(torch.ops.atom.fused_add_rms_norm.default, (x, residual, norm_weight), {"eps": 1e-6})
    normed, summed = (graph.call_function(operator.getitem, (norm, i)) for i in (0, 1))
    early = graph.call_function(torch.ops.aten.mul.Tensor, (summed, 2.0)) if sum_used_before_linear else summed
    out = graph.call_function(torch.ops.atom.linear.default, (), {"x": normed, "weight": weight, "bias": None})
    graph.output((out, early))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_linear_fusion_on_keyword_arguments_and_where_the_sum_is_used_first():
    inputs = (torch.randn(1, 8), torch.randn(1, 8), torch.randn(8), torch.randn(4, 8))
    gm = norm_then_linear()
    before = gm(*inputs)
    assert run_passes(gm, ["rms_norm_linear"])[0].matches == 1
    assert ops(gm) == Counter({"atom.fused_add_rms_norm_linear.default": 1})
    for a, b in zip(gm(*inputs), before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the fused op stands where the linear was, so a use of the sum before it would come first: left alone
    assert run_passes(norm_then_linear(sum_used_before_linear=True), ["rms_norm_linear"])[0].matches == 0


def test_linear_fusions_leave_fp8_projections_to_the_quant_fusions(tiny_llama):
    _, t = traced(tiny_llama, quantization="fp8")
    matches = apply(t, "rms_norm_quant", "silu_mul_quant", "rms_norm_linear", "silu_mul_linear")
    assert matches["rms_norm_linear"] == matches["silu_mul_linear"] == 0


def test_quant_passes_do_not_match_unquantized_model(tiny_llama):
    _, t = traced(tiny_llama)
    assert apply(t, "rms_norm_quant", "silu_mul_quant") == {"rms_norm_quant": 0, "silu_mul_quant": 0}


class FloatOfFloat(torch.nn.Module):
    def forward(self, x):
        return (x * 2).float()


def test_cleanup_removes_noop_cast_and_asserts():
    """`.float()` of an fp32 tensor: export leaves a metadata assert and a same-dtype cast, cleanup drops both."""
    x = torch.randn(3, 5)
    gm = torch.export.export(FloatOfFloat(), (x,)).module()
    targets = Counter(str(n.target) for n in gm.graph.nodes)
    assert targets["aten._assert_tensor_metadata.default"] == 1 and targets["aten.to.dtype"] == 1
    assert run_passes(gm, ["cleanup"])[0].matches >= 2
    targets = Counter(str(n.target) for n in gm.graph.nodes)
    assert targets["aten._assert_tensor_metadata.default"] == 0 and targets["aten.to.dtype"] == 0
    torch.testing.assert_close(gm(x), x * 2)


def test_cleanup_keeps_cache_writes_without_users(tiny_llama):
    """reshape_and_cache returns nothing; dead-code elimination must not drop it."""
    model, t = traced(tiny_llama)
    before = run(model, t)
    graph = t.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.atom.unified_attention.default:
            q, k, v, cache, slots, tables, lens, starts, scale = node.args
            with graph.inserting_before(node):
                graph.call_function(torch.ops.atom.reshape_and_cache.default, (k, v, cache, slots))
                read = graph.call_function(
                    torch.ops.atom.paged_attention.default, (q, cache, tables, lens, starts, scale)
                )
            node.replace_all_uses_with(read)
            graph.erase_node(node)
    apply(t, "cleanup")
    assert ops(t.graph_module)["atom.reshape_and_cache.default"] == model.config.num_hidden_layers
    assert_same_outputs(before, run(model, t))


def test_pipeline_edits():
    default = [
        "rms_norm_quant",
        "silu_mul_quant",
        "fp8_linear",
        "rms_norm_linear",
        "silu_mul_linear",
        "gated_mlp",
        "final_norm_rows",
        "qk_norm_rope_cache",
    ]
    assert resolve_pipeline(None) == [*default, "rope_cache", "qkv_rope_cache", "cleanup"]
    assert resolve_pipeline("-rope_cache,-qkv_rope_cache,-cleanup") == default
    assert resolve_pipeline(["rope_cache", "cleanup"]) == ["rope_cache", "cleanup"]
    with pytest.raises(KeyError, match="unknown pass 'nope'"):
        resolve_pipeline("+nope")
    with pytest.raises(ValueError, match="mix of pass names"):
        resolve_pipeline("rope_cache,-cleanup")


def test_user_pass_registers_and_runs(tiny_llama):
    @ac.register_pass("count_linears", description="counts linear layers")
    def count_linears(gm) -> int:
        return sum(n.target is torch.ops.atom.linear.default for n in gm.graph.nodes)

    try:
        assert "count_linears" in [p.name for p in ac.list_passes()]
        assert resolve_pipeline("+count_linears")[-2:] == ["count_linears", "cleanup"]
        _, t = traced(tiny_llama)
        assert apply(t, "count_linears") == {"count_linears": 4 * 2}  # 4 projections a layer (the LM head: `logits`)
    finally:
        ac.unregister_pass("count_linears")
