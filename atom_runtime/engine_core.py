"""The GPU side of the engine: scheduler, block manager and model runner, driven one step at a time.

It speaks token ids only. Tokenization, detokenization, stop strings and HTTP live on the
asyncio side (`async_engine`), so the step loop never waits on them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from atom_runtime import structured_outputs
from atom_runtime.block_manager import BlockManager, blocks_for
from atom_runtime.config import EngineConfig
from atom_runtime.model_runner import ModelRunner
from atom_runtime.sampler import DeviceSample, SampledTokens
from atom_runtime.sampling_params import InvalidRequestError, SamplingParams
from atom_runtime.scheduler import ScheduledChunk, Scheduler
from atom_runtime.sequence import PLACEHOLDER, Sequence, SequenceStatus

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

FINISHED = SequenceStatus.FINISHED
# With nothing to step but grammars compiling, how long the step loop waits for one before it takes commands again.
GRAMMAR_WAIT_S = 0.005


@dataclass
class StepOutput:
    """The tokens one step sampled: row `i` gives `token_ids[i]` to sample `indices[i]` of `request_ids[i]`.

    Columns of plain values, made once per step rather than an object per token (at large batches, per-token
    objects cost more than the rest of the step's bookkeeping), and cheap to pickle to another process.
    """

    request_ids: list[str]
    indices: list[int]  # which of the request's n samples
    num_cached_tokens: list[int]  # prompt tokens the row's sequence found in the prefix cache
    token_ids: list[int]
    sampled: SampledTokens  # with the logprobs, for rows whose request asked for them
    skipped: set[int] = field(default_factory=set)  # rows whose sequence had already finished: no token
    # rows whose sequence ends without their token: its structured output's grammar refused it (`abort`)
    refused: set[int] = field(default_factory=set)
    finished: dict[int, tuple[str, int | None]] = field(default_factory=dict)  # row -> (finish_reason, stop_reason)
    # row -> its prompt's scores (prompt_logprobs: position p scores token p + 1), with the sequence's first token
    prompt_scores: dict[int, SampledTokens] = field(default_factory=dict)


@dataclass
class InFlight:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    sample: DeviceSample
    seqs: list[Sequence]  # the sequences it samples for, one per row
    positions: list[int]  # where each one's placeholder token sits
    needs_host_tokens: bool  # some row's next step needs its token on the host first (penalties, a grammar)
    scored: list[tuple[Sequence, int]]  # sequences whose prompt positions it scored, and how many, in row order


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of this engine; checked before it is queued, by whichever process receives it."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_logprobs: int

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Refuse ids outside the model's vocabulary, naming the request's field `param`."""
        # min/max in C: the core checks every request again, between its steps.
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})", param)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what can never run: an empty prompt, unknown tokens, too long for the context or the whole cache."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        self.check_token_ids(prompt_token_ids, "prompt")
        num_prompt_tokens = len(prompt_token_ids)
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
        needed = blocks_for(total, self.block_size)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"this request needs {needed} KV-cache blocks, but the whole cache has "
                f"{self.num_blocks}; lower max_tokens or the prompt length",
                "max_tokens",
            )
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}", "n")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")
        self.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        if (k := params.truncate_prompt_tokens) is not None and k > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={k} exceeds the model's context of {self.max_model_len} tokens",
                "truncate_prompt_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(f"{name}={value} exceeds the server's max_logprobs={self.max_logprobs}", name)


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
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_token_ids: set[int],
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        """`tokenizer`: for structured outputs' grammars (compiled against its vocabulary), which need one."""
        self.runner = runner
        self.tokenizer = tokenizer
        self._grammars: structured_outputs.Grammars | None = None
        # Requests whose grammar compiles on a thread of its own (xgrammar releases the GIL), off the step loop: a
        # schema over a large vocabulary takes tens to hundreds of ms, which would stall every running sequence.
        self._grammar_thread: ThreadPoolExecutor | None = None
        self._compiling: dict[str, Future] = {}
        self.rejected: list[tuple[str, InvalidRequestError]] = []  # requests refused after `add_request` returned
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sequences: dict[str, list[Sequence]] = {}
        self.stats = EngineStats()
        self.in_flight: InFlight | None = None
        self._waited = 0.0  # this step's time blocked on the device
        self.limits = EngineLimits(
            config.max_model_len,
            runner.model.config.vocab_size,
            config.block_size,
            self.block_manager.num_blocks,
            config.max_num_seqs,
            config.max_logprobs,
        )
        self._profiler: torch.profiler.profile | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.limits.check(prompt_token_ids, params)
        seqs = [
            Sequence(request_id, i, prompt_token_ids, params, self.max_model_len, self.eos_token_ids)
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:  # scheduled once its grammar has compiled (`_admit_compiled`)
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the engine's tokenizer", "structured_outputs")
            if self._grammar_thread is None:
                self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="atom-grammar")
            self._compiling[request_id] = self._grammar_thread.submit(self._compile, params)
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self.sequences[request_id] = seqs

    def _compile(self, params: SamplingParams) -> xgrammar.CompiledGrammar:
        """On the grammar thread: the compiler is made there too, by the first request that needs it."""
        if self._grammars is None:
            vocab = self.runner.model.config.vocab_size
            self._grammars = structured_outputs.Grammars(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammars.compile(params.structured_outputs)

    def _admit_compiled(self, wait_s: float) -> None:
        """Schedule the requests whose grammar has compiled, waiting up to `wait_s` for one; refuse those whose grammar
        failed (the engine's front end compiles it first, so a refusal here is the core's own trouble)."""
        if wait_s:
            wait(self._compiling.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            seqs = [seq for seq in self.sequences[request_id] if not seq.finished]  # (not aborted meanwhile)
            try:
                grammar = future.result()
            except InvalidRequestError as error:
                for seq in seqs:
                    self._abort_unscheduled(seq)
                del self.sequences[request_id]
                self.rejected.append((request_id, error))
                continue
            for seq in seqs:
                seq.matcher = self._grammars.new_matcher(grammar)
                self.scheduler.add(seq)

    @staticmethod
    def _abort_unscheduled(seq: Sequence) -> None:
        """End a sequence the scheduler never had (its grammar was compiling): no blocks to free."""
        seq.status, seq.finish_reason = FINISHED, "abort"

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its samples) and free its blocks; unknown ids are ignored."""
        for seq in self.sequences.get(request_id, []):
            if (index is None or seq.index == index) and not seq.finished:
                if request_id in self._compiling:  # not scheduled yet
                    self._abort_unscheduled(seq)
                else:
                    self.scheduler.finish(seq, "abort")
        if request_id in self._compiling and all(seq.finished for seq in self.sequences[request_id]):
            self._compiling.pop(request_id).cancel()
        self._forget_if_done(request_id)
        self._refresh_stats()  # no step may follow to do it, and the freed blocks must show

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.sequences.get(request_id)
        if seqs is not None and all(s.finished for s in seqs):
            del self.sequences[request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or bool(self._compiling)

    def step(self) -> StepOutput | None:
        """Queue the next step on the device, then finish the previous one while it runs.

        The previous step's tokens are still on the device when the next is scheduled and its
        inputs prepared: its sequences carry a PLACEHOLDER token, filled on the device. Its
        results are read back only after the next step is queued, so scheduling, input
        preparation and the host side of outputs overlap with the GPU. A sequence that
        turns out to have stopped (EOS, stop token) computed one token too many, which is
        dropped. Penalties and grammars need the real tokens on the host, so they wait for them first.
        Returns the tokens of the step finished, if one was.
        """
        started = time.perf_counter()
        output = None
        if self._compiling:  # with nothing else to step, wait a little for a grammar rather than spin
            self._admit_compiled(0.0 if self.scheduler.has_work() or self.in_flight else GRAMMAR_WAIT_S)
        if self.in_flight is not None and self.in_flight.needs_host_tokens:
            output = self._finish_in_flight()
        scheduled = time.perf_counter()
        plan = self.scheduler.schedule()
        launched_at = time.perf_counter()
        launched = None
        if plan.chunks:
            sample = self.runner.launch(plan.chunks, self.in_flight.sample if self.in_flight else None)
            launched = self._commit(plan.chunks, sample)
        finishing = time.perf_counter()
        if self.in_flight is not None:
            output = self._finish_in_flight()
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
        return output

    def _commit(self, chunks: list[ScheduledChunk], sample: DeviceSample | None) -> InFlight | None:
        """Advance the scheduled sequences past this step; a sampling one gets a placeholder for its token."""
        seqs: list[Sequence] = []
        positions: list[int] = []
        scored: list[tuple[Sequence, int]] = []
        host_tokens = False
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.scored:
                scored.append((seq, len(chunk.scored)))
                seq.num_prompt_scored = chunk.scored.stop
                seq.scores_prompt = seq.num_prompt_scored < seq.num_prompt_tokens - 1
            if chunk.samples:
                position = len(seq.token_ids)
                seq.sample_row = len(seqs)
                seqs.append(seq)
                positions.append(position)
                seq.token_ids.append(PLACEHOLDER)
                host_tokens = host_tokens or seq.params.needs_host_tokens
        return InFlight(sample, seqs, positions, host_tokens, scored) if sample is not None else None

    def _finish_in_flight(self) -> StepOutput:
        flight, self.in_flight = self.in_flight, None
        waiting = time.perf_counter()
        sampled = flight.sample.to_host()
        self._waited += time.perf_counter() - waiting
        seqs = flight.seqs
        output = StepOutput(
            [s.request_id for s in seqs],
            [s.index for s in seqs],
            [s.num_cached_tokens for s in seqs],
            sampled.token_ids,
            sampled,
        )
        if flight.scored:
            self._gather_prompt_scores(flight.scored, sampled.prompt)
        for row, (seq, position, token) in enumerate(zip(seqs, flight.positions, sampled.token_ids, strict=True)):
            if seq.status is FINISHED:  # aborted, or stopped by an earlier token: this one is dropped
                output.skipped.add(row)
                continue
            if position == seq.num_prompt_tokens and seq.params.prompt_logprobs is not None and seq.index == 0:
                output.prompt_scores[row] = seq.prompt_scores or SampledTokens.empty()
                seq.prompt_scores = None
            seq.token_ids[position] = token
            num_tokens = position + 1
            grammar = seq.matcher is not None and structured_outputs.accept(seq.matcher, token)
            if (
                num_tokens >= seq.max_num_tokens
                or (token in seq.stops_on and num_tokens > seq.min_num_tokens)
                or grammar is not False
            ):
                output.finished[row] = self._stop(seq, token, num_tokens, grammar)
                if output.finished[row][0] == "abort":
                    output.refused.add(row)
        return output

    @staticmethod
    def _gather_prompt_scores(scored: list[tuple[Sequence, int]], rows: SampledTokens) -> None:
        """Add a step's scored prompt positions to their sequences' (`rows` holds them in `scored`'s order)."""
        at = 0
        for seq, n in scored:
            mine = seq.prompt_scores = seq.prompt_scores or SampledTokens.empty()
            mine.token_ids += rows.token_ids[at : at + n]
            mine.logprob_token_ids += rows.logprob_token_ids[at : at + n]
            mine.logprobs += rows.logprobs[at : at + n]
            mine.ranks += rows.ranks[at : at + n]
            at += n

    def _stop(self, seq: Sequence, token: int, num_tokens: int, grammar: bool | None = False) -> tuple[str, int | None]:
        """Retire `seq`, which stops at `token`, its `num_tokens`-th (`grammar`: its structured output's state,
        `structured_outputs.accept`); returns (finish_reason, stop_reason)."""
        if token in seq.stops_on and num_tokens > seq.min_num_tokens:
            reason, stop_reason = "stop", token if token in seq.params.stop_token_ids else None
        elif grammar is None:  # the token is not the sequence's
            reason, stop_reason = "abort", None
            num_tokens -= 1
        elif grammar:
            reason, stop_reason = "stop", None
        else:
            reason, stop_reason = "length", None
        del seq.token_ids[num_tokens:]  # a placeholder queued after a stop
        self.scheduler.finish(seq, reason, stop_reason)
        self._forget_if_done(seq.request_id)
        return reason, stop_reason

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting) + sum(len(self.sequences[r]) for r in self._compiling)
        s.kv_usage = self.block_manager.usage
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions

    def start_profile(self, trace_path: str) -> None:
        """Record a torch.profiler trace of this thread's steps (the profiler follows the thread that starts it)."""
        self._profiler = torch.profiler.profile(
            activities=list(torch.profiler.supported_activities()),
            record_shapes=True,
            on_trace_ready=lambda prof: prof.export_chrome_trace(trace_path),
        )
        self._profiler.start()

    def stop_profile(self) -> None:
        """Stop recording and write the trace started by `start_profile`."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()
