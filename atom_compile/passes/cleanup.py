"""Drop what does nothing: metadata asserts, same-dtype casts, views to the same shape, dead code.

Export leaves `_assert_tensor_metadata` and `to(dtype)` pairs behind `.float()` on tensors
that are already fp32, and fusions leave views with no effect; each costs a node in every
piece and, in eager pieces, a Python call per step.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from atom_compile.passes.registry import is_call, op, register_pass

_ASSERTS = ("aten._assert_tensor_metadata.default",)
_IDENTITY_IF_SAME = ("aten.to.dtype", "aten._to_copy.default", "aten.view.default", "aten.reshape.default")
_ALIASES = ("aten.alias.default", "aten.detach.default")


def _same_tensor_meta(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if va is None or vb is None:
        return False
    return (
        va.dtype == vb.dtype
        and va.device == vb.device
        and [str(s) for s in va.shape] == [str(s) for s in vb.shape]
        and [str(s) for s in va.stride()] == [str(s) for s in vb.stride()]
    )


@register_pass("cleanup", version=1)
def cleanup(gm: GraphModule) -> int:
    """Remove no-op casts, views and asserts, then dead code."""
    removed = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if any(is_call(node, op(name)) for name in _ASSERTS) and not node.users:
            graph.erase_node(node)
            removed += 1
        elif any(is_call(node, op(name)) for name in _ALIASES) or (
            any(is_call(node, op(name)) for name in _IDENTITY_IF_SAME) and _same_tensor_meta(node, node.args[0])
        ):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    return removed + before - len(graph.nodes)
