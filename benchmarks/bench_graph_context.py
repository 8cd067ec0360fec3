"""Engine decode step against the CUDA-graph replay of the same step at the same context.

    python benchmarks/bench_graph_context.py --preset llama-3-8b --batch-sizes 1 256

`bench_decode.py`'s `graph ms` replays the step with every sequence one token long (padding rows),
so it leaves out the KV-cache reads, which at batch 256 and a 400-token context are most of
the step. Here the graph is also replayed over `batch` sequences of the context that the timed
engine steps average (`context + steps / 2` tokens): `graph ctx ms` is the GPU time the engine
step cannot go below, and `engine ms − graph ctx ms` is what host work and per-step extras
(sampling, uploads) add to it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_common import device_name, dummy_artifact, print_table, write_json
from bench_decode import graph_step_ms, timed_generate

from atom_runtime import LLM, SamplingParams
from atom_runtime.scheduler import ScheduledChunk
from atom_runtime.sequence import Sequence


def graph_context_ms(llm: LLM, batch: int, context: int, reps: int = 50) -> float:
    """Replay time of the batch-`batch` decode graph with every sequence `context` tokens long."""
    core = llm.engine.core
    runner, blocks = core.runner, core.block_manager
    seqs = [Sequence(f"graph-{i}", 0, [0] * context, SamplingParams()) for i in range(batch)]
    for seq in seqs:
        if not blocks.allocate(seq, context):
            raise RuntimeError(f"the KV cache cannot hold {batch} sequences of {context} tokens")
    runner.inputs.load([ScheduledChunk(s, context - 1, 1) for s in seqs], pad_seqs_to=batch)
    for _ in range(5):
        runner.graphs.replay(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        runner.graphs.replay(batch)
    end.record()
    end.synchronize()
    for seq in seqs:
        blocks.free(seq)
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--artifact", type=Path, default=None, help="use this artifact instead of exporting")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=400, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    parser.add_argument("--out", type=Path, default=Path("bench_graph_context.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or dummy_artifact(args.preset, Path(tmp), "cuda")
        llm = LLM(
            artifact,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.context + args.steps + 16,
            enable_prefix_caching=False,
            cudagraph_capture_sizes=args.batch_sizes,
        )
        vocab = llm.engine.core.runner.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        rows = []
        for batch in args.batch_sizes:
            prompts = torch.randint(0, vocab, (batch, args.context), generator=generator).tolist()
            timed_generate(llm, prompts, 4)  # warm-up
            engine = []
            for _ in range(3):
                full, full_phases = timed_generate(llm, prompts, args.steps + 1)
                prefill, prefill_phases = timed_generate(llm, prompts, 1)
                engine.append((full - prefill) / args.steps * 1e3)
            steps = full_phases["steps"] - prefill_phases["steps"]
            wait_ms = (full_phases["wait"] - prefill_phases["wait"]) / steps * 1e3
            rows.append(
                {
                    "batch": batch,
                    "engine_ms": sorted(engine)[1],
                    "wait_ms": wait_ms,
                    "graph_ms": graph_step_ms(llm, batch),
                    "graph_ctx_ms": graph_context_ms(llm, batch, args.context + args.steps // 2),
                }
            )
        llm.shutdown()
    print_table(
        f"decode, {args.preset}, context {args.context} (+{args.steps} steps), {device_name()}",
        rows,
        [
            ("batch", "batch", "d"),
            ("engine_ms", "engine ms", ".3f"),
            ("wait_ms", "of which waiting", ".3f"),
            ("graph_ms", "graph ms (1 token)", ".3f"),
            ("graph_ctx_ms", "graph ctx ms", ".3f"),
        ],
    )
    write_json(args.out, {"preset": args.preset, "context": args.context, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
