"""bench_offline's workload on a cost model, without a GPU: where the time of an offline run goes, and its floors.

    python benchmarks/sim_offline.py                                   # Llama-3-8B, 1000 x (1024 in, 1024 out)
    python benchmarks/sim_offline.py --max-num-seqs 192 256 288 --max-num-batched-tokens 2048 8192

The real `EngineCore` (scheduler, block manager, preemption, the step loop) runs the requests; a stand-in runner
charges each step the time the measured rates give it instead of running a model:
- decode attention: the step's context tokens x KV bytes a token, read at `--kv-tb-s` (decode attention's measured
  rate at batch 256, `bench_kernels.py --only decode`), or at `--mixed-kv-tb-s` in a step with prefill tokens (what
  a measured mixed step leaves its decodes once its linears are counted, the prefill tiles' tail in); prefill
  attention's FLOPs at `--prefill-attention-tflops`;
- the decoder layers' linears for M tokens: interpolated between `--linear-ms M:ms` points, the whole model's
  qkv/o/gate_up/down (defaults: `bench_overlap.py`'s 8-layer timings x 4 for M >= 256; M = 1 is the batch-1 step
  less its LM head and attention, from `bench_decode.py`); the LM head as those linears scaled by its share of the
  weights, for the rows that sample.
Defaults are Llama-3-8B's on one H100 (twenty-fourth, twenty-fifth and twenty-ninth sessions); against
`bench_offline.py` at 31335c3 the model gives 122.9 s for 124.7 measured (budget 512), 128.4 for 134.2 (2048) and
130.8 for 135.7 (8192). (The mixed rate was 2.05 TB/s while mixed steps were bound by the host: 2.75 since the cache
writes joined the piecewise graphs: 216 decodes and ~296 prompt tokens in 26.57 ms, 10.5 of them linears.)

It prints the modeled run for each setting and two floors: `serial` (every byte of KV read once at the decode rate,
every prompt token's linears at the large-M rate, the fewest decode steps `max_num_seqs` allows, nothing recomputed)
and `hbm` (the bytes the run must move, KV and a weight read a decode step, at `--copy-tb-s`, with all compute hidden
under them).
"""

from __future__ import annotations

import argparse
import bisect
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_common import print_table, projections, write_json

from atom_models.checkpoints import make_config
from atom_models.llama import head_dim_of
from atom_runtime.config import EngineConfig
from atom_runtime.engine_core import EngineCore
from atom_runtime.sampler import DeviceSample
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.scheduler import ScheduledChunk


@dataclass
class CostModel:
    kv_bytes_per_token: int  # keys and values of every layer
    layer_params: int  # the decoder layers' linear weights, all layers
    head_params: int
    attention_flops_per_pair: int  # a prefill (query, key) pair, all heads and layers
    linear_points: list[tuple[int, float]]  # (M tokens, ms) of the decoder layers' linears, M ascending
    kv_tb_s: float
    mixed_kv_tb_s: float  # in steps that carry prefill tokens too
    prefill_attention_tflops: float

    @classmethod
    def for_preset(cls, preset: str, **rates) -> CostModel:
        c = make_config(preset)
        head_dim, layers = head_dim_of(c), c.num_hidden_layers
        gemms = {name: n * k for name, n, k in projections(preset)}
        return cls(
            kv_bytes_per_token=2 * layers * c.num_key_value_heads * head_dim * 2,
            layer_params=layers * sum(v for name, v in gemms.items() if name != "lm_head"),
            head_params=gemms["lm_head"],
            attention_flops_per_pair=4 * c.num_attention_heads * head_dim * layers,
            **rates,
        )

    def linear_s(self, m: int) -> float:
        """The layers' linears for `m` tokens: piecewise linear through the measured points, extended past the ends."""
        points = self.linear_points
        i = min(max(bisect.bisect_left([p[0] for p in points], m), 1), len(points) - 1)
        (m0, t0), (m1, t1) = points[i - 1], points[i]
        return (t0 + (t1 - t0) * (m - m0) / (m1 - m0)) / 1e3

    def step_s(self, chunks: list[ScheduledChunk]) -> dict[str, float]:
        decode_context = prefill_pairs = tokens = samples = 0
        for c in chunks:
            tokens += c.num_tokens
            samples += c.samples
            if c.num_tokens == 1:
                decode_context += c.start + 1
            else:
                prefill_pairs += c.num_tokens * (c.start + (c.num_tokens + 1) / 2)
        kv_tb_s = self.mixed_kv_tb_s if prefill_pairs else self.kv_tb_s
        return {
            "linears, steps with prefill" if prefill_pairs else "linears, decode steps": self.linear_s(tokens),
            "decode attention": decode_context * self.kv_bytes_per_token / (kv_tb_s * 1e12),
            "prefill attention": prefill_pairs * self.attention_flops_per_pair / (self.prefill_attention_tflops * 1e12),
            "lm head": self.linear_s(samples) * self.head_params / self.layer_params if samples else 0.0,
        }


