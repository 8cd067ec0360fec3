"""A Llama attention's fused qkv projection, then RoPE and the cache write → one op.

Before:  qkv, r = fused_add_rms_norm_linear(x, res, g, eps, w, b)
         q, k, v = (t.view(-1, heads, head_dim) for t in split(qkv, [q_width, kv_width, kv_width]))
         q' = rope_and_cache(pos, q, k, v, cos_sin, kv_cache, slots)
After:   q', r = qkv_rope_and_cache(x, res, g, eps, w, None, b, None, pos, cos_sin, kv_cache, slots, heads)

and likewise from `rms_norm_linear` (the first layer: no residual) and the FP8 ops (`rms_norm_fp8_linear`,
`fused_add_rms_norm_fp8_linear`: their weight scale and out_dtype in place of the Nones). For one token the op
rotates q and k and writes k and v to the cache in the projection GEMV's epilogue (Triton backend; see
ops/attention.py), so a decode step has no RoPE kernel between the projection and attention: Llama-3-8B FP8 batch 1
3.206 / 3.202 -> 3.187 / 3.196 ms a step (graph replays 3.205 / 3.203 -> 3.194 / 3.192; H100, 2026-11-27). Runs after
`rope_cache` (which makes `rope_and_cache`) and the projection fusions; Qwen3's QK norm (a reduction over each head,
which no GEMV program holds whole) keeps its own kernel.
"""

from __future__ import annotations

import operator
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
    used_between,
)

# projection op -> (whether it takes a residual, whether it is FP8)
PROJECTIONS = {
    "rms_norm_linear": (False, False),
    "fused_add_rms_norm_linear": (True, False),
    "rms_norm_fp8_linear": (False, True),
    "fused_add_rms_norm_fp8_linear": (True, True),
}


@dataclass
class Match:
    rope: Node  # rope_and_cache
    projection: Node
    outputs: dict[int, Node] | None  # the projection's getitems where it returns (qkv, residual sum)
    chain: list[Node]  # split, its getitems, the head views: erased with the rope and the projection


def _projection(node: Node) -> tuple[bool, bool] | None:
    return next((kinds for name, kinds in PROJECTIONS.items() if is_call(node, op(name))), None)


def _heads_of(view: Node) -> tuple[Node, int] | None:
    """(split, index) where `view` is split[index].view(...) and nothing else uses either."""
    if not (is_call(view, op("aten.view.default")) and len(view.users) == 1):
        return None
    item = view.args[0]
    if not (item.op == "call_function" and item.target is operator.getitem and len(item.users) == 1):
        return None
    return item.args[0], item.args[1]


def match_qkv_rope(node: Node) -> Match | None:
    if not is_call(node, op("rope_and_cache")):
        return None
    _, q, k, v, cos_sin, *_ = call_args(node)
    heads = [_heads_of(view) for view in (q, k, v)]
    if any(h is None for h in heads) or [i for _, i in heads] != [0, 1, 2] or len({s for s, _ in heads}) != 1:
        return None
    split = heads[0][0]
    if not is_call(split, op("aten.split_with_sizes.default")) or len(split.users) != 3:
        return None
    source, sizes, dim = call_args(split)
    (_, q_heads, head_dim), width = q.meta["val"].shape, source.meta["val"].dim()
    if dim % width != width - 1 or len(sizes) != 3 or sizes[0] != q_heads * head_dim or sizes[1] != sizes[2]:
        return None  # not [q | k | v] along the last dimension
    if cos_sin.meta["val"].shape[-1] != head_dim:  # partial rotary: not what the epilogue rotates
        return None
    item = source.op == "call_function" and source.target is operator.getitem and source.args[1] == 0
    projection = source.args[0] if item else source
    outputs = getitem_users(projection) if item else None  # (qkv, residual sum) of a projection with a residual
    kinds = _projection(projection)
    if kinds is None or kinds[0] != item or (item and outputs is None) or len(source.users) != 1:
        return None
    if outputs and 1 in outputs and used_between(outputs[1], projection, node):
        return None  # the fused op stands where the rope is: the sum is not there before it
    chain = [split, *(view.args[0] for view in (q, k, v)), q, k, v]
    return Match(node, projection, outputs, chain)


@register_pass("qkv_rope_cache", version=1)
class QKVRopeCache(PatternPass):
    """Fused qkv projection + rope_and_cache -> qkv_rope_and_cache (RoPE and cache write in the GEMV's epilogue)."""

    def match(self, node: Node) -> Match | None:
        return match_qkv_rope(node)

    def replace(self, graph: Graph, m: Match) -> None:
        residual_taken, fp8 = _projection(m.projection)
        args = list(call_args(m.projection))
        x, residual = args[0], (args.pop(1) if residual_taken else None)
        norm_weight, eps, weight, *rest = args[1:]
        weight_scale, bias, out_dtype = rest if fp8 else (None, rest[0], None)
        positions, q, _, _, cos_sin, kv_cache, slots, k_scale, v_scale = call_args(m.rope)
        with graph.inserting_before(m.rope):
            fused = graph.call_function(
                op("qkv_rope_and_cache"),
                (x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype, positions, cos_sin, kv_cache)
                + (slots, q.meta["val"].shape[-2], k_scale, v_scale),
            )
            q_out = graph.call_function(operator.getitem, (fused, 0))
            summed = graph.call_function(operator.getitem, (fused, 1))
        q_out.meta.update(m.rope.meta)
        m.rope.replace_all_uses_with(q_out)
        if m.outputs and 1 in m.outputs:
            summed.meta.update(m.outputs[1].meta)
            m.outputs[1].replace_all_uses_with(summed)
        erase(graph, m.rope, *reversed(m.chain), *(m.outputs or {}).values(), m.projection, summed)
