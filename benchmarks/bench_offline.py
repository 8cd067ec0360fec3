"""Offline throughput: `LLM.generate` on N random prompts with random input and output lengths.

    python benchmarks/bench_offline.py --preset llama-3-8b --num-prompts 1000 --input-len 1024 --output-len 1024

Lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)], as in
benchmark_serving's random dataset; ignore_eos makes every request run to its length.

`--step-kinds` splits the run's time by the kind of step (prefill only, mixed, decode batches by size) with the
memory each kind reads (weights once a step, decodes' cached keys): where a run's seconds go beyond the roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from bench_common import StepTrace, device_name, dummy_artifact, print_table, step_weight_bytes, write_json

from atom_runtime import LLM, SamplingParams
from atom_runtime.config import CUDAGRAPH_MODES, KV_CACHE_DTYPES, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--passes", default=None, help="export with these passes (see atom-compile passes)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--cudagraph-mode", default=EngineConfig.cudagraph_mode, choices=CUDAGRAPH_MODES)
    parser.add_argument("--step-kinds", action="store_true", help="time by kind of step (see above)")
    parser.add_argument("--out", type=Path, default=Path("bench_offline.json"))
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - args.range_ratio))), int(mean * (1 + args.range_ratio))
        return torch.randint(low, high + 1, (args.num_prompts,), generator=generator).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or dummy_artifact(args.preset, Path(tmp), "cuda", passes=args.passes)
        input_lens, output_lens = lengths(args.input_len), lengths(args.output_len)
        loading = time.perf_counter()
        llm = LLM(
            artifact,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(i + o for i, o in zip(input_lens, output_lens, strict=True)) + 1,
            kv_cache_dtype=args.kv_cache_dtype,
            cudagraph_mode=args.cudagraph_mode,
        )
        startup = time.perf_counter() - loading  # load, profile step, KV cache, graph capture (FULL mode's are many)
        vocab = llm.engine.core.runner.model.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in input_lens]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4])  # warm-up
        before = dataclasses.replace(llm.engine.core.stats)
        trace = StepTrace.attach(llm.engine.core.scheduler) if args.step_kinds else None
        started = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
        seconds = time.perf_counter() - started
        if trace is not None:
            runner = llm.engine.core.runner
            weights = step_weight_bytes(runner.model.forward.weights)
            kinds = trace.by_kind(weights, runner.block_bytes / runner.block_size)
        stats = llm.engine.core.stats
        steps = stats.num_steps - before.num_steps
        blocks = llm.engine.core.block_manager
        kv_tokens = blocks.num_blocks * blocks.block_size  # what the cache holds: with preemptions, what moved a run
        llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {
        "requests": len(outputs),
        "seconds": seconds,
        "request_throughput": len(outputs) / seconds,
        "output_tok_s": generated / seconds,
        "total_tok_s": (generated + sum(input_lens)) / seconds,
        "preemptions": stats.num_preemptions,
        "steps": steps,
        "kv_cache_tokens": kv_tokens,
        # The host's time a step queueing steps, and blocked on the device: a run that waits little is host-bound
        "launch_ms": (stats.launch_time_s - before.launch_time_s) / steps * 1e3,
        "wait_ms": (stats.wait_time_s - before.wait_time_s) / steps * 1e3,
        "cudagraph_mode": args.cudagraph_mode,
        "startup_s": startup,
    }
    print_table(
        f"offline, {args.artifact.name if args.artifact else args.preset}, "
        f"{args.num_prompts} prompts × ({args.input_len} in, {args.output_len} out), "
        f"{device_name()}",
        [row],
        [
            ("requests", "requests", "d"),
            ("seconds", "seconds", ".1f"),
            ("request_throughput", "req/s", ".2f"),
            ("output_tok_s", "output tok/s", ".0f"),
            ("total_tok_s", "total tok/s", ".0f"),
            ("preemptions", "preempt", "d"),
            ("steps", "steps", "d"),
            ("kv_cache_tokens", "KV tokens", "d"),
            ("launch_ms", "launch ms", ".2f"),
            ("wait_ms", "wait ms", ".2f"),
            ("startup_s", "start s", ".1f"),
        ],
    )
    if trace is not None:
        print_table(
            "time by kind of step (read: weights once a step and the decodes' cached keys, a second)",
            kinds,
            [
                ("kind", "kind", ""),
                ("steps", "steps", "d"),
                ("seconds", "seconds", ".1f"),
                ("share", "share", ".1%"),
                ("seqs", "seqs", ".1f"),
                ("tokens", "tokens", ".1f"),
                ("ms_per_step", "ms/step", ".2f"),
                ("read_tb_s", "read TB/s", ".2f"),
            ],
        )
        row["step_kinds"] = kinds
    write_json(
        args.out,
        {
            "preset": None if args.artifact else args.preset,  # the preset is exported only without --artifact
            "args": vars(args) | {"out": str(args.out), "artifact": str(args.artifact)},
            **row,
        },
    )


if __name__ == "__main__":
    main()
