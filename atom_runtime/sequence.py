"""A sequence: one completion of a request, its tokens, and where its KV cache lives."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from atom_runtime.sampling_params import SamplingParams

_ids = itertools.count()

# A sampled token still on the device: the step that samples it is in flight.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Tokens whose keys/values are in the cache; the rest are computed in later steps.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at first schedule
        self.block_table: list[int] = []
        self.seq_id = next(_ids)
        self.table_version = 0  # bumped when the block table is replaced rather than extended
        self.block_hashes: list[int] = []  # chained hash of each full block, in order
        self.arrival_time = time.monotonic()
        self.sample_row = -1  # row of its placeholder token in the in-flight step's samples
        self.last_token_pending = False  # the in-flight step samples its final token (length limit)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
