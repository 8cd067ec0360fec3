"""RMSNorm (alone, or with the residual add) followed by a projection → one fused op.

Before:  y = rms_norm(x, g, eps);                      out = linear(y, w, b)
After:   out = rms_norm_linear(x, g, eps, w, b)

Before:  y, r = fused_add_rms_norm(x, res, g, eps);    out = linear(y, w, b)
After:   out, r = fused_add_rms_norm_linear(x, res, g, eps, w, b)

For one token (a batch-1 decode step) the projection's kernel normalises its input itself (Triton
backend), so a decoder layer's two norms cost no kernel of their own; for more the op runs the norm
and then the projection. It fires only where the projection is the norm's one user: the packed qkv
and gate_up projections. FP8 projections take `rms_norm_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from atom_compile.passes.registry import (
    PatternPass,
    call_args,
    erase,
    is_call,
    normalized_value,
    op,
    register_pass,
    replace_outputs,
    used_between,
)


@dataclass
class Match:
    norm: Node
    linear: Node
    norm_outputs: dict[int, Node] | None  # getitems of fused_add_rms_norm; None for plain rms_norm


def only_linear_user(value: Node) -> Node | None:
    """The `linear` that is `value`'s one user, taking it as its input."""
    users = list(value.users)
    if len(users) == 1 and is_call(users[0], op("linear")) and call_args(users[0])[0] is value:
        return users[0]
    return None


def linear_args(linear: Node) -> tuple[Node, Node | None]:
    """(weight, bias) of a `linear` call."""
    _, weight, bias = call_args(linear)
    return weight, bias


@register_pass("rms_norm_linear", version=1)
class RMSNormLinear(PatternPass):
    """RMSNorm (+ residual add) followed by its one projection -> one fused op."""

    def match(self, node: Node) -> Match | None:
        found = normalized_value(node)
        linear = only_linear_user(found[0]) if found else None
        if linear is None:
            return None
        outputs = found[1]
        if outputs is not None and 1 in outputs and used_between(outputs[1], node, linear):
            return None  # the fused op replaces the norm where the linear is: the sum is not there before it
        return Match(node, linear, outputs)

    def replace(self, graph: Graph, m: Match) -> None:
        fused_op = op("rms_norm_linear") if m.norm_outputs is None else op("fused_add_rms_norm_linear")
        with graph.inserting_before(m.linear):
            fused = graph.call_function(fused_op, (*call_args(m.norm), *linear_args(m.linear)))
        if m.norm_outputs is None:
            fused.meta.update(m.linear.meta)
            m.linear.replace_all_uses_with(fused)
            erase(graph, m.linear, m.norm)
            return
        replace_outputs({0: m.linear}, fused, graph, {0: 0})
        erase(graph, m.linear)
        if 1 in m.norm_outputs:  # the residual sum
            replace_outputs({1: m.norm_outputs[1]}, fused, graph, {1: 1})
        erase(graph, *m.norm_outputs.values(), m.norm)
