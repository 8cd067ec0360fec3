"""torch.profiler traces of the engine, started and stopped on request (`/start_profile`, `/stop_profile`).

The profiler records the thread that starts it, and the model runs on the engine core's
thread (perhaps in its own process), so the core starts and stops it between two steps.
"""

from __future__ import annotations

import time
from operator import methodcaller
from pathlib import Path

from atom_runtime.async_engine import AsyncEngine
from atom_runtime.sampling_params import InvalidRequestError


class EngineProfiler:
    def __init__(self, engine: AsyncEngine, trace_dir: str | Path):
        self.engine = engine
        self.trace_dir = Path(trace_dir)
        self._recording: Path | None = None

    async def start(self) -> None:
        if self._recording is not None:
            raise InvalidRequestError("a profile is already being recorded; stop it first")
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"{self.engine.model_name}-{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json.gz"
        self._recording = path
        try:
            await self.engine.call_in_core(methodcaller("start_profile", str(path)))
        except BaseException:
            self._recording = None
            raise

    async def stop(self) -> Path:
        """Stops recording and writes the trace (a gzipped Chrome trace); returns its path."""
        if self._recording is None:
            raise InvalidRequestError("no profile is being recorded; start one first")
        path, self._recording = self._recording, None
        await self.engine.call_in_core(methodcaller("stop_profile"))
        return path