class ModeledRunner:
    """Stands in for `ModelRunner`: each step's tokens come back at once (token 0) and its modeled time is summed."""

    def __init__(self, cost: CostModel, num_blocks: int, vocab_size: int):
        self.cost = cost
        self.num_blocks = num_blocks
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        self.seconds: Counter[str] = Counter()
        self.recomputed_tokens = 0  # tokens computed again after a preemption
        self.computed: dict[tuple[str, int], int] = {}  # the most tokens of each sequence ever computed

    def launch(self, chunks: list[ScheduledChunk], in_flight: DeviceSample | None = None) -> DeviceSample | None:
        self.seconds.update(self.cost.step_s(chunks))
        for c in chunks:
            done = self.computed.get(c.seq.key, 0)
            self.recomputed_tokens += max(0, min(c.start + c.num_tokens, done) - c.start)
            self.computed[c.seq.key] = max(done, c.start + c.num_tokens)
        samples = sum(c.samples for c in chunks)
        return DeviceSample(torch.zeros(samples, dtype=torch.long)) if samples else None


def simulate(cost: CostModel, args: argparse.Namespace, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    config = EngineConfig(
        max_model_len=args.input_len + args.output_len + 1,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=args.block_size,
    )
    runner = ModeledRunner(cost, args.kv_cache_tokens // args.block_size, vocab_size=1 << 17)
    core = EngineCore(runner, config, eos_token_ids=set())
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(args.num_prompts):
        core.add_request(str(i), torch.randint(0, 1 << 17, (args.input_len,), generator=generator).tolist(), params)
    while core.has_work():
        core.step()
    seconds = sum(runner.seconds.values())
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "seconds": seconds,
        "output_tok_s": args.num_prompts * args.output_len / seconds,
        "steps": core.stats.num_steps,
        "preemptions": core.stats.num_preemptions,
        "recomputed_tokens": runner.recomputed_tokens,
        **runner.seconds,
    }


def floors(cost: CostModel, args: argparse.Namespace, max_num_seqs: int, copy_tb_s: float) -> dict[str, float]:
    """Seconds no schedule beats: `serial` runs the parts one after the other at the measured rates, `hbm` hides
    every FLOP under the bytes that must move."""
    n, prompt, out = args.num_prompts, args.input_len, args.output_len
    # A prompt's step samples its first token; each later one takes a decode step at contexts prompt + 1, + 2, ...
    kv_bytes = n * sum(prompt + i for i in range(1, out)) * cost.kv_bytes_per_token
    batch = min(n, max_num_seqs)
    decode_steps = n * (out - 1) / batch
    big_m = cost.linear_points[-1][0]
    prefill = n * prompt * cost.linear_s(big_m) / big_m
    decode = decode_steps * cost.linear_s(batch) * (1 + cost.head_params / cost.layer_params)
    weight_bytes = 2 * (cost.layer_params + cost.head_params)
    return {
        "serial": kv_bytes / (cost.kv_tb_s * 1e12) + prefill + decode,
        "hbm": (kv_bytes + decode_steps * weight_bytes) / (copy_tb_s * 1e12),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256])
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--kv-cache-tokens", type=int, default=435_000, help="the KV cache bench_offline reported")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tb-s", type=float, default=2.96, help="decode attention's KV read rate")
    parser.add_argument(
        "--mixed-kv-tb-s", type=float, default=2.75, help="the same in steps with prefill tokens (their tiles' tail in)"
    )
    parser.add_argument("--copy-tb-s", type=float, default=2.94, help="HBM copy bandwidth")
    parser.add_argument("--prefill-attention-tflops", type=float, default=300.0)
    parser.add_argument(
        "--linear-ms",
        nargs="+",
        default=["1:4.70", "256:6.72", "512:10.52", "1024:20.73", "2048:42.70"],
        help="M:ms points of the decoder layers' linears (all layers) for M tokens",
    )
    parser.add_argument("--out", type=Path, default=Path("sim_offline.json"))
    args = parser.parse_args()

    points = sorted((int(m), float(ms)) for m, ms in (p.split(":") for p in args.linear_ms))
    cost = CostModel.for_preset(
        args.preset,
        linear_points=points,
        kv_tb_s=args.kv_tb_s,
        mixed_kv_tb_s=args.mixed_kv_tb_s,
        prefill_attention_tflops=args.prefill_attention_tflops,
    )
    rows = []
    for seqs in args.max_num_seqs:
        for budget in args.max_num_batched_tokens:
            row = simulate(cost, args, seqs, budget)
            row.update({f"{k} floor": v for k, v in floors(cost, args, seqs, args.copy_tb_s).items()})
            rows.append(row)
    parts = ("decode attention", "prefill attention", "linears, decode steps", "linears, steps with prefill", "lm head")
    print_table(
        f"modeled offline run, {args.preset}, {args.num_prompts} prompts x ({args.input_len} in, "
        f"{args.output_len} out), KV cache {args.kv_cache_tokens} tokens (seconds)",
        rows,
        [
            ("max_num_seqs", "seqs", "d"),
            ("max_num_batched_tokens", "budget", "d"),
            ("seconds", "seconds", ".1f"),
            ("output_tok_s", "output tok/s", ".0f"),
            ("steps", "steps", "d"),
            ("preemptions", "preempt", "d"),
            ("recomputed_tokens", "recomputed", "d"),
            *[(p, p, ".1f") for p in parts],
            ("serial floor", "serial floor", ".1f"),
            ("hbm floor", "hbm floor", ".1f"),
        ],
    )
    write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "rows": rows})


if __name__ == "__main__":
    main()
