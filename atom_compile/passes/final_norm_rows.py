"""A model's final norm, then the rows whose logits the step computes → the norm over those rows only.

Before:  y, r = fused_add_rms_norm(x, res, g, eps);    out = index_select(y, 0, rows)
After:   out = fused_add_rms_norm_rows(x, res, g, eps, rows)

The norm's kernel gathers the rows itself, so a decode step has no kernel (an Inductor one, outside the chain of
PDL launches) for the selection, and a prefill normalises only its sampled rows. It fires only where the norm's
residual sum has no users (the last layer's). Joining the norm to the LM head's projection instead (branch
`final-norm-rows`, fifteenth session) cost the projection's prologue what the kernels saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from atom_compile.passes.registry import PatternPass, call_args, erase, is_call, op, output_of, register_pass


@dataclass
class Match:
    norm: Node
    select: Node
    normalized: Node  # the norm's getitem 0


@register_pass("final_norm_rows", version=1)
class FinalNormRows(PatternPass):
    """fused_add_rms_norm whose output only index_select(0, rows) uses, and whose sum nothing uses -> one op."""

    def match(self, node: Node) -> Match | None:
        if not is_call(node, op("aten.index_select.default")) or call_args(node)[1] != 0:
            return None
        found = output_of(call_args(node)[0])
        if found is None or found[1] != 0 or not is_call(found[0], op("fused_add_rms_norm")):
            return None
        norm, normalized = found[0], call_args(node)[0]
        if len(normalized.users) != 1 or any(user is not normalized and user.users for user in norm.users):
            return None
        return Match(norm, node, normalized)

    def replace(self, graph: Graph, m: Match) -> None:
        rows = call_args(m.select)[2]
        with graph.inserting_before(m.select):
            fused = graph.call_function(op("fused_add_rms_norm_rows"), (*call_args(m.norm), rows))
        fused.meta.update(m.select.meta)
        m.select.replace_all_uses_with(fused)
        erase(graph, m.select, *m.norm.users, m.norm)
