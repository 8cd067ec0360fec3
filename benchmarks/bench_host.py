"""Host cost of an engine step: the real engine around a model forward that costs next to nothing.

    python benchmarks/bench_host.py --batch-sizes 1 64 256 --out bench_host.json
    python benchmarks/bench_host.py --batch-sizes 256 --profile     # cProfile of both threads

A tiny Llama goes through `LLM` as usual (tokenizer, async engine, scheduler, block manager,
step inputs, sampler, output processing), but its forward is replaced by a lookup that turns
each sampled row's input token into logits peaked on a next token (cycling through letters,
so detokenization sees ordinary text). Whatever remains per decode step is host work, which on
a GPU host must hide behind the GPU's step time.

Per step, as in `bench_decode.py`: wall = (generate with N+1 tokens − generate with 1) / N. The
engine thread's phases: schedule, prepare (step inputs), launch (the rest of queueing a step:
placeholders, sampler call, sample copy; the stub forward itself is reported apart as `model`),
read (taking the sampled tokens to the host), finish (token bookkeeping, stop checks, updates).
`outputs` is the event loop's work on those updates (detokenization, RequestOutputs): it runs
on another thread, in parallel with the engine's but under the same GIL, so it is not part of
the engine step yet can lengthen it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import print_table, write_json

from atom_models.checkpoints import make_random_checkpoint
from atom_runtime import LLM, SamplingParams

ENGINE_PHASES = ("schedule", "launch", "wait", "finish")
TIMED = ("prepare", "model", "sample", "outputs")
PHASES = ("schedule", "prepare", "model", "sample", "launch", "wait", "finish", "outputs")  # table columns


class Timers:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(TIMED, 0.0)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed


def stub_forward(vocab: int, letter_ids: list[int]) -> Callable:
    """A forward whose logits for each sampled row peak at the letter after that row's input token."""
    nxt = torch.tensor(letter_ids[1:] + letter_ids[:1])
    targets = torch.full((vocab,), letter_ids[0])
    targets[torch.tensor(letter_ids)] = nxt
    transition = torch.full((vocab, vocab), -10.0)
    transition[torch.arange(vocab), targets] = 10.0

    def forward(input_ids, positions, kv_caches, meta, logits_indices):
        return transition[input_ids[logits_indices]]

    return forward


def build(args: argparse.Namespace, workdir: Path) -> tuple[LLM, Timers, list[int]]:
    model = make_random_checkpoint(workdir / "tiny", "tiny-llama", num_hidden_layers=1)
    llm = LLM(
        model,
        device="cpu",
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.context + args.steps + 16,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    core, engine = llm.engine.core, llm.engine
    runner = core.runner
    letters = llm.tokenizer.encode("abcdefghijklmnopqrstuvwxyz ")
    runner.model.forward = stub_forward(runner.model.config.vocab_size, letters)
    timers = Timers()
    runner.inputs.load = timers.wrap("prepare", runner.inputs.load)
    runner.model.forward = timers.wrap("model", runner.model.forward)
    runner.sampler = timers.wrap("sample", runner.sampler)
    engine._on_updates = timers.wrap("outputs", engine._on_updates)
    return llm, timers, letters


def run(llm: LLM, timers: Timers, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Wall seconds of one generate, and the seconds of each phase (and steps) it took."""
    stats = llm.engine.core.stats

    def snapshot() -> dict[str, float]:
        return {p: getattr(stats, f"{p}_time_s") for p in (*ENGINE_PHASES, "step")} | dict(
            timers.seconds, steps=stats.num_steps
        )

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = snapshot()
    started = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - started
    after = snapshot()
    return {k: after[k] - before[k] for k in after} | {"wall": wall}


def measure(llm: LLM, timers: Timers, prompts: list[list[int]], steps: int, repeats: int) -> dict[str, float]:
    """Microseconds per decode step, medians over `repeats` pairs of runs."""
    run(llm, timers, prompts, 4)  # warm-up
    samples: list[dict[str, float]] = []
    for _ in range(repeats):
        full, prefill = run(llm, timers, prompts, steps + 1), run(llm, timers, prompts, 1)
        n = full["steps"] - prefill["steps"]
        per = {k: (full[k] - prefill[k]) / n * 1e6 for k in full if k != "steps"}
        per["launch"] -= per["prepare"] + per["model"] + per["sample"]
        per["wall"] = (full["wall"] - prefill["wall"]) / steps * 1e6
        samples.append(per)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def profile(llm: LLM, prompts: list[list[int]], steps: int, top: int) -> None:
    """cProfile of the engine thread's steps and of the event loop's output processing, by own time."""
    engine, core = llm.engine, llm.engine.core
    profiles = {"engine thread (EngineCore.step)": cProfile.Profile(), "event loop (_on_updates)": cProfile.Profile()}
    step_profile, out_profile = profiles.values()
    step, on_updates = core.step, engine._on_updates

    def profiled(prof: cProfile.Profile, fn: Callable) -> Callable:
        def wrapper(*args):
            prof.enable()
            try:
                return fn(*args)
            finally:
                prof.disable()

        return wrapper

    core.step, engine._on_updates = profiled(step_profile, step), profiled(out_profile, on_updates)
    try:
        llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        )
    finally:
        core.step, engine._on_updates = step, on_updates
    for title, prof in profiles.items():
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(f"\n=== {title}, batch {len(prompts)}, {steps} steps ===\n{text.getvalue()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=400, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per batch size")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per batch size (medians reported)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print cProfile tables for the largest batch")
    parser.add_argument("--top", type=int, default=30, help="rows of each cProfile table")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        llm, timers, letters = build(args, Path(tmp))
        rows = []
        for batch in args.batch_sizes:
            # Distinct prompts (no prefix shared across sequences), of letters the tokenizer decodes.
            prompts = [
                [letters[(i * 7 + j * (i % 5 + 1)) % len(letters)] for j in range(args.context)] for i in range(batch)
            ]
            for p, i in zip(prompts, range(batch), strict=True):
                p[:4] = llm.tokenizer.encode(f"{i:04d}")
            rows.append({"batch": batch, **measure(llm, timers, prompts, args.steps, args.repeats)})
        if args.profile:
            profile(llm, prompts, args.steps, args.top)
        llm.shutdown()
    columns = [("batch", "batch", "d"), ("wall", "wall µs", ".0f"), ("step", "engine µs", ".0f")]
    columns += [(p, f"{p} µs", ".0f") for p in PHASES]
    print_table(
        f"host µs per decode step (context {args.context}, {args.steps} steps, median of {args.repeats}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'})",
        rows,
        columns,
    )
    if args.out is not None:
        write_json(
            args.out,
            {"context": args.context, "steps": args.steps, "args": vars(args) | {"out": str(args.out)}, "rows": rows},
        )


if __name__ == "__main__":
    main()
