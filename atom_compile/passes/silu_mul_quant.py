"""SiLU·mul followed by per-token FP8 quantization → one fused op.

Before:  h = silu_and_mul(x);  h_q, s = quant_fp8_per_token(h, g)
After:   h_q, s = silu_and_mul_quant_fp8(x, g)

It fires only where every user of the activation is a quantization with the same scale groups
(an FP8 down projection).
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
)
from atom_compile.passes.rms_norm_quant import group_size, quantized_users


@dataclass
class Match:
    activation: Node
    quants: list[Node]


@register_pass("silu_mul_quant", version=2)
class SiluMulQuant(PatternPass):
    """SiLU·mul followed by FP8 per-token quantization -> one fused op."""

    def match(self, node: Node) -> Match | None:
        if is_call(node, op("silu_and_mul")):
            quants = quantized_users(node)
            return Match(node, quants) if quants else None
        return None

    def replace(self, graph: Graph, m: Match) -> None:
        with graph.inserting_after(m.activation):
            arguments = (*call_args(m.activation), group_size(m.quants[0]))
            fused = graph.call_function(op("silu_and_mul_quant_fp8"), arguments)
        for quant in m.quants:
            outputs = getitem_users(quant)
            replace_outputs(outputs, fused, graph, {0: 0, 1: 1})
            erase(graph, *outputs.values(), quant)
        erase(graph, m.activation)
