"""Pass A/B: the same decode workload on artifacts exported with each pass turned off in turn.

    python benchmarks/bench_passes.py --preset qwen3-0.6b --batch-sizes 1 64
    python benchmarks/bench_passes.py --preset llama-3-8b --quantization fp8

Each variant is exported with `--passes=-NAME` (the default pipeline minus one pass) next to
the full pipeline, and timed as in `bench_decode.py`: the engine's decode step once the whole
batch decodes (`timed_decode`) and the replay of its CUDA graph alone (`graph_step_ms`). Passes
that do not fire on the model (e.g. the quant fusions on a bf16 model) are reported as such
instead of being timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from bench_common import device_name, dummy_artifact, print_table, write_json
from bench_decode import REPLAY_ROOM, graph_step_ms, timed_decode

from atom_compile.passes import DEFAULT_PIPELINE
from atom_runtime import LLM


def decode_ms(artifact: Path, batch_sizes: list[int], context: int, steps: int) -> dict[str, float | None]:
    """Engine and graph ms a decode step at each batch size, as `{"b1_ms": ..., "b1_graph_ms": ...}`."""
    llm = LLM(
        artifact,
        max_num_seqs=max(batch_sizes),
        max_model_len=context + 2 * steps + 64 + REPLAY_ROOM,
        enable_prefix_caching=False,
        cudagraph_capture_sizes=batch_sizes,
    )
    vocab = llm.engine.core.runner.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    result = {}
    for batch in batch_sizes:
        prompts = torch.randint(0, vocab, (batch, context), generator=generator).tolist()
        timed_decode(llm, prompts, 8)  # warm-up
        seconds, _ = timed_decode(llm, prompts, steps)
        result[f"b{batch}_ms"] = seconds * 1e3
        result[f"b{batch}_graph_ms"] = graph_step_ms(llm, batch, context + steps)
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench_passes.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [None] + [f"-{name}" for name in DEFAULT_PIPELINE]
        baseline = None
        for passes in variants:
            artifact = dummy_artifact(args.preset, Path(tmp), "cuda", passes=passes)
            fired = {p["name"]: p["matches"] for p in json.loads((artifact / "manifest.json").read_text())["passes"]}
            off = passes[1:] if passes else None
            row = {"variant": "all passes" if off is None else f"without {off}"}
            if off is not None and baseline is not None and baseline["fired"].get(off, 0) == 0:
                row["note"] = "does not fire on this model"
                rows.append(row)
                continue
            times = decode_ms(artifact, args.batch_sizes, args.context, args.steps)
            row |= times
            if baseline is None:
                baseline = {"fired": fired, "times": times}
            else:
                row |= {f"b{b}_vs_all": times[f"b{b}_ms"] / baseline["times"][f"b{b}_ms"] for b in args.batch_sizes}
            rows.append(row)
    columns = [("variant", "variant", "")]
    for b in args.batch_sizes:
        columns += [
            (f"b{b}_ms", f"batch {b} ms", ".3f"),
            (f"b{b}_graph_ms", f"b{b} graph ms", ".3f"),
            (f"b{b}_vs_all", f"b{b} / all", ".2f"),
        ]
    columns.append(("note", "note", ""))
    print_table(f"passes A/B, {args.preset}, context {args.context}, {device_name()}", rows, columns)
    write_json(args.out, {"preset": args.preset, "context": args.context, "rows": rows})


if __name__ == "__main__":
    main()
