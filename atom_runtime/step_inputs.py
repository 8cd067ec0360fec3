"""Persistent input buffers for model steps.

Every step writes its token ids, positions and attention metadata into pinned host
buffers through numpy views, then copies them into device buffers that never move.
Nothing is allocated per step, and a CUDA graph captured over these buffers replays with
whatever the latest step wrote into them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from atom_models.layers import AttentionMetadata
from atom_runtime.scheduler import ScheduledChunk


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
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
        }
        pin = device.type == "cuda"
        self.host = {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        if device.type == "cpu":
            self.gpu = self.host
        else:
            self.gpu = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
        self.max_tokens, self.max_seqs = max_tokens, max_seqs

    def load(self, chunks: list[ScheduledChunk], pad_seqs_to: int | None = None) -> tuple[int, int, int]:
        """Write one step; returns (tokens, seqs, logits) counts, padding included.

        Padding (for CUDA graphs of decode batches) adds one-token sequences that write nowhere
        (slot -1), read one cached position, and whose logits are discarded.
        """
        bs, np_ = self.block_size, self.np
        num_seqs = len(chunks)
        t = 0
        np_["query_start_loc"][0] = 0
        logits = 0
        for i, chunk in enumerate(chunks):
            seq, n = chunk.seq, chunk.num_tokens
            table = seq.block_table
            np_["block_tables"][i, : len(table)] = table
            positions = np.arange(chunk.start, chunk.start + n)
            np_["input_ids"][t : t + n] = seq.token_ids[chunk.start : chunk.start + n]
            np_["positions"][t : t + n] = positions
            blocks = np_["block_tables"][i, positions // bs].astype(np.int64)
            np_["slot_mapping"][t : t + n] = blocks * bs + positions % bs
            t += n
            np_["seq_lens"][i] = chunk.start + n
            np_["query_start_loc"][i + 1] = t
            if chunk.samples:
                np_["logits_indices"][logits] = t - 1
                logits += 1
        if pad_seqs_to is not None and pad_seqs_to > num_seqs:
            pad = pad_seqs_to - num_seqs
            np_["input_ids"][t : t + pad] = 0
            np_["positions"][t : t + pad] = 0
            np_["slot_mapping"][t : t + pad] = -1
            np_["block_tables"][num_seqs:pad_seqs_to] = 0
            np_["seq_lens"][num_seqs:pad_seqs_to] = 1
            np_["query_start_loc"][num_seqs + 1 : pad_seqs_to + 1] = np.arange(t + 1, t + pad + 1)
            np_["logits_indices"][logits : logits + pad] = np.arange(t, t + pad)
            t, num_seqs, logits = t + pad, pad_seqs_to, logits + pad
        self._upload(t, num_seqs, logits)
        return t, num_seqs, logits

    def _upload(self, tokens: int, seqs: int, logits: int) -> None:
        if self.gpu is self.host:
            return
        sizes = {
            "input_ids": tokens,
            "positions": tokens,
            "slot_mapping": tokens,
            "block_tables": seqs,
            "seq_lens": seqs,
            "query_start_loc": seqs + 1,
            "logits_indices": logits,
        }
        for name, n in sizes.items():
            self.gpu[name][:n].copy_(self.host[name][:n], non_blocking=True)

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
