"""The asyncio engine: requests in, streamed outputs out.

The engine core steps in a thread or a process of its own (`core_client`) and sees only token
ids. This side, on the event loop (uvloop under the server and `LLM`), tokenizes prompts (long
ones on a worker thread, which releases the GIL), detokenizes new tokens, matches stop strings
and feeds each request's output queue, so HTTP and text work never sit between two GPU steps.
Commands go to the core through a queue; its messages come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from atom_runtime import structured_outputs
from atom_runtime.core_client import CoreProcess, CoreThread, EngineProcessSettings
from atom_runtime.detokenizer import IncrementalDetokenizer
from atom_runtime.engine_core import EngineCore, EngineStats, StepOutput
from atom_runtime.metrics import Metrics
from atom_runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from atom_runtime.sampler import SampledTokens
from atom_runtime.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
    tokenize_bad_words,
    with_defaults,
)

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized on a worker thread, off the event loop: a 10k-word
# prompt takes ~15 ms, which would hold back every stream's tokens.
TOKENIZE_INLINE_MAX_CHARS = 2000


_CHANGED = object()  # queued for a request whose output has changed since its caller last took it


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer | None  # None: text not asked for (detokenize=False)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.releasable(self.finish_reason is not None) if self.detokenizer is not None else "",
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    queue: asyncio.Queue  # _CHANGED, or an error to raise
    metrics: RequestMetrics
    stream: bool = True
    notified: bool = False  # a _CHANGED is queued that the caller has not taken yet
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once the first token comes

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.output() for c in self.completions],
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
        )


class AsyncEngine:
    def __init__(
        self,
        core: CoreThread | CoreProcess,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        sampling_defaults: dict | None = None,
    ):
        """`sampling_defaults`: SamplingParams fields for requests that leave them out (`loading.sampling_defaults`;
        max_tokens caps every request's)."""
        self._core = core
        self.sampling_defaults = sampling_defaults or {}
        self._grammars: structured_outputs.Grammars | None = None  # to check structured outputs' constraints
        self.core: EngineCore | None = core.core  # only where it steps in this process
        self.limits = core.limits
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        # `tokenize` calls the Rust tokenizer directly: without the truncation or padding a tokenizer.json may
        # ship with (transformers' own calls switch them off each time).
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.model_name = model_name
        self.stats = EngineStats()  # as of the core's last message
        self.metrics = Metrics(lambda: self.stats, model_name)
        self._states: dict[str, _RequestState] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="atom-tokenizer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        # Called once the core has died, on the thread that noticed (requests or not, the loop may be idle).
        self.on_dead: Callable[[], None] | None = None
        EngineProcessSettings.engine_started()
        self._counted = True  # in EngineProcessSettings.running, until its core has stopped
        core.start(self._post)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._core.is_alive()

    # ---- messages from the core (any thread) -----------------------------------------

    def _post(self, message: tuple) -> None:
        if message[0] == "dead":
            self._error = message[1]
            if self.on_dead is not None:
                self.on_dead()
        if self._loop is not None:
            self._to_loop(self._receive, message)

    def _to_loop(self, callback: Callable, *args) -> None:
        """Run `callback` on the event loop; not at all if it has closed (its requests wait for nothing)."""
        loop = self._loop
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if not loop.is_closed():
                raise

    def _receive(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, output, self.stats = message
            self._on_updates(output)
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "rejected":
            _, request_id, error = message
            state = self._states.get(request_id)
            if state is not None:
                state.queue.put_nowait(error)
        elif kind == "called":
            _, call_id, error, value = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
        elif kind in ("dead", "stopped"):
            error = EngineDeadError(
                f"the engine stopped after an error: {message[1]}" if kind == "dead" else "the engine has shut down"
            )
            for state in list(self._states.values()):
                state.queue.put_nowait(error)
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(error)

    # ---- the event loop --------------------------------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        def encode() -> list[int]:
            # The Rust tokenizer itself: its batch call lets go of the GIL, and it is safe beside decodes.
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

        if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, encode)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        if not self._core.is_alive():
            raise EngineDeadError("the engine has shut down")

    def truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request runs it: with truncate_prompt_tokens, its last k tokens (-1: max_model_len)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        return prompt_token_ids[-(self.max_model_len if k == -1 else k) :]

    async def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for a request the engine would refuse. A structured output's constraint is
        compiled here too, so that a bad one is a 400 before a response starts: on the tokenizer's thread (xgrammar
        lets go of the GIL), as a schema over a large vocabulary takes tens to hundreds of ms of the event loop."""
        self.limits.check(self.truncated(prompt_token_ids, params), params)
        if params.structured_outputs is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_thread, self._compile_grammar, params.structured_outputs
            )

    def _compile_grammar(self, constraint: StructuredOutputsParams) -> None:
        if self._grammars is None:
            stop = {self.tokenizer.eos_token_id} - {None}
            self._grammars = structured_outputs.Grammars(self.tokenizer, self.limits.vocab_size, stop)
        self._grammars.compile(constraint)

    async def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative output after every step that changes it; the last is finished.

        A caller slower than the steps gets the newest output when it asks (the steps in between merged into
        it), and outputs are built only when asked for: a busy server does no work for outputs it would skip.
        With `stream=False` only the finished output is yielded.

        Closing the iterator early (a client that went away) aborts the request and frees its blocks.
        """
        self._check_alive()
        params = params or self.default_sampling_params()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt or prompt_token_ids", "prompt")
            prompt_token_ids = await self.tokenize(prompt)
        prompt_token_ids = self.truncated(prompt_token_ids, params)
        if params.bad_words and params.bad_words_token_ids is None:  # the core speaks token ids
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, encode))
        await self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._states:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self._loop = asyncio.get_running_loop()
        state = _RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            [
                _Completion(
                    i,
                    IncrementalDetokenizer(self.backend_tokenizer, prompt_token_ids, params)
                    if params.detokenize
                    else None,
                    logprobs=[] if params.logprobs is not None else None,
                )
                for i in range(params.n)
            ],
            asyncio.Queue(),
            RequestMetrics(arrival_time=time.monotonic()),
            stream,
        )
        self._states[request_id] = state
        left = False  # the caller stopped listening (a client that went away), as opposed to an error
        try:
            self._check_alive()  # again: the core may have died while the prompt was tokenized
            self._core.send(("add", request_id, state.prompt_token_ids, params))
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                state.notified = False
                output = state.output()
                yield output
                if output.finished:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            left = True
            raise
        finally:
            if not state.finished:
                self._core.send(("abort", request_id, None))
                if left:
                    self._record_aborted(state)
            self._states.pop(request_id, None)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (vLLM's `get_default_sampling_params`)."""
        return with_defaults(self.sampling_defaults)

    def abort(self, request_id: str) -> None:
        self._core.send(("abort", request_id, None))

    async def call_in_core(self, fn: Callable[[EngineCore], object]) -> object:
        """`fn(core)` on the core's thread between two steps, for thread-bound tools such as torch.profiler.

        Where the core has a process of its own, `fn` and its result must pickle (a module-level function,
        or `operator.methodcaller`).
        """
        self._check_alive()
        self._loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._core.send(("call", call_id, fn))
            return await future
        finally:
            del self._calls[call_id]

    def _on_updates(self, output: StepOutput) -> None:
        """Add one step's tokens to their requests; queue the outputs of finished and streamed ones."""
        now = time.monotonic()
        states, skipped, finished = self._states, output.skipped, output.finished
        changed: dict[str, _RequestState] = {}
        ended: set[str] = set()  # requests one of whose completions ended in this step
        for row, (request_id, index, token) in enumerate(
            zip(output.request_ids, output.indices, output.token_ids, strict=True)
        ):
            if skipped and row in skipped:
                continue
            state = states.get(request_id)
            if state is None:
                continue
            completion = state.completions[index]
            if completion.finish_reason is not None:
                continue  # already ended by a stop string; the core has been told
            detokenizer, stop = completion.detokenizer, None
            if row not in output.refused:  # (a token its grammar refused: the completion ends without it)
                completion.token_ids.append(token)
                if completion.logprobs is not None and output.sampled.logprobs is not None:
                    entry = self._logprob_entry(output.sampled, row, state.params.logprobs, state.params.detokenize)
                    completion.logprobs.append(entry)
                    completion.cumulative_logprob += entry[token].logprob
                if output.prompt_scores and row in output.prompt_scores and state.prompt_logprobs is None:
                    scores, k, text = output.prompt_scores[row], state.params.prompt_logprobs, state.params.detokenize
                    entries = [self._logprob_entry(scores, i, k, text) for i in range(len(scores.token_ids))]
                    state.prompt_logprobs = [None, *entries]
                # As vLLM: the token the core stopped at is the output's token, not its text. The core stops ("stop")
                # only at a stop token: EOS or stop_token_ids (a grammar ends on accepting EOS).
                stopped_at = row in finished and finished[row][0] == "stop"
                if detokenizer is not None and not (stopped_at and not state.params.include_stop_str_in_output):
                    stop = detokenizer.add(token)
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
                ended.add(request_id)
                if row not in finished:
                    self._core.send(("abort", request_id, index))
            elif finished and row in finished:
                if detokenizer is not None:
                    detokenizer.flush()
                completion.finish_reason, completion.stop_reason = finished[row]
                ended.add(request_id)
            state.metrics.num_cached_tokens = output.num_cached_tokens[row]
            changed[request_id] = state
        for request_id, state in changed.items():
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            done = request_id in ended and state.finished
            if done:
                state.metrics.finished_time = now
                self._record_finished(state)
            if (done or state.stream) and not state.notified:
                state.notified = True
                state.queue.put_nowait(_CHANGED)

    def _logprob_entry(self, rows: SampledTokens, row: int, k: int, detokenize: bool) -> dict[int, Logprob]:
        """Row `row`'s token with its logprob and rank, then its top `k` (vLLM's dict: the token first)."""
        token = rows.token_ids[row]
        ids, values = rows.logprob_token_ids[row][: 1 + k], rows.logprobs[row][: 1 + k]
        decode = self._decode_one if detokenize else lambda _: None
        entry = {token: Logprob(values[0], rows.ranks[row], decode(token))}
        for rank, (top, value) in enumerate(zip(ids[1:], values[1:], strict=True), 1):
            entry.setdefault(top, Logprob(value, rank, decode(top)))
        return entry

    def _decode_one(self, token_id: int) -> str:
        return self.backend_tokenizer.decode([token_id], skip_special_tokens=False)

    def _record_aborted(self, state: _RequestState) -> None:
        """A request its caller left (a client that went away): counted, with what it generated, as finished for
        "abort", as vLLM counts it."""
        state.metrics.finished_time = time.monotonic()
        for completion in state.completions:
            completion.finish_reason = completion.finish_reason or "abort"
        self._record_finished(state)

    def _record_finished(self, state: _RequestState) -> None:
        m = state.metrics
        for completion in state.completions:
            self.metrics.observe_finished(
                len(state.prompt_token_ids),
                len(completion.token_ids),
                m.arrival_time,
                m.first_token_time,
                m.finished_time,
                completion.finish_reason,
            )

    def shutdown(self, free_memory: bool = True) -> None:
        """Stop the core; with `free_memory`, also give back the KV cache and graphs' device memory."""
        self._core.shutdown(free_memory)
        if self._counted and not self._core.is_alive():
            self._counted = False
            EngineProcessSettings.engine_stopped()
        self._tokenizer_thread.shutdown(wait=False)
