"""RMSNorm (alone, or with the residual add) followed by per-token FP8 quantization → one fused op.

Before:  y = rms_norm(x, w, eps);                      y_q, s = quant_fp8_per_token(y, g)
After:   y_q, s = rms_norm_quant_fp8(x, w, eps, g)

Before:  y, r = fused_add_rms_norm(x, res, w, eps);    y_q, s = quant_fp8_per_token(y, g)
After:   y_q, s, r = fused_add_rms_norm_quant_fp8(x, res, w, eps, g)

The normalised activations then never reach memory in 16-bit form. It fires only where
every user of the norm's output is a quantization with the same scale groups `g` (the linear
layers after it are FP8; g is 0 for a scale per token, or the columns of one group).
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
    normalized_value,
    op,
    register_pass,
    replace_outputs,
)


@dataclass
class Match:
    norm: Node
    quants: list[Node]
    norm_outputs: dict[int, Node] | None  # getitems of fused_add_rms_norm; None for plain rms_norm


def group_size(quant: Node) -> int:
    """The scale groups of a `quant_fp8_per_token` call (0: one scale a token)."""
    return call_args(quant)[1]


def quantized_users(value: Node) -> list[Node] | None:
    """The users of `value` if all of them quantize it, with the same scale groups."""
    users = list(value.users)
    quantized = all(is_call(u, op("quant_fp8_per_token")) and getitem_users(u) is not None for u in users)
    return users if users and quantized and len({group_size(u) for u in users}) == 1 else None


@register_pass("rms_norm_quant", version=2)
class RMSNormQuant(PatternPass):
    """RMSNorm (+ residual add) followed by FP8 per-token quantization -> one fused op."""

    def match(self, node: Node) -> Match | None:
        found = normalized_value(node)
        quants = quantized_users(found[0]) if found else None
        return Match(node, quants, found[1]) if quants else None

    def replace(self, graph: Graph, m: Match) -> None:
        fused_op = op("rms_norm_quant_fp8") if m.norm_outputs is None else op("fused_add_rms_norm_quant_fp8")
        with graph.inserting_after(m.norm):
            fused = graph.call_function(fused_op, (*call_args(m.norm), group_size(m.quants[0])))
        for quant in m.quants:
            quant_outputs = getitem_users(quant)
            replace_outputs(quant_outputs, fused, graph, {0: 0, 1: 1})
            erase(graph, *quant_outputs.values(), quant)
        if m.norm_outputs is not None:
            if 1 in m.norm_outputs:  # the residual sum
                replace_outputs({1: m.norm_outputs[1]}, fused, graph, {1: 2})
            erase(graph, *m.norm_outputs.values())
        erase(graph, m.norm)
