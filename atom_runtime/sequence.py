"""A sequence: one completion of a request, its tokens, and where its KV cache lives."""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from atom_models.ops.sampling import SEED_MASK
from atom_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_runtime.sampler import SampledTokens

# A sampled token still on the device: the step that samples it is in flight.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_model_len: int | None = None,
        eos_token_ids: Collection[int] = (),
    ):
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
        self.num_preemptions = 0  # times its blocks were freed to be recomputed
        self.block_table: list[int] = []  # only ever extended in place, or replaced
        self.block_hashes: list[int] = []  # chained hash of each full block, in order
        self.arrival_time = time.monotonic()
        self.sample_row = -1  # row of its placeholder token in the in-flight step's samples
        # Keys this sequence's draws (`atom_models.ops.sampling.sample_rows`): a request's seed makes them
        # reproducible; otherwise one from torch's generator, which the engine seeds.
        seed = params.seed + index if params.seed is not None else int(torch.randint(SEED_MASK, ()))
        self.sampling_seed = seed & SEED_MASK
        # Stop rules, resolved once rather than per token: it ends for length on reaching max_num_tokens
        # tokens, and on a token of stops_on (stop_token_ids, and EOS unless ignored) past min_num_tokens.
        limit = max_model_len if max_model_len is not None else sys.maxsize
        if params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + params.max_tokens)
        self.max_num_tokens = limit
        self.min_num_tokens = self.num_prompt_tokens + params.min_tokens
        self.stops_on = frozenset(params.stop_token_ids).union(() if params.ignore_eos else eos_token_ids)
        # prompt_logprobs: positions p < num_prompt_tokens - 1 whose logits score token p + 1. Those up to
        # num_prompt_scored have been sent to be computed; their scores gather here until the first token goes out.
        # The request's first sample scores its prompt for all of them (the others may take it from the prefix cache).
        self.scores_prompt = params.prompt_logprobs is not None and self.num_prompt_tokens > 1 and index == 0
        self.num_prompt_scored = 0
        self.prompt_scores: SampledTokens | None = None
        self.matcher = None  # structured outputs: the grammar's state (an xgrammar GrammarMatcher)

    def positions_to_score(self, start: int, num_tokens: int) -> range:
        """The prompt positions a chunk of `num_tokens` from `start` scores that no earlier step did."""
        return range(max(start, self.num_prompt_scored), min(start + num_tokens, self.num_prompt_tokens - 1))

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
