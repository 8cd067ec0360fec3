"""A decoder layer's MLP half (after `rms_norm_linear`/`fp8_linear` and `silu_mul_linear`) → one op.

Before:  gate_up, r = fused_add_rms_norm_linear(x, res, g, eps, w1, b1);   out = silu_and_mul_linear(gate_up, w2, b2)
After:   out, r = fused_add_rms_norm_mlp(x, res, g, eps, w1, None, b1, w2, None, b2, None)

and likewise with either projection FP8 (`fused_add_rms_norm_fp8_linear`, `silu_and_mul_fp8_linear`: their
weight scales go in place of None, their out_dtype in place of the last). For one token the op runs the gate_up
GEMV with SiLU·mul in its epilogue and then a plain down GEMV, where the down GEMV's prologue computed the
activation in each of its programs (Triton backend; see ops/mlp.py); for more tokens it runs the two ops. It fires
where the activation's one user is the down projection, FP8 projections produce one dtype, and the residual sum is
not used before the down projection.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from atom_compile.passes.registry import (
    PatternPass,
    call_args,
    erase,
    getitem_users,
    is_call,
    op,
    register_pass,
    replace_outputs,
    used_between,
)

GATE_UPS = ("fused_add_rms_norm_linear", "fused_add_rms_norm_fp8_linear")
DOWNS = ("silu_and_mul_linear", "silu_and_mul_fp8_linear")


@dataclass
class Match:
    gate_up: Node
    outputs: dict[int, Node]  # the gate_up op's getitems: 0 its projection, 1 the residual sum
    down: Node


def _projection(node: Node) -> tuple[tuple, Node | None, object]:
    """(the op's arguments but an FP8 weight's scale and out_dtype, that scale and out_dtype, or None and None)."""
    args = call_args(node)
    if is_call(node, op("fused_add_rms_norm_fp8_linear")) or is_call(node, op("silu_and_mul_fp8_linear")):
        *rest, scale, bias, out_dtype = args
        return (*rest, bias), scale, out_dtype
    return args, None, None


@register_pass("gated_mlp", version=1)
class GatedMLP(PatternPass):
    """The fused gate_up projection and its one fused down projection -> one op."""

    def match(self, node: Node) -> Match | None:
        if not any(is_call(node, op(name)) for name in GATE_UPS):
            return None
        outputs = getitem_users(node)
        if not outputs or 0 not in outputs or len(outputs[0].users) != 1:
            return None
        down = next(iter(outputs[0].users))
        if not any(is_call(down, op(name)) for name in DOWNS) or call_args(down)[0] is not outputs[0]:
            return None
        dtypes = {_projection(node)[2], _projection(down)[2]} - {None}
        if len(dtypes) > 1:
            return None
        if 1 in outputs and used_between(outputs[1], node, down):
            return None  # the fused op stands where the down projection is: the sum is not there before it
        return Match(node, outputs, down)

    def replace(self, graph: Graph, m: Match) -> None:
        (x, residual, norm_weight, eps, gate_up_weight, gate_up_bias), gate_up_scale, dtype = _projection(m.gate_up)
        (_, down_weight, down_bias), down_scale, down_dtype = _projection(m.down)
        with graph.inserting_before(m.down):
            fused = graph.call_function(
                op("fused_add_rms_norm_mlp"),
                (x, residual, norm_weight, eps, gate_up_weight, gate_up_scale, gate_up_bias, down_weight, down_scale)
                + (down_bias, dtype or down_dtype),
            )
        replace_outputs({0: m.down}, fused, graph, {0: 0})
        if 1 in m.outputs:
            replace_outputs({1: m.outputs[1]}, fused, graph, {1: 1})
        erase(graph, m.down, *m.outputs.values(), m.gate_up)
