"""Where the engine core steps: a thread of this process (`LLM`, `atom-run generate`), or a process of its
own (`atom-run serve`).

Both run `serve_core`: step while there is work, take commands between steps, and hand every result
to the engine as a message. In a process of its own the step loop shares no GIL with the server's HTTP
parsing, tokenization and detokenization: in one process, an HTTP flood slowed decode steps by 40% and
cut a streaming load's throughput 4× (Qwen3-0.6B on an H100, benchmarks/RESULTS.md), as vLLM's and
SGLang's separate engine processes avoid too.

Commands (engine -> core):  ("add", request_id, prompt_token_ids, params), ("abort", request_id, index or None),
                            ("call", call_id, fn) to run fn(core) between two steps, ("stop",)
Messages (core -> engine):  ("step", StepOutput, EngineStats), ("stats", EngineStats),
                            ("rejected", request_id, error), ("called", call_id, error or None, value),
                            ("dead", error), ("stopped",); a process first sends ("ready", limits, model_dir)
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from atom_runtime.engine_core import EngineCore, EngineLimits
from atom_runtime.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

Post = Callable[[tuple], None]

# How long a thread waiting for the GIL lets the holder run before asking for it (CPython's default:
# 5 ms). The core thread releases the GIL in every CUDA call that waits or launches a graph; with the
# default, each such release could hand the event loop (busy with a large batch's outputs) 5 ms before
# the next step's launch resumed, idling the GPU. A short interval bounds that wait.
GIL_SWITCH_INTERVAL_S = 1e-4


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
    # Reentrant: a collection while the lock is held may finalize an engine left running (`LLM.__del__`),
    # whose shutdown stops it here on the same thread. Such an engine is counted, so where one exists `first`
    # is false, and `engine_started` counts the new engine before anything that may trigger a collection.
    _lock = threading.RLock()
    _switch_interval = 0.0

    @classmethod
    def engine_started(cls) -> None:
        gc.collect()
        with cls._lock:
            first = cls.running == 0
            cls.running += 1
            if first:
                cls._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._switch_interval, GIL_SWITCH_INTERVAL_S))
            gc.freeze()

    @classmethod
    def engine_stopped(cls) -> None:
        with cls._lock:
            cls.running -= 1
            if not cls.running:
                gc.unfreeze()
                sys.setswitchinterval(cls._switch_interval)


def serve_core(core: EngineCore, commands: Any, post: Post) -> None:
    """Step `core` until told to stop; `commands` is a queue (thread or process), `post` takes the messages."""
    try:
        while _run_commands(core, commands, post, block=not core.has_work()):
            if core.has_work():
                output = core.step()
                if output is not None:
                    post(("step", output, dataclasses.replace(core.stats)))
                while core.rejected:
                    post(("rejected", *core.rejected.pop(0)))
            else:  # commands only (an abort, a call): no step follows to report what they changed
                post(("stats", dataclasses.replace(core.stats)))
        post(("stopped",))
    except BaseException as error:  # noqa: BLE001  (reported to every waiting request)
        logger.exception("engine core failed")
        post(("dead", error))


def _run_commands(core: EngineCore, commands: Any, post: Post, block: bool) -> bool:
    """Run the queued commands (waiting for one if `block`); False once told to stop."""
    try:
        command = commands.get(block=block)
    except queue.Empty:
        return True
    while True:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params = command
            try:
                core.add_request(request_id, prompt_token_ids, params)
            except InvalidRequestError as error:
                post(("rejected", request_id, error))
        elif kind == "abort":
            core.abort(*command[1:])
        elif kind == "call":
            _, call_id, fn = command
            try:
                post(("called", call_id, None, fn(core)))
            except Exception as error:  # noqa: BLE001  (handed back to the caller)
                post(("called", call_id, error, None))
        elif kind == "stop":
            return False
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return True


class CoreThread:
    """The core steps in a thread of this process; `core` stays reachable (tests, benchmarks)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.limits: EngineLimits = core.limits
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, post: Post) -> None:
        self._thread = threading.Thread(
            target=serve_core, args=(self.core, self._commands, post), name="atom-engine-core", daemon=True
        )
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, free_memory: bool) -> None:
        if self.is_alive():
            self.send(("stop",))
            self._thread.join(timeout=10)
        if free_memory and not self.is_alive():
            self.core.runner.release()


