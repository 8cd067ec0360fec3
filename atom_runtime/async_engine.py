"""The asyncio engine: requests in, streamed outputs out.

The engine core steps in its own thread and sees only token ids. This side, on the event
loop (uvloop under the server and `LLM`), tokenizes prompts, detokenizes new tokens,
matches stop strings and feeds each request's output queue, so HTTP and text work never
sit between two GPU steps. Commands to the core (add, abort) go through a thread-safe
queue; updates come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from atom_runtime.detokenizer import IncrementalDetokenizer
from atom_runtime.engine_core import EngineCore, StepOutput
from atom_runtime.metrics import Metrics
from atom_runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from atom_runtime.sampler import SampledTokens
from atom_runtime.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# How long a thread waiting for the GIL lets the holder run before asking for it (CPython's default:
# 5 ms). The core thread releases the GIL in every CUDA call that waits or launches a graph; with the
# default, each such release could hand the event loop (busy with a large batch's outputs) 5 ms before
# the next step's launch resumed, idling the GPU. A short interval bounds that wait.
GIL_SWITCH_INTERVAL_S = 1e-4


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
    queue: asyncio.Queue
    metrics: RequestMetrics
    stream: bool = True

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
        )


class EngineProcessSettings:
    """What running engines change for the whole process, undone when the last of them shuts down.

    - The GIL switch interval (GIL_SWITCH_INTERVAL_S).
    - The garbage collector: what is loaded by the time an engine starts (model, compiled pieces, graphs,
      tokenizer: 10^5-10^6 objects) lives as long as the engine, and is frozen out of the collector's
      way. Otherwise a full collection, which the per-step objects of a large batch trigger every so
      often, scans all of it and stalls a step by 0.1-0.4 s (measured at batch 256 on an H100 host).
      Freezing takes whatever else the process holds at that moment too; it is collectable again once
      no engine runs.
    """

    running = 0  # engines started and not shut down
    _lock = threading.Lock()
    _switch_interval = 0.0

    @classmethod
    def engine_started(cls) -> None:
        with cls._lock:
            if not cls.running:
                cls._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._switch_interval, GIL_SWITCH_INTERVAL_S))
            gc.collect()
            gc.freeze()
            cls.running += 1

    @classmethod
    def engine_stopped(cls) -> None:
        with cls._lock:
            cls.running -= 1
            if not cls.running:
                gc.unfreeze()
                sys.setswitchinterval(cls._switch_interval)


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer: PreTrainedTokenizerBase, model_name: str):
        self.core = core
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.model_name = model_name
        self.vocab_size = core.runner.model.config.vocab_size
        self.metrics = Metrics(core.stats, model_name)
        self._states: dict[str, _RequestState] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stopping = False
        EngineProcessSettings.engine_started()
        self._counted = True  # in EngineProcessSettings.running, until its core thread has stopped
        self._thread = threading.Thread(target=self._core_loop, name="atom-engine-core", daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    # ---- the core thread -------------------------------------------------------------

    def _core_loop(self) -> None:
        try:
            while True:
                self._run_commands(block=not self.core.has_work())
                if self._stopping:
                    return
                if self.core.has_work():
                    output = self.core.step()
                    if output is not None:
                        self._to_loop(self._on_updates, output)
        except BaseException as error:  # noqa: BLE001  (reported to every waiting request)
            logger.exception("engine core failed")
            self._error = error
            if self._loop is not None:
                self._to_loop(self._fail_all, error)

    def _to_loop(self, callback: Callable, *args) -> None:
        """Run `callback` on the event loop; not at all if it has closed (its requests wait for nothing)."""
        loop = self._loop
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if not loop.is_closed():
                raise

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, args = command
            if kind == "add":
                try:
                    self.core.add_request(*args)
                except InvalidRequestError as error:
                    self._to_loop(self._fail_request, args[0], error)
            elif kind == "abort":
                self.core.abort(*args)
            elif kind == "call":
                fn, future = args
                if future.set_running_or_notify_cancel():  # else the caller stopped waiting: skip it
                    try:
                        future.set_result(fn())
                    except Exception as error:  # noqa: BLE001  (handed back to the caller)
                        future.set_exception(error)
            elif kind == "stop":
                self._stopping = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    # ---- the event loop --------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (0 to {self.vocab_size - 1})", "prompt"
            )
        self.core.check_fits(len(prompt_token_ids), params)

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

        With `stream=False` only the finished output is yielded (no per-step copies of the output).

        Closing the iterator early (a client that went away) aborts the request and frees its blocks.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt or prompt_token_ids", "prompt")
            prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
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
        self._commands.put(("add", (request_id, state.prompt_token_ids, params)))
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.finished:
                self._commands.put(("abort", (request_id,)))
            self._states.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", (request_id,)))

    async def call_in_core(self, fn: Callable[[], object]) -> object:
        """Runs `fn` on the core thread between two steps, for thread-bound tools such as torch.profiler."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    def _on_updates(self, output: StepOutput) -> None:
        """Add one step's tokens to their requests; queue the outputs of finished and streamed ones."""
        now = time.monotonic()
        states, skipped, finished = self._states, output.skipped, output.finished
        changed: dict[str, _RequestState] = {}
        ended: set[str] = set()  # requests one of whose completions ended in this step
        for row, (seq, token) in enumerate(zip(output.seqs, output.token_ids, strict=True)):
            if skipped and row in skipped:
                continue
            state = states.get(seq.request_id)
            if state is None:
                continue
            completion = state.completions[seq.index]
            if completion.finish_reason is not None:
                continue  # already ended by a stop string; the core has been told
            completion.token_ids.append(token)
            if completion.logprobs is not None and output.sampled.logprobs is not None:
                self._add_logprobs(completion, token, output.sampled, row, state.params)
            detokenizer = completion.detokenizer
            stop = detokenizer.add(token) if detokenizer is not None else None
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
                ended.add(seq.request_id)
                if row not in finished:
                    self._commands.put(("abort", (seq.request_id, seq.index)))
            elif finished and row in finished:
                if detokenizer is not None:
                    detokenizer.flush()
                completion.finish_reason, completion.stop_reason = finished[row]
                ended.add(seq.request_id)
            state.metrics.num_cached_tokens = seq.num_cached_tokens
            changed[seq.request_id] = state
        for request_id, state in changed.items():
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            done = request_id in ended and state.finished
            if done:
                state.metrics.finished_time = now
                self._record_finished(state)
            if done or state.stream:
                state.queue.put_nowait(state.output())

    def _add_logprobs(
        self, completion: _Completion, token: int, sampled: SampledTokens, row: int, params: SamplingParams
    ) -> None:
        keep = 1 + params.logprobs
        ids, values = sampled.logprob_token_ids[row][:keep], sampled.logprobs[row][:keep]
        decode = self._decode_one if params.detokenize else lambda _: None
        entry = {token: Logprob(values[0], sampled.ranks[row], decode(token))}
        for rank, (top, value) in enumerate(zip(ids[1:], values[1:], strict=True), 1):
            entry.setdefault(top, Logprob(value, rank, decode(top)))
        completion.logprobs.append(entry)
        completion.cumulative_logprob += values[0]

    def _decode_one(self, token_id: int) -> str:
        return self.backend_tokenizer.decode([token_id], skip_special_tokens=False)

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

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        state = self._states.get(request_id)
        if state is not None:
            state.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in list(self._states.values()):
            state.queue.put_nowait(EngineDeadError(f"the engine stopped after an error: {error}"))

    def shutdown(self, free_memory: bool = True) -> None:
        """Stop the core thread; with `free_memory`, also give back the KV cache and graphs' device memory."""
        if self._thread.is_alive():
            self._commands.put(("stop", ()))
            self._thread.join(timeout=10)
        if self._counted and not self._thread.is_alive():
            self._counted = False
            EngineProcessSettings.engine_stopped()
        if free_memory and not self._thread.is_alive():
            self.core.runner.release()
