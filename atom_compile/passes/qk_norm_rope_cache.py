"""Per-head QK RMSNorm + RoPE + KV-cache write → one fused op (Qwen3).

Before:  q_n = rms_norm(q, wq, eps);  k_n = rms_norm(k, wk, eps)
         q', k' = rotary_embedding(pos, q_n, k_n, cos_sin)
         out = unified_attention(q', k', v, kv_cache, ...)
After:   q' = qk_norm_rope_and_cache(pos, q, k, v, wq, wk, eps, cos_sin, kv_cache, slots)
         out = paged_attention(q', kv_cache, ...)

Runs before `rope_cache`, which would otherwise take the rotary alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from atom_compile.passes.registry import PatternPass, erase, is_call, op, register_pass
from atom_compile.passes.rope_cache import RopeIntoAttention, match_rope_into_attention


@dataclass
class Match:
    rope: RopeIntoAttention
    q_norm: Node
    k_norm: Node


@register_pass("qk_norm_rope_cache", version=1)
class QKNormRopeCache(PatternPass):
    """QK RMSNorm + RoPE + KV-cache write -> one fused op (Qwen3)."""

    def match(self, node: Node) -> Match | None:
        rope = match_rope_into_attention(node)
        if rope is None:
            return None
        q_norm, k_norm = rope.q, rope.k
        if not (is_call(q_norm, op("rms_norm")) and is_call(k_norm, op("rms_norm"))):
            return None
        if set(q_norm.users) != {rope.rotary} or set(k_norm.users) != {rope.rotary}:
            return None
        if q_norm.args[2] != k_norm.args[2]:  # one eps for both norms
            return None
        return Match(rope, q_norm, k_norm)

    def replace(self, graph: Graph, m: Match) -> None:
        (q, q_weight, eps), (k, k_weight, _) = m.q_norm.args, m.k_norm.args
        m.rope.fuse(graph, "qk_norm_rope_and_cache", q, k, (q_weight, k_weight, eps))
        erase(graph, m.q_norm, m.k_norm)