class CoreProcess:
    """The core steps in a spawned process, which loads the model and owns the GPU; returns once it is ready."""

    core = None  # not reachable from here

    def __init__(self, engine_kwargs: dict):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._commands = context.Queue()
        self._messages = context.Queue()
        self._process = context.Process(
            target=_core_process_main,
            args=(engine_kwargs, logging.getLogger().getEffectiveLevel(), self._commands, self._messages),
            name="atom-engine-core",
            daemon=True,
        )
        self._process.start()
        self._reader: threading.Thread | None = None
        message = self._next()
        if message[0] != "ready":
            self._process.join(timeout=10)
            raise message[1]
        self.limits: EngineLimits = message[1]
        self.model_dir: str = message[2]

    def _next(self) -> tuple:
        """The next message; ("dead", ...) if the process has exited without a word or sent one unreadable."""
        while True:
            try:
                return self._messages.get(timeout=1.0)
            except queue.Empty:
                if not self._process.is_alive():
                    try:
                        return self._messages.get(timeout=0.1)  # written just before it exited
                    except queue.Empty:
                        code = self._process.exitcode
                        return ("dead", RuntimeError(f"the engine process exited with status {code}"))
            except Exception as error:  # noqa: BLE001  (an unreadable message would leave every request waiting)
                return ("dead", RuntimeError(f"a message from the engine process could not be read: {error!r}"))

    def start(self, post: Post) -> None:
        self._reader = threading.Thread(target=self._read, args=(post,), name="atom-engine-reader", daemon=True)
        self._reader.start()

    def _read(self, post: Post) -> None:
        while True:
            message = self._next()
            post(message)
            if message[0] in ("dead", "stopped"):
                return

    def send(self, command: tuple) -> None:
        if command[0] == "call":  # the queue pickles on its own thread, where a failure would go unreported
            pickle.dumps(command)
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def shutdown(self, free_memory: bool) -> None:  # noqa: ARG002  (the process's exit frees everything)
        if self._process.is_alive():
            self.send(("stop",))
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout=10)
        if not self._process.is_alive():
            self._commands.cancel_join_thread()  # commands it never read must not hold this process at exit
        if self._reader is not None:
            self._reader.join(timeout=5)


class _ParentWatch:
    """The command queue of a core process, which reads a stop once its parent has gone.

    A server killed without shutting its engine down (SIGKILL, a crash) must not leave a process
    holding the GPU; the queue itself never reports it, since the child holds its write end too.
    """

    CHECK_EVERY_S = 1.0

    def __init__(self, commands: Any, messages: Any):
        self._commands = commands
        self._messages = messages
        self._parent = multiprocessing.parent_process()
        self._checked = time.monotonic()

    def _parent_gone(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S:
            return False
        self._checked = now
        return not self._parent.is_alive()

    def get(self, block: bool = True) -> tuple:
        while True:
            if self._parent_gone():
                logger.warning("the server process has gone; stopping the engine")
                # Messages nobody will read fill the pipe; waiting to flush them would keep this process alive.
                self._messages.cancel_join_thread()
                return ("stop",)
            try:
                return self._commands.get(block=block, timeout=self.CHECK_EVERY_S if block else None)
            except queue.Empty:
                if not block:
                    raise

    def get_nowait(self) -> tuple:
        return self.get(block=False)


def _core_process_main(engine_kwargs: dict, log_level: int, commands: Any, messages: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops this process
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    from atom_runtime.loading import create_core  # here: loading builds engines, which use this module

    def post(message: tuple) -> None:
        messages.put(message if message[0] in ("step", "stats") else _picklable(message))

    try:
        core, _ = create_core(**engine_kwargs)
    except BaseException as error:  # noqa: BLE001  (raised again in the parent)
        post(("dead", error))
        return
    EngineProcessSettings.engine_started()
    post(("ready", core.limits, core.runner.model.model_dir))
    serve_core(core, _ParentWatch(commands, messages), post)


def _picklable(message: tuple) -> tuple:
    """`message`, or, if it would not survive the trip to the parent (an exception that cannot be rebuilt, a
    result that cannot be pickled), the same message with a RuntimeError that says what it held."""
    try:
        pickle.loads(pickle.dumps(message))
        return message
    except Exception as problem:  # noqa: BLE001
        if message[0] == "called":
            _, call_id, error, _ = message
            why = f"{type(error).__name__}: {error}" if error is not None else f"its result cannot be sent: {problem!r}"
            return ("called", call_id, RuntimeError(why), None)
        return tuple(RuntimeError(f"{type(x).__name__}: {x}") if isinstance(x, BaseException) else x for x in message)
