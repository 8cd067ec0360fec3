"""A per-token FP8 quantizer followed by the `scaled_mm` that is its one user → one fp8_linear op.

Before:  x_q, s = quant_fp8_per_token(x, 0);             out = scaled_mm(x_q, s, w_q, w_s, b, dtype)
After:   out = fp8_linear(x, w_q, w_s, b, dtype)

Before:  x_q, s, r = fused_add_rms_norm_quant_fp8(x, res, g, eps, 0);   out = scaled_mm(x_q, s, w_q, w_s, b, dtype)
After:   out, r = fused_add_rms_norm_fp8_linear(x, res, g, eps, w_q, w_s, b, dtype)

and likewise `rms_norm_quant_fp8` and `silu_and_mul_quant_fp8` (into `rms_norm_fp8_linear`,
`silu_and_mul_fp8_linear`). For one token (a batch-1 decode step) the op is weight-only, a GEMV with the norm or
SiLU·mul as its prologue, so a decoder layer of an FP8 model runs 6 kernels instead of 10 (no quantizer of its
own); for more tokens it runs the quantizer and then `scaled_mm`, as before (see quant.py's fp8_linear). Runs
after `rms_norm_quant` and `silu_mul_quant`. Scale groups (block-scaled checkpoints, whose GEMM is
`scaled_mm_blockwise`) are left alone.
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

# quantizer -> the fused op that replaces it and its scaled_mm (every quantizer's last argument is its scale groups)
FUSED = {
    "quant_fp8_per_token": "fp8_linear",
    "rms_norm_quant_fp8": "rms_norm_fp8_linear",
    "fused_add_rms_norm_quant_fp8": "fused_add_rms_norm_fp8_linear",
    "silu_and_mul_quant_fp8": "silu_and_mul_fp8_linear",
}


@dataclass
class Match:
    quant: Node
    fused_name: str
    outputs: dict[int, Node]  # the quantizer's getitems: 0 values, 1 scales, 2 the residual sum (fused add)
    mm: Node


@register_pass("fp8_linear", version=1)
class FP8Linear(PatternPass):
    """A per-token FP8 quantizer (alone or fused with a norm or SiLU·mul) and its one scaled_mm -> an fp8_linear op."""

    def match(self, node: Node) -> Match | None:
        name = next((name for name in FUSED if is_call(node, op(name))), None)
        if name is None or call_args(node)[-1] != 0:
            return None
        outputs = getitem_users(node)
        if not outputs or 0 not in outputs or 1 not in outputs:
            return None
        users = list(outputs[0].users) + list(outputs[1].users)
        mm = users[0] if len(users) == 2 and users[0] is users[1] else None
        if not is_call(mm, op("scaled_mm")) or call_args(mm)[:2] != (outputs[0], outputs[1]):
            return None
        if 2 in outputs and used_between(outputs[2], node, mm):
            return None  # the fused op stands where the GEMM is: the sum is not there before it
        return Match(node, FUSED[name], outputs, mm)

    def replace(self, graph: Graph, m: Match) -> None:
        quant_args = call_args(m.quant)[:-1]  # without the scale groups (0)
        _, _, w_q, w_scale, bias, out_dtype = call_args(m.mm)
        with graph.inserting_before(m.mm):
            fused = graph.call_function(op(m.fused_name), (*quant_args, w_q, w_scale, bias, out_dtype))
        if m.fused_name == "fused_add_rms_norm_fp8_linear":  # returns (out, residual sum)
            replace_outputs({0: m.mm}, fused, graph, {0: 0})
            if 2 in m.outputs:
                replace_outputs({2: m.outputs[2]}, fused, graph, {2: 1})
        else:
            fused.meta.update(m.mm.meta)
            m.mm.replace_all_uses_with(fused)
        erase(graph, m.mm, *m.outputs.values(), m.quant)
