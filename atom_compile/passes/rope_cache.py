"""RoPE + KV-cache write → one fused op, taking the write out of attention (Llama).

Before:  q', k' = rotary_embedding(pos, q, k, cos_sin)
         out = unified_attention(q', k', v, kv_cache, slots, block_tables, seq_lens, query_start_loc)
After:   q' = rope_and_cache(pos, q, k, v, cos_sin, kv_cache, slots)
         out = paged_attention(q', kv_cache, block_tables, seq_lens, query_start_loc)

The rotated keys go straight from registers into the cache, and attention only reads it.
An FP8 cache's k/v scales, when the model passes them, follow into both ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from atom_compile.passes.registry import PatternPass, erase, getitem_users, is_call, op, output_of, register_pass


@dataclass
class RopeIntoAttention:
    attention: Node
    rotary: Node
    rotated: list[Node]  # the rotary's getitems (q', k')

    @property
    def positions(self) -> Node:
        return self.rotary.args[0]

    @property
    def q(self) -> Node:
        return self.rotary.args[1]

    @property
    def k(self) -> Node:
        return self.rotary.args[2]

    @property
    def cos_sin_cache(self) -> Node:
        return self.rotary.args[3]

    def fuse(self, graph: Graph, write_op: str, q: Node, k: Node, extra_args: tuple) -> None:
        """Replace rotary + unified_attention by `write_op(...)` + paged_attention."""
        q_rot, k_rot, v, kv_cache, slots, block_tables, seq_lens, query_start_loc, scale, *kv_scales = (
            self.attention.args
        )
        with graph.inserting_before(self.attention):
            q_out = graph.call_function(
                op(write_op), (self.positions, q, k, v, *extra_args, self.cos_sin_cache, kv_cache, slots, *kv_scales)
            )
            out = graph.call_function(
                op("paged_attention"), (q_out, kv_cache, block_tables, seq_lens, query_start_loc, scale, *kv_scales)
            )
        q_out.meta["val"] = q_rot.meta.get("val")
        out.meta.update(self.attention.meta)
        self.attention.replace_all_uses_with(out)
        erase(graph, self.attention, *self.rotated, self.rotary)


def match_rope_into_attention(node: Node) -> RopeIntoAttention | None:
    """unified_attention whose q and k come only from one rotary_embedding."""
    if not is_call(node, op("unified_attention")):
        return None
    q_rot, k_rot = node.args[0], node.args[1]
    q_source, k_source = output_of(q_rot), output_of(k_rot)
    if q_source is None or k_source is None or q_source != (k_source[0], 0) or k_source[1] != 1:
        return None
    rotary = q_source[0]
    if not is_call(rotary, op("rotary_embedding")) or getitem_users(rotary) is None:
        return None
    if set(q_rot.users) != {node} or set(k_rot.users) != {node}:
        return None
    return RopeIntoAttention(node, rotary, [q_rot, k_rot])


@register_pass("rope_cache", version=1)
class RopeCache(PatternPass):
    """RoPE + KV-cache write -> one fused op; attention then only reads the cache (Llama)."""

    def match(self, node: Node) -> RopeIntoAttention | None:
        return match_rope_into_attention(node)

    def replace(self, graph: Graph, m: RopeIntoAttention) -> None:
        m.fuse(graph, "rope_and_cache", m.q, m.k, ())
