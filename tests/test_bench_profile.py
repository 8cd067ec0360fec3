"""bench_decode's graph-replay profile: how a replay's span is credited to kernels (PDL kernels overlap)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_decode import activity_name, critical_path, split_replays  # noqa: E402


def kernel(ts: float, dur: float, name: str, grid=None) -> dict:
    return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, **({"args": {"grid": grid}} if grid else {})}


def test_critical_path_credits_how_far_each_kernel_moves_the_end():
    """A PDL kernel starts before the one in front ends: its duration overcounts, its increment does not; a kernel
    ending inside another's span adds nothing; an idle gap goes to the kernel after it; the credits of a replay sum
    to its span."""
    replay = [(0.0, 5.0, "gemv"), (3.0, 9.0, "attention"), (4.0, 8.0, "tiny"), (9.5, 10.0, "gemv")]
    profile = critical_path([replay, [(t0 + 20, t1 + 20, n) for t0, t1, n in replay]])
    rows = {r["name"]: r for r in profile["kernels"]}
    assert profile["replays"] == 2 and profile["span_us_per_step"] == 10.0
    assert rows["gemv"]["incremental_us_per_step"] == 5 + 1 and rows["gemv"]["calls_per_step"] == 2
    assert rows["attention"]["incremental_us_per_step"] == 4.0 and rows["attention"]["duration_us_per_step"] == 6.0
    assert rows["tiny"]["incremental_us_per_step"] == 0.0
    assert sum(r["incremental_us_per_step"] for r in rows.values()) == profile["span_us_per_step"]
    assert [r["name"] for r in profile["kernels"]] == ["gemv", "attention", "tiny"]


def test_split_replays_and_names():
    events = [kernel(10 * i + j, 1, "k", [8 * (j + 1), 1, 1]) for i in range(3) for j in range(2)]
    events.append({"cat": "cpu_op", "ts": 0, "dur": 99, "name": "ignored"})
    replays = split_replays(events, 3)
    assert [[name for *_, name in r] for r in replays] == [["k grid 8x1x1", "k grid 16x1x1"]] * 3
    assert "not 2 equal sequences" in split_replays(events, 2)  # 6 activities, but the replays differ
    assert split_replays(events[-1:], 3) == "CUPTI reported no kernels inside the graph replays"
    assert activity_name({"name": "Memcpy HtoD"}) == "Memcpy HtoD"
    assert len(activity_name(kernel(0, 1, "x" * 80, [28672, 1, 1]))) <= 60
