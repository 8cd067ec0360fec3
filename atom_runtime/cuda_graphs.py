"""CUDA graphs: whole decode steps (FULL) and the compiled pieces between attention ops (PIECEWISE).

FULL graphs:

A pure-decode batch of `b` sequences is padded up to the smallest captured size and replays
that size's graph: every kernel of the forward (compiled pieces and attention alike) in one launch, over the
runner's persistent input buffers and KV cache, and each row's token drawn from the logits (`sample_rows`: the
argmax, or a draw by the row's temperature, seed and position, also step inputs): the batch's samples unless a
row's penalties or filters change the logits (no launch of its own around the graph). They are drawn into the
graph's input ids, where the next decode step of the batch reads them, and the draw moves the graph's positions,
slots and lengths one token on, so that step usually copies nothing (see `atom_runtime.step_inputs`).
A lone sequence of at most SHORT_CONTEXT tokens replays a second graph of size 1, captured over its block table's
first columns only: a lone sequence's attention launch takes no more splits than its table has tiles
(`attention.decode_splits`), so the short graph's grid has no idle programs beyond those tiles (8 KV heads on an
H100: 128 programs, one a multiprocessor, where the full table's 264 put two on some), and a short context's active
programs land one a multiprocessor.
Prefill and mixed batches run outside the graphs, or through the PIECEWISE graphs below. All graphs are
captured into one memory pool, largest first so the smaller graphs fit inside what the largest reserved (FULL
and piecewise graphs capture on different streams, so the allocator keeps their blocks apart).
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from atom_models.ops.sampling import sample_rows
from atom_runtime.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from atom_compile.load import CompiledModel
    from atom_runtime.model_runner import ModelRunner


# Tokens a lone sequence may hold to replay the short batch-1 graph (see the module's docstring).
SHORT_CONTEXT = 2048


def short_table_blocks(max_blocks: int, block_size: int) -> int | None:
    """Block-table columns of the short batch-1 graph, or None where the full table is less than twice as wide (its
    launch then differs little from the short one's)."""
    short = -(-SHORT_CONTEXT // block_size)
    return short if 2 * short <= max_blocks else None


def fits_short_graph(num_seqs: int, context: int) -> bool:
    """Whether a decode step of `num_seqs` sequences of at most `context` tokens (the new one included) replays the
    short batch-1 graph, where there is one."""
    return num_seqs == 1 and context <= SHORT_CONTEXT


# Sequence buckets of FULL graphs of prefill and mixed steps: a step's sequences are padded up to one with empty
# sequences (its attention launch's grid and splits follow from the count), its tokens up to a token size.
MIXED_SEQS = (4, 16, 64, 256)


class GraphKey(NamedTuple):
    """A captured graph: its sequences, the block-table columns it reads (None: all of them), and its tokens (None:
    a decode graph's, one a sequence)."""

    size: int
    table_blocks: int | None = None
    tokens: int | None = None


def mixed_seq_buckets(max_seqs: int) -> list[int]:
    return sorted({s for s in MIXED_SEQS if s < max_seqs} | {max_seqs})


class FullGraphs:
    """Whole-step graphs: decode batches by batch size and, given `mixed_tokens`, prefill and mixed steps by (tokens,
    sequences) buckets (no prompt_logprobs rows), their samples drawn after the graph as the piecewise path's are."""

    def __init__(self, runner: ModelRunner, sizes: list[int], pool, mixed_tokens: list[int] = ()):
        self.runner = runner
        self.sizes = sorted(sizes)
        self.mixed_tokens = sorted(mixed_tokens)
        self.mixed_seqs = mixed_seq_buckets(runner.inputs.max_seqs) if mixed_tokens else []
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, tuple[Tensor, Tensor | None]] = {}  # (logits, each row's drawn token)
        self.pool = pool
        self.short_blocks = self.short_graph_blocks(
            sizes, runner.inputs.block_tables.shape[1], runner.inputs.block_size
        )

    @staticmethod
    def short_graph_blocks(sizes: list[int], max_blocks: int, block_size: int) -> int | None:
        """The short batch-1 graph's block-table columns, or None where there is none (no batch-1 graph, or a table
        too narrow for it to matter)."""
        return short_table_blocks(max_blocks, block_size) if 1 in sizes else None

    def capture_keys(self) -> list[GraphKey]:
        """Every graph to capture, largest first (in tokens)."""
        short = [GraphKey(1, self.short_blocks)] if self.short_blocks else []
        mixed = [GraphKey(s, None, t) for t in self.mixed_tokens for s in self.mixed_seqs if s < t]
        keys = [GraphKey(size) for size in self.sizes] + mixed
        return sorted(keys, key=lambda k: (k.tokens or k.size, k.size), reverse=True) + short

    def key_for(self, chunks: list[ScheduledChunk]) -> GraphKey | None:
        """The captured graph that runs this step, or None if it must run outside the graphs."""
        if not all(c.num_tokens == 1 and c.samples for c in chunks):
            return self._mixed_key(chunks) if self.mixed_tokens else None
        if self.short_blocks and fits_short_graph(len(chunks), chunks[0].start + 1):
            return GraphKey(1, self.short_blocks)
        at = bisect.bisect_left(self.sizes, len(chunks))
        return GraphKey(self.sizes[at]) if at < len(self.sizes) else None

    def _mixed_key(self, chunks: list[ScheduledChunk]) -> GraphKey | None:
        """A prefill or mixed step's graph: sequences padded to a bucket with empty ones, tokens to a token size past
        the bucket's count (more tokens than sequences: attention's decode-only launch is a decode graph's)."""
        if any(c.scored for c in chunks):
            return None
        at = bisect.bisect_left(self.mixed_seqs, len(chunks))
        if at == len(self.mixed_seqs):
            return None
        seqs = self.mixed_seqs[at]
        tokens = sum(c.num_tokens for c in chunks)
        at = bisect.bisect_left(self.mixed_tokens, max(tokens, seqs + 1))
        return GraphKey(seqs, None, self.mixed_tokens[at]) if at < len(self.mixed_tokens) else None

    def load(self, key: GraphKey, chunks: list[ScheduledChunk], in_flight: Tensor | None = None) -> tuple[int, ...]:
        """Write a step's inputs as `key`'s graph reads them (a logits row a sequence, padding included; tokens padded
        only in a mixed step's graph); returns their (tokens, seqs, logits) counts."""
        return self.runner.inputs.load(
            chunks, pad_seqs_to=key.size, in_flight=in_flight, pad_tokens_to=key.tokens, pad_logits_to=key.size
        )

    @torch.inference_mode()
    def capture(self, keys: list[GraphKey] | None = None, progress: bool = True) -> None:
        inputs = self.runner.inputs
        keys = keys or self.capture_keys()
        for key in tqdm(keys, desc="Capturing CUDA graphs", unit="graph", disable=not progress, file=sys.stderr):
            args = self.runner._step_args(*self.load(key, []), table_blocks=key.table_blocks)
            draws = inputs.draws(key.size)

            def step(args=args, draws=draws, decode=key.tokens is None) -> tuple[Tensor, Tensor | None]:
                input_ids, positions, _, meta, _ = args
                logits = self.runner.model.forward(*args)
                if not decode:
                    return logits, None
                # into the input ids, and the inputs one token on, as the batch's next step finds them (StepInputs)
                advance = (positions, meta.slot_mapping, meta.seq_lens)
                return logits, sample_rows(logits, *draws, out=input_ids, advance=advance)

            step()  # warm up: lazy initialisation stays out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, drawn = step()
            # Held by an unowned view, its logits (fp32, a vocabulary wide: 4 GiB for FULL mode's graphs of a 128 k
            # vocabulary) return to the pool for the next graphs: whatever reads a replay's logits (the sampler,
            # logprobs, the copies `ModelRunner.launch` queues) is queued before the next replay, in stream order.
            self.outputs[key] = unowned(logits), drawn
            self.graphs[key] = graph
            del logits, drawn  # (else this graph's logits stay owned through the next capture: two alive at once)
        torch.cuda.synchronize()

    def replay(self, key: GraphKey) -> tuple[Tensor, Tensor | None]:
        """(logits, each row's drawn token): a decode graph's tokens come out of it, with no launch of their own."""
        self.graphs[key].replay()
        if key.tokens is None:
            self.runner.inputs.graph_drew(key.size)
        return self.outputs[key]


def unowned(tensor: Tensor) -> Tensor:
    """A view of `tensor`'s memory that does not keep it allocated.

    A piece graph's outputs live in the shared graph pool. Held by such views, their memory returns
    to the pool once the capturing forward is done with it, so the next graph can reuse it: replays
    run in the order of capture, so a step only ever needs the memory of one forward's live values.
    """
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


class PieceGraph:
    """One compiled piece's CUDA graph for one token count."""

    stream: torch.cuda.Stream | None = None  # capture runs on a side stream, as torch.cuda.graph does

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        self.outputs = None

    def capture(self, fn: Callable, args: tuple):
        """Capture `fn(*args)`; returns its outputs, owned, for the rest of the capturing forward."""
        # torch.cuda.graph would also collect garbage and empty the cache for each capture: too slow
        # for a thousand of them. The piece has run eagerly at this size already (the warm-up forward).
        PieceGraph.stream = PieceGraph.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool)
            try:
                output = fn(*args)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.outputs = _map_tensors(unowned, output)
        return output

    def replay(self):
        self.graph.replay()
        return self.outputs


