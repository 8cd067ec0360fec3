"""Passes as data: named, versioned graph rewrites in a registry, run in a declared order.

A pass is a function `GraphModule -> number of matches` registered under a name. Most are
a `PatternPass`: `match(node)` finds one occurrence of the pattern anchored at a node and
`replace(graph, match)` rewrites it. The manager runs a list of names, records how often
each fired, and lints and recompiles the graph after each; the export refreshes the fake values once, after all.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

PassFunction = Callable[[GraphModule], int]


@dataclass(frozen=True)
class RegisteredPass:
    name: str
    run: PassFunction
    version: int
    description: str


@dataclass
class PassRecord:
    name: str
    version: int
    matches: int


_REGISTRY: dict[str, RegisteredPass] = {}

# The built-in order: quant fusions first (they need the plain norm/activation nodes; then the quantizers go into
# their GEMMs), then the fusions into unquantized projections, then the MLP's two into one op, then the attention-side
# fusions, then cleanup of whatever the others left behind.
DEFAULT_PIPELINE = [
    "rms_norm_quant",
    "silu_mul_quant",
    "fp8_linear",
    "rms_norm_linear",
    "silu_mul_linear",
    "gated_mlp",
    "final_norm_rows",
    "qk_norm_rope_cache",
    "rope_cache",
    "qkv_rope_cache",
    "cleanup",
]


def register_pass(name: str, *, version: int = 1, description: str = "") -> Callable:
    """Decorator for a pass function or a PatternPass subclass; user passes register the same way."""

    def wrap(obj):
        run = obj() if isinstance(obj, type) else obj
        if name in _REGISTRY:
            raise ValueError(f"a pass named {name!r} is already registered")
        _REGISTRY[name] = RegisteredPass(name, run, version, description or (obj.__doc__ or "").strip().split("\n")[0])
        return obj

    return wrap


def unregister_pass(name: str) -> None:
    _REGISTRY.pop(name)


def get_pass(name: str) -> RegisteredPass:
    if name not in _REGISTRY:
        raise KeyError(f"unknown pass {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def list_passes() -> list[RegisteredPass]:
    return [_REGISTRY[n] for n in DEFAULT_PIPELINE if n in _REGISTRY] + [
        p for n, p in _REGISTRY.items() if n not in DEFAULT_PIPELINE
    ]


def resolve_pipeline(spec: str | list[str] | None) -> list[str]:
    """Pass names to run. A spec is a list of names, or '+name,-name' edits of the default pipeline.

    Added passes run before `cleanup`, in the order given.
    """
    if spec is None:
        return list(DEFAULT_PIPELINE)
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    items = [s for s in items if s]
    if not items:
        return list(DEFAULT_PIPELINE)
    if not all(s[0] in "+-" for s in items):
        if any(s[0] in "+-" for s in items):
            raise ValueError(f"mix of pass names and +/- edits in {spec!r}; use one or the other")
        for name in items:
            get_pass(name)
        return items
    pipeline = list(DEFAULT_PIPELINE)
    for item in items:
        name = item[1:]
        get_pass(name)
        if item[0] == "-":
            if name in pipeline:
                pipeline.remove(name)
        elif name not in pipeline:
            at = pipeline.index("cleanup") if "cleanup" in pipeline else len(pipeline)
            pipeline.insert(at, name)
    return pipeline


def run_passes(gm: GraphModule, pipeline: list[str]) -> list[PassRecord]:
    records = []
    for name in pipeline:
        registered = get_pass(name)
        matches = registered.run(gm)
        gm.graph.lint()
        gm.recompile()
        records.append(PassRecord(name, registered.version, matches))
    return records


# ---- pattern passes ---------------------------------------------------------------------


def op(name: str) -> torch._ops.OpOverload:
    """`torch.ops.atom.<name>.default`, or an aten op given as 'aten.<name>.<overload>'."""
    if name.startswith("aten."):
        _, packet, overload = name.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)
    return getattr(torch.ops.atom, name).default


def is_call(node: Any, target: torch._ops.OpOverload) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def call_args(node: Node) -> tuple:
    """An op call's arguments in its schema's order, keyword ones and defaults included."""
    values = []
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            values.append(node.args[i])
        elif argument.name in node.kwargs:
            values.append(node.kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise ValueError(f"{node.format_node()} lacks argument {argument.name!r}")
    return tuple(values)


def used_between(value: Node, start: Node, end: Node) -> bool:
    """Whether a node after `start` and before `end` (in graph order) uses `value`."""
    node = start.next
    while node is not end and node.op != "root":
        if value in node.all_input_nodes:
            return True
        node = node.next
    return False


def getitem_users(node: Node) -> dict[int, Node] | None:
    """Index -> getitem node for a multi-output node, or None if anything else uses it."""
    found = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        found[user.args[1]] = user
    return found


def normalized_value(node: Node) -> tuple[Node, dict[int, Node] | None] | None:
    """For an `rms_norm` call: (it, None); for a `fused_add_rms_norm` used only through getitems: (its normalised
    output's getitem, the getitems by index); else None."""
    if is_call(node, op("rms_norm")):
        return node, None
    if is_call(node, op("fused_add_rms_norm")):
        outputs = getitem_users(node)
        if outputs and 0 in outputs:
            return outputs[0], outputs
    return None


def output_of(node: Node) -> tuple[Node, int] | None:
    """(producer, index) when `node` is `producer[index]`."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return None


def replace_outputs(old: dict[int, Node], new: Node, graph: Graph, index_map: dict[int, int]) -> None:
    """Point users of `old[i]` (getitems of a replaced node) at `new[index_map[i]]`."""
    for i, getitem in old.items():
        with graph.inserting_after(new):
            fresh = graph.call_function(operator.getitem, (new, index_map[i]))
        fresh.meta.update(getitem.meta)
        getitem.replace_all_uses_with(fresh)


def erase(graph: Graph, *nodes: Node) -> None:
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


class PatternPass:
    """Base for pattern → replacement passes: subclasses define `match` and `replace`."""

    def match(self, node: Node) -> Any | None:
        raise NotImplementedError

    def replace(self, graph: Graph, match: Any) -> None:
        raise NotImplementedError

    def __call__(self, gm: GraphModule) -> int:
        count = 0
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False):  # removed by an earlier replacement
                continue
            found = self.match(node)
            if found is not None:
                self.replace(gm.graph, found)
                count += 1
        return count
