"""SiLU·mul followed by a projection → one fused op.

Before:  h = silu_and_mul(x);  out = linear(h, w, b)
After:   out = silu_and_mul_linear(x, w, b)

For one token (a batch-1 decode step) the down projection's kernel computes SiLU(gate)·up from its
input itself (Triton backend): one kernel a layer fewer; for more the op runs the activation and
then the projection. It fires only where the projection is the activation's one user; an FP8 down
projection takes `silu_mul_quant`.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from atom_compile.passes.registry import PatternPass, call_args, erase, is_call, op, register_pass
from atom_compile.passes.rms_norm_linear import linear_args, only_linear_user


@register_pass("silu_mul_linear", version=1)
class SiluMulLinear(PatternPass):
    """SiLU·mul followed by its one projection -> one fused op."""

    def match(self, node: Node) -> tuple[Node, Node] | None:
        if is_call(node, op("silu_and_mul")):
            linear = only_linear_user(node)
            return (node, linear) if linear else None
        return None

    def replace(self, graph: Graph, m: tuple[Node, Node]) -> None:
        activation, linear = m
        with graph.inserting_before(linear):
            fused = graph.call_function(op("silu_and_mul_linear"), (*call_args(activation), *linear_args(linear)))
        fused.meta.update(linear.meta)
        linear.replace_all_uses_with(fused)
        erase(graph, linear, activation)
