"""Split the traced graph at the KV-cache ops (attention and cache writes) into pieces.

Each piece between two attention ops is a pure function of its inputs (weights included),
which Inductor compiles for a dynamic token count. The KV-cache ops stay single-op pieces
that run as they are, between the compiled ones. Pieces that differ only in which weights
they are fed (every middle layer) get the same structural key and compile once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import xxhash
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.split_module import split_module

from atom_models.ops import KV_CACHE_OPS


def kv_cache_targets() -> set:
    return {getattr(torch.ops.atom, name.split("::")[1]).default for name in KV_CACHE_OPS}


@dataclass
class Piece:
    name: str  # the submodule's name in the split graph (submod_N)
    graph_module: GraphModule
    key: str  # structural hash: equal keys compute the same function of their inputs
    runs_eagerly: bool  # a KV-cache op, never compiled

    @property
    def returns_tuple(self) -> bool:
        output = next(n for n in self.graph_module.graph.nodes if n.op == "output")
        return isinstance(output.args[0], tuple | list)


def propagate_fake_values(gm: GraphModule) -> None:
    """Recompute every node's fake value (shape, dtype, symbolic sizes) after passes added nodes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(n.meta["val"].fake_mode for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor))
    with torch.no_grad():
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*[n.meta["val"] for n in placeholders])


def structural_key(gm: GraphModule) -> str:
    """Hash of the graph with every value named by position: identical layers hash equal."""
    index: dict[Node, int] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        line = f"{node.op}|{node.target if node.op != 'placeholder' else ''}|{args}"
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                line += f"|{val.dtype}|{[str(s) for s in val.shape]}|{[str(s) for s in val.stride()]}|{val.device}"
            else:
                line += f"|{val!r}"
        lines.append(line)
    return xxhash.xxh64("\n".join(lines).encode()).hexdigest()


def split_at_attention(gm: GraphModule) -> tuple[GraphModule, list[Piece]]:
    """The top-level graph calling `submod_N` in order, and the pieces themselves."""
    split_ops = kv_cache_targets()
    partition: dict[Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in split_ops:
            partition[node] = current + 1
            current += 2
        elif node.target is operator.getitem and getattr(node.args[0], "target", None) in split_ops:
            partition[node] = partition[node.args[0]]  # an item of a KV-cache op's results: its piece returns them
        else:
            partition[node] = current
    top = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for name, sub in top.named_children():
        ops = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        eager = len(ops) == 1 and ops[0].target in split_ops
        pieces.append(Piece(name, sub, structural_key(sub), eager))
    return top, pieces