def _map_tensors(fn: Callable[[Tensor], Tensor], value):
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


class PiecewiseGraphs:
    """CUDA graphs of an artifact's pieces, one per token-count bucket; attention runs between them.

    For prefill and mixed batches (and, in PIECEWISE mode, decode): a step's tokens are padded up to a
    captured size, and each piece whose work depends on the token count alone replays its graph for that
    size: the compiled pieces, and the cache writes (`qkv_rope_and_cache` and its kin read per-token
    positions and slots; padding tokens' slot -1 writes nothing). Pieces that take per-sequence inputs run
    eagerly in between: attention, and the last piece (it gathers the sampled rows' logits). A graph reads
    its inputs where they were at capture: weights and step inputs never move, outputs of earlier graphs sit
    in the graph pool, and what the eager pieces return is copied into static buffers.
    """

    PER_SEQUENCE = ("block_tables", "seq_lens", "query_start_loc", "logits_indices")

    def __init__(
        self,
        model: CompiledModel,
        sizes: list[int],
        pool,
        graph: Callable = PieceGraph,
        cache_writes: bool | None = None,
    ) -> None:
        self.sizes = sorted(sizes)
        self.pool = pool
        self.graph = graph
        self.size: int | None = None  # the token count of the step being run; None: everything eager
        self.capturing = False
        per_sequence = {i.placeholder for i in model.inputs if i.target in self.PER_SEQUENCE}
        weights = {i.placeholder for i in model.inputs if i.kind == "weight"}
        entries = model.manifest["pieces"]
        plain = [c for c in model.calls if c.plain and not per_sequence & set(c.args)]
        graphed = {c.name: c for c in plain if entries[c.name]["compiled"]}
        # The cache writes too (an eager host section a layer less: their launches cost a 512-token step's host as
        # much as attention's, and mixed steps of the offline run's budget were host-bound), where their kernels can
        # be captured: Triton's (the torch reference drops padding slots with a boolean mask, a host sync), and where
        # compiled pieces are graphed at all (at level 0 their graphs would only add copies of the eager pieces).
        if cache_writes is None:
            cache_writes = model.manifest["ops_backend"] == "triton"
        if graphed and cache_writes:
            graphed |= {c.name: c for c in plain if entries[c.name]["kv_cache_op"]}
        copied = {source for c in graphed.values() for source in c.sources} - set(graphed)
        wrapped = {}
        for name, piece in vars(model.pieces).items():
            if name in graphed:
                moving = [i for i, arg in enumerate(graphed[name].args) if arg not in weights]
                wrapped[name] = _GraphedPiece(self, piece, moving)
            elif name in copied:
                wrapped[name] = _CopiedPiece(self, piece, max(self.sizes))
            else:
                wrapped[name] = piece
        self.num_graphed = len(graphed)
        self.model, self.plain_pieces = model, model.pieces
        model.pieces = type(model.pieces)(wrapped)

    def release(self) -> None:
        """Give the model its plain pieces back (the graphs go with this object)."""
        self.model.pieces = self.plain_pieces

    def size_for(self, num_tokens: int) -> int | None:
        at = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[at] if at < len(self.sizes) else None

    @contextmanager
    def running(self, size: int | None, capturing: bool = False) -> Iterator[None]:
        self.size, self.capturing = size, capturing
        try:
            yield
        finally:
            self.size, self.capturing = None, False

    @torch.inference_mode()
    def capture(self, runner: ModelRunner, sizes: list[int] | None = None, progress: bool = True) -> None:
        sizes = sorted(sizes or self.sizes, reverse=True)
        bar = tqdm(sizes, desc="Capturing piecewise CUDA graphs", unit="size", disable=not progress, file=sys.stderr)
        for size in bar:
            args = runner._step_args(*runner.inputs.load([], pad_tokens_to=size))
            runner.model.forward(*args)  # warm up at this size, outside the graphs
            with self.running(size, capturing=True):
                runner.model.forward(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


class _GraphedPiece:
    """A compiled piece replaying its graph for the step's size.

    Every replay checks that its non-weight inputs sit where they were at capture: one that moved
    would be read stale, silently (a few pointer reads; weights never move).
    """

    def __init__(self, owner: PiecewiseGraphs, piece: Callable, moving: list[int]) -> None:
        self.owner, self.piece, self.moving = owner, piece, moving
        self.graphs: dict[int, PieceGraph] = {}
        self.addresses: dict[int, list[int]] = {}  # per size, where the non-weight inputs were at capture

    def __call__(self, *args):
        size = self.owner.size
        if size is None:
            return self.piece(*args)
        if self.owner.capturing:
            graph = self.graphs[size] = self.owner.graph(self.owner.pool)
            self.addresses[size] = [args[i].data_ptr() for i in self.moving]
            return graph.capture(self.piece, args)  # owned while the capturing forward runs: later captures keep off
        if [args[i].data_ptr() for i in self.moving] != self.addresses[size]:
            raise RuntimeError("a piecewise CUDA graph's input moved since capture")
        return self.graphs[size].replay()


class _CopiedPiece:
    """An eager piece whose outputs a graphed piece reads: they land in buffers that never move."""

    def __init__(self, owner: PiecewiseGraphs, piece: Callable, max_tokens: int) -> None:
        self.owner, self.piece, self.max_tokens = owner, piece, max_tokens
        self.buffers = None

    def __call__(self, *args):
        output = self.piece(*args)
        size = self.owner.size
        if size is None:
            return output
        if self.buffers is None:
            self.buffers = _map_tensors(
                lambda t: t.new_empty_strided((self.max_tokens, *t.shape[1:]), t.stride()), output
            )
        return _map_tensors_pair(lambda buffer, t: buffer[:size].copy_(t), self.buffers, output)


def _map_tensors_pair(fn: Callable[[Tensor, Tensor], Tensor], a, b):
    if isinstance(a, Tensor):
        return fn(a, b)
    if isinstance(a, list | tuple):
        return type(a)(_map_tensors_pair(fn, x, y) for x, y in zip(a, b, strict=True))
    return b
