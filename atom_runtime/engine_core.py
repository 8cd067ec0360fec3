"""The GPU side of the engine: scheduler, block manager and model runner, driven one step at a time.

It speaks token ids only. Tokenization, detokenization, stop strings and HTTP live on the
asyncio side (`async_engine`), so the step loop never waits on them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from atom_runtime.block_manager import BlockManager
from atom_runtime.config import EngineConfig
from atom_runtime.model_runner import ModelRunner
from atom_runtime.sampler import DeviceSample, SampledTokens
from atom_runtime.sampling_params import InvalidRequestError, SamplingParams
from atom_runtime.scheduler import Scheduler
from atom_runtime.sequence import PLACEHOLDER, Sequence

logger = logging.getLogger(__name__)


@dataclass
class TokenUpdate:
    """One new token of one sequence, and whether that sequence is now finished."""

    request_id: str
    index: int
    token_id: int
    logprob_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    rank: int | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0


@dataclass
class InFlight:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    sample: DeviceSample
    seqs: list[Sequence]  # the sequences it samples for, one per row
    positions: list[int]  # where each one's placeholder token sits


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0  # summed wall time of steps, and of their phases:
    schedule_time_s: float = 0.0  # choosing the step's tokens
    launch_time_s: float = 0.0  # preparing inputs and queueing the step on the device
    wait_time_s: float = 0.0  # waiting for the previous step's sampled tokens
    finish_time_s: float = 0.0  # appending tokens, stop checks


class EngineCore:
    def __init__(self, runner: ModelRunner, config: EngineConfig, eos_token_ids: set[int]):
        self.runner = runner
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sequences: dict[str, list[Sequence]] = {}
        self.stats = EngineStats()
        self.in_flight: InFlight | None = None
        self._waited = 0.0  # this step's time blocked on the device

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse what can never run: too long for the context, or for the whole KV cache alone."""
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's context is {self.max_model_len} tokens "
                f"and at least one must be left to generate",
                "prompt",
            )
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds the "
                f"model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
        total = num_prompt_tokens + (params.max_tokens or self.max_model_len - num_prompt_tokens)
        needed = self.block_manager.blocks_needed(total)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"this request needs {needed} KV-cache blocks, but the whole cache has "
                f"{self.block_manager.num_blocks}; lower max_tokens or the prompt length",
                "max_tokens",
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}", "n")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(
                f"logprobs={params.logprobs} exceeds the server's max_logprobs={self.config.max_logprobs}",
                "logprobs",
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.check_fits(len(prompt_token_ids), params)
        seqs = [Sequence(request_id, i, prompt_token_ids, params) for i in range(params.n)]
        self.sequences[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its samples) and free its blocks; unknown ids are ignored."""
        for seq in self.sequences.get(request_id, []):
            if (index is None or seq.index == index) and not seq.finished:
                self.scheduler.finish(seq, "abort")
        self._forget_if_done(request_id)
        self._refresh_stats()  # no step may follow to do it, and the freed blocks must show

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.sequences.get(request_id)
        if seqs is not None and all(s.finished for s in seqs):
            del self.sequences[request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> list[TokenUpdate]:
        """Queue the next step on the device, then finish the previous one while it runs.

        The previous step's tokens are still on the device when the next is scheduled and its
        inputs prepared: its sequences carry a PLACEHOLDER token, filled on the device. Its
        results are read back only after the next step is queued, so scheduling, input
        preparation and the host side of outputs overlap with the GPU. A sequence that
        turns out to have stopped (EOS, stop token) computed one token too many, which is
        dropped. Penalties need the real tokens on the host, so they wait for them first.
        """
        started = time.perf_counter()
        updates: list[TokenUpdate] = []
        if self.in_flight is not None and any(s.params.needs_penalties for s in self.in_flight.seqs):
            updates += self._finish_in_flight()
        scheduled = time.perf_counter()
        plan = self.scheduler.schedule()
        launched_at = time.perf_counter()
        launched = None
        if plan.chunks:
            for chunk in plan.chunks:
                chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            sample = self.runner.launch(plan.chunks, self.in_flight.sample if self.in_flight else None)
            if sample is not None:
                launched = InFlight(sample, [c.seq for c in plan.chunks if c.samples], [])
                for row, seq in enumerate(launched.seqs):
                    position = len(seq.token_ids)
                    launched.positions.append(position)
                    seq.token_ids.append(PLACEHOLDER)
                    seq.sample_row = row
                    seq.last_token_pending = self._length_reached(seq, position + 1)
        finishing = time.perf_counter()
        if self.in_flight is not None:
            updates += self._finish_in_flight()
        self.in_flight = launched
        self._refresh_stats()
        s, now = self.stats, time.perf_counter()
        s.num_steps += 1
        s.step_time_s += now - started
        s.schedule_time_s += launched_at - scheduled
        s.launch_time_s += finishing - launched_at
        s.finish_time_s += now - finishing - self._waited
        s.wait_time_s += self._waited
        self._waited = 0.0
        return updates

    def _finish_in_flight(self) -> list[TokenUpdate]:
        flight, self.in_flight = self.in_flight, None
        waiting = time.perf_counter()
        sampled = flight.sample.to_host()
        self._waited += time.perf_counter() - waiting
        updates = []
        for row, (seq, position) in enumerate(zip(flight.seqs, flight.positions, strict=True)):
            if seq.finished:  # aborted, or stopped by an earlier token: this one is dropped
                continue
            updates.append(self._set_token(seq, position, sampled, row))
        return updates

    def _set_token(self, seq: Sequence, position: int, sampled: SampledTokens, row: int) -> TokenUpdate:
        token = sampled.token_ids[row]
        seq.token_ids[position] = token
        update = TokenUpdate(seq.request_id, seq.index, token, num_cached_tokens=seq.num_cached_tokens)
        if sampled.logprobs is not None and seq.params.logprobs is not None:
            keep = 1 + seq.params.logprobs
            update.logprob_token_ids = sampled.logprob_token_ids[row][:keep]
            update.logprobs = sampled.logprobs[row][:keep]
            update.rank = sampled.ranks[row]
        reason, stop_reason = self._stop_reason(seq, token, position + 1)
        if reason is not None:
            del seq.token_ids[position + 1 :]  # a placeholder queued after a stop
            self.scheduler.finish(seq, reason, stop_reason)
            update.finish_reason, update.stop_reason = reason, stop_reason
            self._forget_if_done(seq.request_id)
        return update

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        max_tokens = seq.params.max_tokens
        return num_tokens >= self.max_model_len or (
            max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens
        )

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> tuple[str | None, int | None]:
        """Why `seq` stops at `token`, its `num_tokens`-th token, if it does."""
        params = seq.params
        if num_tokens - seq.num_prompt_tokens > params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
        if self._length_reached(seq, num_tokens):
            return "length", None
        return None, None

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_usage = self.block_manager.usage
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions
