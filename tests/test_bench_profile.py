"""bench_decode's graph replays: which graph they replay, and how a replay's span is credited to kernels (PDL
kernels overlap); profile_steps' and bench_offline's accounting of a run's steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from atom_runtime.block_manager import BlockManager
from atom_runtime.cuda_graphs import SHORT_CONTEXT, FullGraphs, GraphKey
from atom_runtime.step_inputs import StepInputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_common import StepTrace, served_table_blocks  # noqa: E402
from bench_decode import activity_name, critical_path, decode_graph_inputs, split_replays  # noqa: E402
from profile_steps import covered_us  # noqa: E402


def test_kernel_benches_pass_the_engines_block_tables():
    """A lone context that fits the short batch-1 graph gets its table's width, anything else the served
    max_model_len's (or the context's, if longer)."""
    short = SHORT_CONTEXT // 16
    assert served_table_blocks(1, 432, 16) == served_table_blocks(1, SHORT_CONTEXT, 16) == short
    assert served_table_blocks(1, SHORT_CONTEXT + 1, 16) == served_table_blocks(64, 432, 16) == 8192 // 16
    assert served_table_blocks(1, 10_000, 16) == 625


def test_decode_graph_inputs_pick_the_engines_graph():
    """The timed replays run the graph the engine would pick for the batch at that context (a lone short context:
    the short batch-1 graph), or none where the engine has none; the blocks they borrow go back."""
    block_size, max_blocks = 16, 4 * SHORT_CONTEXT // 16
    runner = SimpleNamespace(inputs=StepInputs(64, 4, max_blocks, block_size, torch.device("cpu")))
    runner.graphs = FullGraphs(runner, [1, 2], pool=None)  # nothing captured: the keys alone
    blocks = BlockManager(1024, block_size)
    llm = SimpleNamespace(engine=SimpleNamespace(core=SimpleNamespace(runner=runner, block_manager=blocks)))
    short = GraphKey(1, SHORT_CONTEXT // block_size)
    cases = [
        (1, 1000, short),
        (1, SHORT_CONTEXT - 10, short),  # the 20 replays' contexts end at 2,047 tokens: all fit
        (1, SHORT_CONTEXT, GraphKey(1)),  # the later replays would not fit the short graph
        (1, 3 * SHORT_CONTEXT, GraphKey(1)),
        (2, 1000, GraphKey(2)),
    ]
    for batch, context, expected in cases:
        with decode_graph_inputs(llm, batch, context, 20) as key:
            assert key == expected and blocks.num_free_blocks < 1024
        assert blocks.num_free_blocks == 1024
    with decode_graph_inputs(llm, 3, 1000, 20) as key:  # padded to no captured size of 3
        assert key is None


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


def test_profile_steps_reports_each_steps_ops(llama_artifact, tmp_path):
    """profile_steps.py on the CPU: the ops of the profiled steps (on a GPU, the kernels) and what the steps held."""
    out = tmp_path / "steps.json"
    command = [sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "profile_steps.py")]
    command += ["--artifact", str(llama_artifact), "--num-prompts", "3", "--input-len", "12", "--output-len", "8"]
    command += ["--max-num-batched-tokens", "16", "--warm-steps", "2", "--timed-steps", "2", "--profiled-steps", "2"]
    command += ["--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["kernels"] and result["kernels"][0]["ms"] >= result["kernels"][-1]["ms"] > 0
    assert 1 <= result["seqs"] <= 3 and result["tokens"] <= 16 and result["wall_ms"] > 0
    assert "kernels, device time a step" in run.stdout


def test_profile_steps_counts_overlapping_kernels_once():
    """A step's prefill tiles run beside its decode programs: attention's time is the wall its kernels cover."""
    spans = [SimpleNamespace(start=a, end=b) for a, b in [(10, 30), (0, 5), (12, 40), (50, 60), (55, 58), (4, 6)]]
    assert covered_us(spans) == 6 + 30 + 10
    assert covered_us([]) == 0


def test_offline_step_kinds_split_the_run():
    """bench_offline --step-kinds: a step's time runs to the next step's scheduling; each kind's read rate counts the
    weights once a step and its decodes' cached keys."""
    trace = StepTrace()
    # (time, sequences, tokens, decodes, cached keys the decodes read)
    trace.steps = [
        (0.0, 4, 40, 0, 0),
        (1.0, 6, 20, 4, 400),
        (1.5, 100, 100, 100, 10_000),
        (1.75, 200, 200, 200, 40_000),
        (1.85, 30, 30, 30, 900),
        (1.9, 0, 0, 0, 0),
    ]
    rows = {row["kind"]: row for row in trace.by_kind(weight_bytes=1000, kv_token_bytes=10)}
    assert list(rows) == ["decode 1-63", "decode 192+", "decode 64-191", "mixed", "prefill"]
    assert rows["prefill"]["seconds"] == 1.0 and rows["mixed"]["seconds"] == 0.5
    assert rows["decode 192+"]["read_tb_s"] == pytest.approx((1000 + 40_000 * 10) / 0.1 / 1e12)
    assert rows["decode 1-63"]["ms_per_step"] == pytest.approx(50)
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1)
