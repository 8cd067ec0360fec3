"""Persistent input buffers for model steps.

Every step writes its token ids, positions and attention metadata into pinned host
buffers through numpy views, then copies them into device buffers that never move.
Nothing is allocated per step, and a CUDA graph captured over these buffers replays with
whatever the latest step wrote into them.

Two sets of host buffers take turns: the host fills one for step N+1 while the copies of
step N may still be queued behind the GPU's work. A set is refilled only once the copies made from
it have run (an event each): the host usually runs at most a step ahead, waiting for the tokens
the step before sampled, but steps that sample nothing (the chunks of a long prompt) let it run
further ahead. Tokens sampled by the step still in
flight are not known on the host yet (they are PLACEHOLDER there); they are copied into
this step's input ids on the device, from the previous step's sampled tensor.

A copy the device buffer does not need is skipped: a field whose rows equal what was last copied
(decode batches repeat their query offsets, logits rows and carry rows), and block-table rows whose
table has not grown or changed since (a row can be 10 KB at long context: 2.6 MB a step at batch 256).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from atom_models.layers import AttentionMetadata
from atom_runtime.sampler import Draws
from atom_runtime.scheduler import ScheduledChunk
from atom_runtime.sequence import PLACEHOLDER

# Block-table rows between two changed ones that one copy takes along rather than starting another: about what
# a small host-to-device copy costs in launch and latency (~1.5 us at ~25 GB/s).
TABLE_GAP_BYTES = 32 << 10
# Fields a step often repeats (decode batches of one shape: query offsets, logits rows, carry rows), compared with
# what the device holds; the others (ids, positions, slots, lengths) change every step and are copied unlooked.
REPEATING_FIELDS = (
    "query_start_loc",
    "logits_indices",
    "carry_to",
    "carry_from",
    "temperature",
    "sample_seeds",
)
# What a block-table row holds, as (the block-table list it was written from, how much of it): tables are only
# ever extended in place or replaced, so the same list at the same length is the same row.
UNKNOWN = (None, -1)
PADDING = (None, 0)  # a padded sequence's zeros
# From this many sequences on, a step's inputs are written with numpy over the whole batch (the crossover
# measured on CPU: below it, numpy's per-call overhead costs more than per-sequence scalar writes).
VECTORIZE_FROM = 40


class StepInputs:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        host_sets: int | None = None,
    ):
        """`host_sets`: pinned buffer sets the steps alternate between (default: two on a GPU, one on the CPU)."""
        self.block_size = block_size
        self.device = device
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "block_tables": ((max_seqs, max_blocks_per_seq), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "logits_indices": ((max_seqs,), torch.int64),
            "carry_to": ((max_seqs,), torch.int64),  # input positions whose token is still on the device...
            "carry_from": ((max_seqs,), torch.int64),  # ...and their rows in the previous step's samples
            # Each logits row's draw (see `atom_models.ops.sampling.sample_rows`): temperature (0: greedy), seed,
            # and the position of the token it samples.
            "temperature": ((max_seqs,), torch.float32),
            "sample_seeds": ((max_seqs,), torch.int64),
            "sample_positions": ((max_seqs,), torch.int32),
        }
        pin = device.type == "cuda"

        def host_set() -> dict[str, Tensor]:
            return {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}

        self.hosts = [host_set() for _ in range(host_sets or (2 if pin else 1))]
        self.copied = [torch.cuda.Event() if pin else None for _ in self.hosts]  # each set's copies have run
        self.host_arrays = [{name: t.numpy() for name, t in host.items()} for host in self.hosts]  # views, made once
        self.turn = 0
        # What each host set's block-table rows hold, and (below) the device's.
        self.host_tables: list[list[tuple[list[int] | None, int]]] = [[UNKNOWN] * max_seqs for _ in self.hosts]
        if device.type == "cpu":
            self.gpu = self.hosts[0]
        else:
            self.gpu = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.table_gap_rows = TABLE_GAP_BYTES // self.hosts[0]["block_tables"][0].nbytes
        self.iota = np.arange(max(max_tokens, max_seqs) + 1)  # sliced rather than made per step
        # What the device buffers hold: each repeating field's rows as last copied (None: unknown), and each
        # block-table row's table.
        self.device_fields: dict[str, np.ndarray | None] = dict.fromkeys(REPEATING_FIELDS)
        self.device_tables: list[tuple[list[int] | None, int]] = [UNKNOWN] * max_seqs

    def load(
        self,
        chunks: list[ScheduledChunk],
        pad_seqs_to: int | None = None,
        in_flight: Tensor | None = None,
        pad_tokens_to: int | None = None,
    ) -> tuple[int, int, int]:
        """Write one step; returns (tokens, seqs, logits) counts, padding included.

        `pad_seqs_to` (for FULL CUDA graphs of decode batches) adds one-token sequences that write
        nowhere (slot -1), read one cached position, and whose logits are discarded.
        `pad_tokens_to` (for PIECEWISE graphs) adds tokens of no sequence: they write nowhere and
        attention zeroes them. `in_flight` holds the token ids sampled by the previous step, for
        sequences whose last token is a placeholder.
        """
        host, arrays, held = self.hosts[self.turn], self.host_arrays[self.turn], self.host_tables[self.turn]
        copied = self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # the copies of the step that last used this set (long done, as a rule)
        num_seqs = len(chunks)
        self._write_tables(chunks, arrays["block_tables"], held)
        arrays["query_start_loc"][0] = 0
        if num_seqs < VECTORIZE_FROM:
            t, logits, carried = self._write_each(chunks, arrays)
        else:
            t, logits, carried = self._write_vectorized(chunks, arrays)
        ids, pos, slots, qsl = (
            arrays["input_ids"],
            arrays["positions"],
            arrays["slot_mapping"],
            arrays["query_start_loc"],
        )
        if pad_tokens_to is not None and pad_tokens_to > t:
            ids[t:pad_tokens_to] = 0
            pos[t:pad_tokens_to] = 0
            slots[t:pad_tokens_to] = -1
            t = pad_tokens_to
        if pad_seqs_to is not None and pad_seqs_to > num_seqs:
            pad = pad_seqs_to - num_seqs
            ids[t : t + pad] = 0
            pos[t : t + pad] = 0
            slots[t : t + pad] = -1
            arrays["block_tables"][num_seqs:pad_seqs_to] = 0
            held[num_seqs:pad_seqs_to] = [PADDING] * pad
            arrays["seq_lens"][num_seqs:pad_seqs_to] = 1
            qsl[num_seqs + 1 : pad_seqs_to + 1] = np.arange(t + 1, t + pad + 1)
            arrays["logits_indices"][logits : logits + pad] = np.arange(t, t + pad)
            arrays["temperature"][logits : logits + pad] = 0.0  # greedy: any seed, any position
            t, num_seqs, logits = t + pad, pad_seqs_to, logits + pad
        self.turn = (self.turn + 1) % len(self.hosts)
        self._upload(host, arrays, t, num_seqs, logits, carried, held)
        if copied is not None:
            copied.record()
        if carried:
            if in_flight is None:
                raise RuntimeError("a sequence waits for a token that no step in flight is sampling")
            rows = in_flight.index_select(0, self.gpu["carry_from"][:carried])
            self.gpu["input_ids"].index_copy_(0, self.gpu["carry_to"][:carried], rows)
        return t, num_seqs, logits

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

    def _write_each(self, chunks: list[ScheduledChunk], arrays: dict[str, np.ndarray]) -> tuple[int, int, int]:
        """Token rows one sequence at a time: for a few sequences, scalar writes beat numpy calls."""
        bs = self.block_size
        ids, pos, slots, tables = (
            arrays["input_ids"],
            arrays["positions"],
            arrays["slot_mapping"],
            arrays["block_tables"],
        )
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

    def _write_vectorized(self, chunks: list[ScheduledChunk], arrays: dict[str, np.ndarray]) -> tuple[int, int, int]:
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
        blocks = arrays["block_tables"][rows, positions // self.block_size]
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

    def _upload(
        self,
        host: dict[str, Tensor],
        arrays: dict[str, np.ndarray],
        tokens: int,
        seqs: int,
        logits: int,
        carried: int,
        held: list[tuple],
    ) -> None:
        """Copy what the step reads and the device buffers lack (`held`: the host set's block-table rows)."""
        if self.gpu is host:
            return
        sizes = {
            "input_ids": tokens,
            "positions": tokens,
            "slot_mapping": tokens,
            "seq_lens": seqs,
            "query_start_loc": seqs + 1,
            "logits_indices": logits,
            "temperature": logits,
            "sample_seeds": logits,
            "sample_positions": logits,
            "carry_to": carried,
            "carry_from": carried,
        }
        for name, n in sizes.items():
            if not n:
                continue
            if name not in REPEATING_FIELDS:
                self._copy(host, name, 0, n)
                continue
            known, rows = self.device_fields[name], arrays[name][:n]
            if known is None or len(known) < n or not np.array_equal(known[:n], rows):
                self._copy(host, name, 0, n)
                self.device_fields[name] = rows.copy()
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
            self._copy(host, "block_tables", lo, hi)
            device[lo:hi] = held[lo:hi]
            start = end

    def _copy(self, host: dict[str, Tensor], name: str, lo: int, hi: int) -> None:
        self.gpu[name][lo:hi].copy_(host[name][lo:hi], non_blocking=True)

    def draws(self, logits: int) -> Draws:
        """The first logits rows' draws, on the device."""
        g = self.gpu
        return Draws(g["temperature"][:logits], g["sample_seeds"][:logits], g["sample_positions"][:logits])

    def views(self, tokens: int, seqs: int, logits: int) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """(input_ids, positions, metadata, logits_indices) over the first rows of the device buffers."""
        g = self.gpu
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"][:tokens],
            block_tables=g["block_tables"][:seqs],
            seq_lens=g["seq_lens"][:seqs],
            query_start_loc=g["query_start_loc"][: seqs + 1],
        )
        return g["input_ids"][:tokens], g["positions"][:tokens], meta, g["logits_indices"][:logits]
