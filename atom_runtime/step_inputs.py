"""Persistent input buffers for model steps.

Every step writes its token ids, positions, attention metadata and draws into a pinned host
buffer through numpy views, then copies them to the device in one copy: the fields sit packed one
after another (`step_layout`), each at an offset that depends on the step's counts (tokens,
sequences, logits rows) alone. So a step of given counts finds its fields where the last step of
those counts did: a CUDA graph captured for a decode batch size, or a piecewise graph for a
token count (the per-token fields come first, their offsets set by the token count), replays
with whatever the latest step wrote there. Nothing is allocated per step. Each small copy had
cost the decode loop about 3 us of device time (its own and the gap before the next), five a step.

Block tables, large and mostly unchanged, live in a buffer of their own: only the rows whose table
grew or changed since are copied, in runs (a row can be 10 KB at long context: 2.6 MB a step at batch 256).

Two host sets take turns: the host fills one for step N+1 while the copies of
step N may still be queued behind the GPU's work. A set is refilled only once the copies made from
it have run (an event each): the host usually runs at most a step ahead, waiting for the tokens
the step before sampled, but steps that sample nothing (the chunks of a long prompt) let it run
further ahead. Tokens sampled by the step still in flight are not known on the host yet (they are
PLACEHOLDER there). A decode graph draws them into its own input ids, so a batch of decodes that
follows one, each sequence in its row, finds them in place and copies the other fields only; other
steps take them from the previous step's samples (`carry_tokens`).

The draw also moves the graph's positions, slots, lengths and draw positions one token on (`sample_rows`'
`advance`), and the host keeps a copy of what the device's fields hold (`device_mirror`): a steady batch's next
step, whose fields come out the same (no sequence left, joined or crossed into a new block), copies nothing at all.
Qwen3-0.6B batch 1 on an H100: 0.803 -> 0.796-0.802 ms a step (two rounds against one of main's, whose other
stalled; within a copy's ~2-3 us, so near the rounds' spread). The host's check costs ~5 us a step.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from atom_models.layers import AttentionMetadata
from atom_models.ops.sampling import carry_tokens
from atom_runtime.sampler import Draws
from atom_runtime.scheduler import PROMPT_LOGPROB_ROWS, ScheduledChunk
from atom_runtime.sequence import PLACEHOLDER

# Block-table rows between two changed ones that one copy takes along rather than starting another: about what
# a small host-to-device copy costs in launch and latency (~1.5 us at ~25 GB/s).
TABLE_GAP_BYTES = 32 << 10
# A step's fields in the order they are packed, with the count that sizes each: "tokens", "seqs", "starts" (seqs
# + 1) or "logits" (rows sampled, then the prompt positions scored for prompt_logprobs). Per-token fields first: their
# offsets depend on the token count alone.
FIELDS: tuple[tuple[str, torch.dtype, str], ...] = (
    ("input_ids", torch.int64, "tokens"),
    ("positions", torch.int64, "tokens"),
    ("slot_mapping", torch.int64, "tokens"),
    ("seq_lens", torch.int32, "seqs"),
    ("query_start_loc", torch.int32, "starts"),
    ("carry_to", torch.int64, "seqs"),  # input rows whose token is still on the device (-1: none)...
    ("carry_from", torch.int64, "seqs"),  # ...and their rows in the previous step's samples
    ("logits_indices", torch.int64, "logits"),
    # Each logits row's draw (see `atom_models.ops.sampling.sample_rows`): temperature (0: greedy), seed,
    # and the position of the token it samples.
    ("temperature", torch.float32, "logits"),
    ("sample_seeds", torch.int64, "logits"),
    ("sample_positions", torch.int32, "logits"),
)
# Each field starts 16-byte aligned, as a tensor of its own would: Triton and Inductor specialise kernels on it.
ALIGN = 16
# What a block-table row holds, as (the block-table list it was written from, how much of it): tables are only
# ever extended in place or replaced, so the same list at the same length is the same row.
UNKNOWN = (None, -1)
PADDING = (None, 0)  # a padded sequence's zeros
# From this many sequences on, a step's inputs are written with numpy over the whole batch (the crossover
# measured on CPU: below it, numpy's per-call overhead costs more than per-sequence scalar writes).
VECTORIZE_FROM = 40
LAYOUTS_KEPT = 1024  # step shapes whose views are kept (decode batch sizes, prefill token counts)


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def step_layout(tokens: int, seqs: int, logits: int) -> tuple[dict[str, tuple[int, int]], int]:
    """Where a step of these counts packs its fields: ({name: (byte offset, entries)}, bytes in all)."""
    counts = {"tokens": tokens, "seqs": seqs, "starts": seqs + 1, "logits": logits}
    fields, offset = {}, 0
    for name, dtype, count in FIELDS:
        fields[name] = (offset, counts[count])
        offset += -(-counts[count] * dtype.itemsize // ALIGN) * ALIGN
    return fields, offset


class StepInputs:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        host_sets: int | None = None,
        device_buffers: bool | None = None,
    ):
        """`host_sets`: pinned buffer sets the steps alternate between (default: two on a GPU, one on the CPU).
        `device_buffers`: whether the device has buffers of its own that steps copy into (default: on a GPU;
        on the CPU the host buffers serve the model directly)."""
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        own = pin if device_buffers is None else device_buffers
        sets = host_sets or (2 if pin else 1)
        if not own and sets > 1:
            raise ValueError("without device buffers of their own, the one host set is what the model reads")
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.capacity = step_layout(max_tokens, max_seqs, max_seqs + PROMPT_LOGPROB_ROWS)[1]
        table_shape = (max_seqs, max_blocks_per_seq)
        self.host_bytes = [torch.zeros(self.capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(sets)]
        self.host_arrays = [h.numpy() for h in self.host_bytes]  # views, made once
        self.host_shapes: list[tuple[int, int, int] | None] = [None] * sets  # the step shape each set last held
        self.host_blocks = [torch.zeros(table_shape, dtype=torch.int32, pin_memory=pin) for _ in range(sets)]
        self.host_block_arrays = [t.numpy() for t in self.host_blocks]  # views, made once
        self.copied = [torch.cuda.Event() if pin else None for _ in range(sets)]  # each set's copies have run
        self.turn = 0
        # What each host set's block-table rows hold, and (below) the device's.
        self.host_tables: list[list[tuple[list[int] | None, int]]] = [[UNKNOWN] * max_seqs for _ in range(sets)]
        self.device_tables: list[tuple[list[int] | None, int]] = [UNKNOWN] * max_seqs
        # What the device's fields hold, as far as the host knows (own device buffers only): what it copied there,
        # moved on as a decode graph's draw moves it.
        self.device_mirror = torch.zeros(self.capacity, dtype=torch.uint8)
        self._mirror_array = self.device_mirror.numpy()
        self.mirror_shape: tuple[int, int, int] | None = None  # the step shape whose fields the mirror holds
        self.skipped_uploads = 0  # steps whose fields the device held already (for tests and benchmarks)
        if own:
            self.device_bytes = torch.zeros(self.capacity, dtype=torch.uint8, device=device)
            self.block_tables = torch.zeros(table_shape, dtype=torch.int32, device=device)
        else:
            self.device_bytes, self.block_tables = self.host_bytes[0], self.host_blocks[0]
        # In-flight tokens drawn into the input ids, put aside where the next step's upload overwrites them.
        self.in_flight_copy = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.table_gap_rows = TABLE_GAP_BYTES // self.host_blocks[0][0].nbytes
        self.iota = np.arange(max(max_tokens, max_seqs) + 1)  # sliced rather than made per step
        # Each step shape's field views: of the device buffer, of each host set and of the mirror (numpy).
        self._views: dict[tuple, tuple[dict[str, Tensor], list[dict[str, np.ndarray]], dict[str, np.ndarray]]] = {}
        self.shape = (0, 0, 0)  # (tokens, seqs, logits) of the step last loaded

    def fields(self, tokens: int, seqs: int, logits: int) -> tuple[dict[str, Tensor], list[dict[str, np.ndarray]]]:
        """A step shape's fields: views of the device buffer, and of each host set as numpy arrays (made once)."""
        device, hosts, _ = self._field_views((tokens, seqs, logits))
        return device, hosts

    def _field_views(self, key: tuple[int, int, int]) -> tuple:
        """`fields`, and the mirror's fields (numpy), of a step shape."""
        views = self._views.get(key)
        if views is None:
            layout, size = step_layout(*key)
            if size > self.capacity:
                raise ValueError(f"a step of {key[0]} tokens and {key[1]} sequences exceeds the input buffers")
            dtypes = {name: dtype for name, dtype, _ in FIELDS}

            def view(buffer: Tensor, name: str) -> Tensor:
                offset, n = layout[name]
                return buffer[offset : offset + n * dtypes[name].itemsize].view(dtypes[name])

            if len(self._views) >= LAYOUTS_KEPT:
                self._views.clear()
            views = self._views[key] = (
                {name: view(self.device_bytes, name) for name in layout},
                [{name: view(host, name).numpy() for name in layout} for host in self.host_bytes],
                {name: view(self.device_mirror, name).numpy() for name in layout},
            )
        return views

    def load(
        self,
        chunks: list[ScheduledChunk],
        pad_seqs_to: int | None = None,
        in_flight: Tensor | None = None,
        pad_tokens_to: int | None = None,
        pad_logits_to: int | None = None,
    ) -> tuple[int, int, int]:
        """Write one step; returns (tokens, seqs, logits) counts, padding included.

        `pad_seqs_to` (for FULL CUDA graphs) adds sequences after the step's own whose logits are discarded: with
        one token each that writes nowhere (slot -1) and reads one cached position in a decode graph (its attention
        finds sequence i's token in row i), with none in a mixed step's (given `pad_tokens_to`), whose budget of
        tokens padding then takes nothing from.
        `pad_tokens_to` (for PIECEWISE graphs, and FULL graphs of mixed steps) adds tokens of no sequence after
        those, up to that many tokens in all: they write nowhere and attention zeroes them. `pad_logits_to` (FULL
        graphs of mixed steps) adds logits rows of token 0. `in_flight` holds the token ids sampled by the previous
        step, for sequences whose last token is a placeholder (`carry_tokens` puts them in the input ids).
        """
        num_seqs = len(chunks)
        tokens = sum(c.num_tokens for c in chunks)
        logits = sum(c.samples for c in chunks)
        scored = sum(len(c.scored) for c in chunks)
        padded_seqs = max(num_seqs, pad_seqs_to or 0)
        pad = padded_seqs - num_seqs
        pad_tokens = pad if pad_tokens_to is None else 0
        rows = logits + scored + pad
        shape = (max(tokens + pad_tokens, pad_tokens_to or 0), padded_seqs, max(rows, pad_logits_to or 0))
        fields, host_fields = self.fields(*shape)
        arrays, held, copied = host_fields[self.turn], self.host_tables[self.turn], self.copied[self.turn]
        tables = self.host_block_arrays[self.turn]
        if copied is not None:
            copied.synchronize()  # the copies of the step that last used this set (long done, as a rule)
        if self.host_shapes[self.turn] != shape:  # zero gaps between fields: a step of this shape compares them all
            self.host_arrays[self.turn][: step_layout(*shape)[1]] = 0
            self.host_shapes[self.turn] = shape
        self._write_tables(chunks, tables, held)
        arrays["query_start_loc"][0] = 0
        if num_seqs < VECTORIZE_FROM:
            t, logits, carried = self._write_each(chunks, arrays, tables)
        else:
            t, logits, carried = self._write_vectorized(chunks, arrays, tables)
        if scored:
            self._write_scored(chunks, arrays["logits_indices"][logits:])
        arrays["carry_to"][carried:] = -1
        arrays["carry_from"][carried:] = 0  # (every entry written: the next step compares them, `_upload`)
        ids, pos, slots, qsl = (
            arrays["input_ids"],
            arrays["positions"],
            arrays["slot_mapping"],
            arrays["query_start_loc"],
        )
        if pad:
            tables[num_seqs:padded_seqs] = 0
            held[num_seqs:padded_seqs] = [PADDING] * pad
            arrays["seq_lens"][num_seqs:padded_seqs] = 1
            qsl[num_seqs + 1 : padded_seqs + 1] = np.arange(t + 1, t + pad_tokens + 1) if pad_tokens else t
            arrays["logits_indices"][rows - pad : rows] = np.arange(t, t + pad) if pad_tokens else 0
        if shape[0] > t:
            ids[t:] = 0
            pos[t:] = 0
            slots[t:] = -1
        if shape[2] > rows - pad:  # padding rows: greedy draws (any seed, any position) of token 0's logits
            arrays["logits_indices"][rows:] = 0
            arrays["temperature"][rows - pad :] = 0.0
            arrays["sample_seeds"][rows - pad :] = 0
            arrays["sample_positions"][rows - pad :] = 0
        if carried and in_flight is None:
            raise RuntimeError("a sequence waits for a token that no step in flight is sampling")
        # A decode graph draws its tokens into its own input ids: where a batch of decodes finds each sequence's
        # token in its own row (the same batch, or rows leaving from its end), the ids are in place already.
        drawn_here = in_flight is not None and in_flight.data_ptr() == self.device_bytes.data_ptr()
        in_place = (
            drawn_here
            and carried == num_seqs == shape[0] - pad_tokens
            and np.array_equal(arrays["carry_from"][:carried], self.iota[:carried])
        )
        if drawn_here and carried and not in_place:  # the upload overwrites them: aside first
            in_flight = self.in_flight_copy[: in_flight.shape[0]].copy_(in_flight)
        first = fields["positions"].data_ptr() - self.device_bytes.data_ptr() if in_place else 0
        self._upload(first, step_layout(*shape)[1], padded_seqs, held, shape, may_skip=in_place)
        self.turn = (self.turn + 1) % len(self.host_bytes)
        if copied is not None:
            copied.record()
        self.shape = shape
        if carried and not in_place:
            carry_tokens(fields["input_ids"], fields["carry_to"], fields["carry_from"], in_flight)
        return shape

    @staticmethod
    def _write_tables(chunks: list[ScheduledChunk], tables: np.ndarray, held: list[tuple]) -> None:
        """Write into a host set's block-table rows only what changed since they were last written (`held`)."""
        for i, chunk in enumerate(chunks):
            table = chunk.seq.block_table
            written, length = held[i]
            if written is not table:
                tables[i, : len(table)] = table
            elif length != len(table):
                tables[i, length : len(table)] = table[length:]
            else:
                continue
            held[i] = (table, len(table))

    def _write_each(
        self, chunks: list[ScheduledChunk], arrays: dict[str, np.ndarray], tables: np.ndarray
    ) -> tuple[int, int, int]:
        """Token rows one sequence at a time: for a few sequences, scalar writes beat numpy calls."""
        bs = self.block_size
        ids, pos, slots = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
        t = logits = carried = 0
        for i, chunk in enumerate(chunks):
            seq, n, start = chunk.seq, chunk.num_tokens, chunk.start
            if n == 1:
                ids[t] = seq.token_ids[start]
                pos[t] = start
                slots[t] = seq.block_table[start // bs] * bs + start % bs
            else:
                positions = np.arange(start, start + n)
                ids[t : t + n] = seq.token_ids[start : start + n]
                pos[t : t + n] = positions
                slots[t : t + n] = tables[i, positions // bs].astype(np.int64) * bs + positions % bs
            if seq.token_ids[start + n - 1] == PLACEHOLDER:
                arrays["carry_to"][carried] = t + n - 1
                arrays["carry_from"][carried] = seq.sample_row
                carried += 1
            t += n
            arrays["seq_lens"][i] = start + n
            arrays["query_start_loc"][i + 1] = t
            if chunk.samples:
                arrays["logits_indices"][logits] = t - 1
                arrays["temperature"][logits] = seq.params.sample_temperature
                arrays["sample_seeds"][logits] = seq.sampling_seed
                arrays["sample_positions"][logits] = start + n
                logits += 1
        return t, logits, carried

    def _write_vectorized(
        self, chunks: list[ScheduledChunk], arrays: dict[str, np.ndarray], tables: np.ndarray
    ) -> tuple[int, int, int]:
        """Token rows for many sequences: each per-sequence value is gathered in one pass, the rest is numpy."""
        ids, pos = arrays["input_ids"], arrays["positions"]
        num_seqs = len(chunks)
        seqs = [c.seq for c in chunks]
        starts = [c.start for c in chunks]
        lens = [c.num_tokens for c in chunks]
        t = sum(lens)
        if t == num_seqs:  # decodes only: one token each, at its start
            ids[:t] = [seq.token_ids[start] for seq, start in zip(seqs, starts, strict=True)]
            pos[:t] = starts
            rows = last = self.iota[:t]
            ends = self.iota[1 : t + 1]
        else:
            ends = np.cumsum(lens)
            for seq, start, n, end in zip(seqs, starts, lens, ends.tolist(), strict=True):
                ids[end - n : end] = seq.token_ids[start : start + n]
            rows = np.repeat(self.iota[:num_seqs], lens)
            pos[:t] = self.iota[:t] - (ends - lens - starts)[rows]
            last = ends - 1
        positions = pos[:t]
        blocks = tables[rows, positions // self.block_size]
        arrays["slot_mapping"][:t] = blocks.astype(np.int64) * self.block_size + positions % self.block_size
        arrays["seq_lens"][:num_seqs] = positions[last] + 1
        arrays["query_start_loc"][1 : num_seqs + 1] = ends
        # A last token still on the device (PLACEHOLDER) comes from the in-flight step's samples.
        waiting = ids[last] == PLACEHOLDER
        carried = int(np.count_nonzero(waiting))
        if carried:
            arrays["carry_to"][:carried] = last[waiting]
            arrays["carry_from"][:carried] = np.array([s.sample_row for s in seqs], dtype=np.int64)[waiting]
        samples = [c.samples for c in chunks]
        every = all(samples)
        sampled = last if every else last[np.array(samples, dtype=bool)]
        n = len(sampled)
        arrays["logits_indices"][:n] = sampled
        drawing = seqs if every else [seq for seq, s in zip(seqs, samples, strict=True) if s]
        arrays["temperature"][:n] = [seq.params.sample_temperature for seq in drawing]
        arrays["sample_seeds"][:n] = [seq.sampling_seed for seq in drawing]
        arrays["sample_positions"][:n] = positions[sampled] + 1
        return t, n, carried

    @staticmethod
    def _write_scored(chunks: list[ScheduledChunk], rows: np.ndarray) -> None:
        """The logits rows of the prompt positions scored for prompt_logprobs, after the sampled ones."""
        t = at = 0
        for chunk in chunks:
            if chunk.scored:
                n, first = len(chunk.scored), t + chunk.scored.start - chunk.start
                rows[at : at + n] = np.arange(first, first + n)
                at += n
            t += chunk.num_tokens

    def graph_drew(self, size: int) -> None:
        """A decode graph of `size` sequences ran: move the mirror's fields on as its draw (`sample_rows`' `advance`)
        moved the device's."""
        shape = (size, size, size)
        if self.mirror_shape != shape:  # not the step last loaded: the mirror is stale
            self.mirror_shape = None
            return
        mirror = self._field_views(shape)[2]
        step = mirror["slot_mapping"] >= 0
        for name in ("positions", "slot_mapping", "seq_lens", "sample_positions"):
            mirror[name] += step

    def _upload(
        self, first: int, end: int, seqs: int, held: list[tuple], shape: tuple[int, int, int], may_skip: bool
    ) -> None:
        """Copy bytes [first, end) of the step's fields, unless `may_skip` (the step follows the decode graph that
        moved its fields on) and the device holds them already (`device_mirror`), and the block-table rows the
        device lacks (`held`: the host set's rows), from the host set of this turn."""
        host = self.host_bytes[self.turn]
        if self.device_bytes is host:
            return
        fresh, mirror = self.host_arrays[self.turn][first:end], self._mirror_array[first:end]
        if may_skip and shape == self.mirror_shape and fresh.data == mirror.data:  # gaps included: zero in both
            self.skipped_uploads += 1
        else:
            self.device_bytes[first:end].copy_(host[first:end], non_blocking=True)
            mirror[:] = fresh
            self.mirror_shape = shape
        # Block tables: the rows that changed (a table grows a block every block_size tokens, sequences on different
        # steps), in runs; rows between two changed ones are copied along while that costs less than a copy's
        # own overhead (TABLE_GAP_BYTES).
        device = self.device_tables
        stale = [i for i in range(seqs) if device[i][0] is not held[i][0] or device[i][1] != held[i][1]]
        start = 0
        while start < len(stale):
            end = start + 1
            while end < len(stale) and stale[end] - stale[end - 1] - 1 <= self.table_gap_rows:  # rows between
                end += 1
            lo, hi = stale[start], stale[end - 1] + 1
            self._copy_tables(lo, hi)
            device[lo:hi] = held[lo:hi]
            start = end

    def _copy_tables(self, lo: int, hi: int) -> None:
        self.block_tables[lo:hi].copy_(self.host_blocks[self.turn][lo:hi], non_blocking=True)

    def draws(self, logits: int) -> Draws:
        """The first logits rows' draws of the step last loaded, on the device."""
        g = self.fields(*self.shape)[0]
        return Draws(g["temperature"][:logits], g["sample_seeds"][:logits], g["sample_positions"][:logits])

    def views(
        self, tokens: int, seqs: int, logits: int, table_blocks: int | None = None
    ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """(input_ids, positions, metadata, logits_indices) of a step of these counts, on the device; the block
        tables' first `table_blocks` columns (all by default) for sequences known to need no more."""
        g = self.fields(tokens, seqs, logits)[0]
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"],
            block_tables=self.block_tables[:seqs, :table_blocks],
            seq_lens=g["seq_lens"],
            query_start_loc=g["query_start_loc"],
        )
        return g["input_ids"], g["positions"], meta, g["logits_indices"]
