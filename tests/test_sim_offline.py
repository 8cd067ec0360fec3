"""sim_offline's modeled run: the real engine loop schedules, the cost model charges what each step reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from sim_offline import CostModel, floors, simulate  # noqa: E402

POINTS = [(1, 4.7), (256, 6.72), (512, 10.52), (1024, 20.73), (2048, 42.7)]


def workload(**overrides) -> argparse.Namespace:
    base = dict(num_prompts=4, input_len=8, output_len=4, kv_cache_tokens=1024, block_size=16)
    return argparse.Namespace(**(base | overrides))


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.for_preset(
        "llama-3-8b", linear_points=POINTS, kv_tb_s=2.0, mixed_kv_tb_s=1.0, prefill_attention_tflops=300.0
    )


def test_llama_3_8b_reads_128_kib_of_kv_a_token(cost):
    assert cost.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert cost.linear_s(256) == pytest.approx(6.72e-3) and cost.linear_s(384) == pytest.approx(8.62e-3)


def test_decode_steps_read_each_context_once(cost):
    """One step prefills the four prompts and samples their first tokens; three decode steps follow, at contexts
    9, 10 and 11, and read those tokens' keys and values at the decode rate."""
    args = workload()
    row = simulate(cost, args, max_num_seqs=4, max_num_batched_tokens=64)
    assert row["preemptions"] == 0 and row["recomputed_tokens"] == 0
    expected = 4 * (9 + 10 + 11) * cost.kv_bytes_per_token / 2.0e12
    assert row["decode attention"] == pytest.approx(expected)
    assert row["linears, steps with prefill"] == pytest.approx(cost.linear_s(32))
    assert row["linears, decode steps"] == pytest.approx(3 * cost.linear_s(4))
    assert floors(cost, args, 4, copy_tb_s=2.0)["serial"] <= row["seconds"]


def test_a_full_cache_preempts_and_recomputes(cost):
    """Four sequences of up to 40 tokens in a 96-token cache: the newest are preempted, computed again, and every
    request still runs to its length."""
    args = workload(input_len=24, output_len=16, kv_cache_tokens=96)
    row = simulate(cost, args, max_num_seqs=4, max_num_batched_tokens=128)
    assert row["preemptions"] > 0 and row["recomputed_tokens"] > 0
    assert row["output_tok_s"] * row["seconds"] == pytest.approx(4 * 16)
