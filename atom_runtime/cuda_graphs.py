"""CUDA graphs of whole decode steps, one per batch-size bucket.

A pure-decode batch of `b` sequences is padded up to the smallest captured size and replays
that size's graph: every kernel of the forward (compiled pieces and attention alike) in one
launch, over the runner's persistent input buffers and KV cache. Prefill and mixed batches
run outside the graphs. All sizes share one memory pool; capture goes largest first so the
smaller graphs fit inside what the largest reserved.
"""

from __future__ import annotations

import bisect
import sys
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm

from atom_runtime.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from atom_runtime.model_runner import ModelRunner


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, sizes: list[int]):
        self.runner = runner
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.pool = None

    def size_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The captured size that runs this step, or None if it must run outside the graphs."""
        if not all(c.num_tokens == 1 and c.samples for c in chunks):
            return None
        at = bisect.bisect_left(self.sizes, len(chunks))
        return self.sizes[at] if at < len(self.sizes) else None

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None, progress: bool = True) -> None:
        sizes = sorted(sizes or self.sizes, reverse=True)
        for size in tqdm(sizes, desc="Capturing CUDA graphs", unit="graph", disable=not progress, file=sys.stderr):
            args = self.runner._step_args(*self.runner.inputs.load([], pad_seqs_to=size))
            self.runner.model.forward(*args)  # warm up: lazy initialisation stays out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.runner.model.forward(*args)
            self.pool = self.pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> Tensor:
        self.graphs[size].replay()
        return self.outputs[size]
