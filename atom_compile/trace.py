"""Trace a whole model forward once, to one FX graph.

We trace with `torch.export` rather than through a Dynamo backend of `torch.compile`:

- export gives one whole graph of the entire forward, with no graph breaks and no guards,
  its weights lifted out as placeholders (so identical layers become identical pieces
  that differ only in which weights they are fed), and symbolic sizes for the token and
  sequence dimensions;
- the result is plain data that we rewrite, split, compile and write to disk at export
  time. Serving loads what was written and calls it: nothing is traced at serve time,
  and no guard can trigger a recompile mid-request, which a Dynamo backend (compiling
  lazily on the first call, re-tracing on guard failures) cannot promise.

The custom ops in `atom_models.ops` trace as single opaque nodes through their fake
implementations; attention and KV-cache ops among them become the split points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of

# The user inputs of a traced forward, in placeholder order (kv_caches expands to one per layer).
USER_INPUTS = (
    "input_ids",
    "positions",
    "kv_caches",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "logits_indices",
)


class FlatForward(nn.Module):
    """The model forward with the attention metadata as separate tensors, as export wants them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[torch.Tensor],
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
    ):
        meta = AttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)
        return self.model(input_ids, positions, kv_caches, meta, logits_indices)


@dataclass
class GraphInput:
    """One placeholder of the traced graph: a model tensor (by state-dict name) or a step input."""

    placeholder: str
    kind: str  # "weight" or "input"
    target: str  # state-dict name of a weight, or the step input's name (kv_caches_3, input_ids, ...)


@dataclass
class TracedModel:
    graph_module: GraphModule
    inputs: list[GraphInput]
    exported: ExportedProgram


def graph_arguments(
    inputs: list[GraphInput],
    weights: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
) -> list[torch.Tensor]:
    """The traced graph's placeholders, in order, for one step of the model."""
    step = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": meta.slot_mapping,
        "block_tables": meta.block_tables,
        "seq_lens": meta.seq_lens,
        "query_start_loc": meta.query_start_loc,
        "logits_indices": logits_indices,
    }
    step.update((f"kv_caches_{i}", cache) for i, cache in enumerate(kv_caches))
    return [weights[i.target] if i.kind == "weight" else step[i.target] for i in inputs]


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (shared ones included), as graph inputs name them."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def example_inputs(model: nn.Module) -> tuple[tuple, tuple]:
    """Small example step (2 sequences, 8 tokens) and the dynamic dimensions of every input."""
    config = model.config
    device = next(model.parameters()).device
    num_blocks, block_size = 6, 16
    cache_shape = (2, num_blocks, block_size, config.num_key_value_heads, head_dim_of(config))
    kv_caches = [
        torch.zeros(cache_shape, dtype=_dtype_of(model), device=device) for _ in range(config.num_hidden_layers)
    ]
    i32 = dict(dtype=torch.int32, device=device)
    args = (
        torch.zeros(8, dtype=torch.int64, device=device),
        torch.arange(8, device=device),
        kv_caches,
        torch.arange(8, device=device),
        torch.tensor([[0, 1, 2], [3, 4, 5]], **i32),
        torch.tensor([3, 5], **i32),
        torch.tensor([0, 3, 8], **i32),
        torch.tensor([2, 7], device=device),
    )
    tokens, seqs = Dim("num_tokens"), Dim("num_seqs")
    blocks, max_blocks, logits = Dim("num_blocks"), Dim("max_blocks_per_seq"), Dim("num_logits")
    dynamic = (
        {0: tokens},
        {0: tokens},
        [{1: blocks}] * config.num_hidden_layers,
        {0: tokens},
        {0: seqs, 1: max_blocks},
        {0: seqs},
        {0: seqs + 1},
        {0: logits},
    )
    return args, dynamic


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() >= 2)


def trace_model(model: nn.Module) -> TracedModel:
    """Export `model` (an atom causal LM) to one FX graph with dynamic token and sequence counts."""
    args, dynamic = example_inputs(model)
    with torch.inference_mode(False), torch.no_grad():
        exported = torch.export.export(FlatForward(model), args, dynamic_shapes=dynamic)
    inputs = []
    user_names = iter(_user_input_names(model.config.num_hidden_layers))
    for spec in exported.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            inputs.append(GraphInput(spec.arg.name, "weight", spec.target.removeprefix("model.")))
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(GraphInput(spec.arg.name, "input", next(user_names)))
        else:
            raise NotImplementedError(f"unexpected graph input kind {spec.kind} for {spec.arg.name}")
    return TracedModel(exported.graph_module, inputs, exported)


def _user_input_names(num_layers: int) -> list[str]:
    names = []
    for name in USER_INPUTS:
        if name == "kv_caches":
            names.extend(f"kv_caches_{i}" for i in range(num_layers))
        else:
            names.append(name)
    return names
