"""Host cost of an engine step: the real engine around a model forward that costs next to nothing.

    python benchmarks/bench_host.py --batch-sizes 1 64 256 --out bench_host.json
    python benchmarks/bench_host.py --batch-sizes 256 --profile     # cProfile of both threads
    python benchmarks/bench_host.py --device cuda                   # on a GPU host: CUDA launches included

A tiny Llama goes through `LLM` as usual (tokenizer, async engine, scheduler, block manager,
step inputs, sampler, output processing), but its forward is replaced by a lookup that turns
each sampled row's input token into logits peaked on a next token (cycling through letters,
so detokenization sees ordinary text). Whatever remains per decode step is host work, which on
a GPU host must hide behind the GPU's step time.

Per step, as in `bench_decode.py`: wall = (generate with N+1 tokens − generate with 1) / N, and
`engine` = the engine thread's step (wall time), split into: schedule; prepare (step inputs); model
(the stub forward); sample (the sampler: on CPU its argmax is the device's work); launch (the rest of
queueing a step: runner glue, sample copy, placeholders); wait (reading the sampled tokens); finish
(token bookkeeping, stop checks). `engine cpu` is the engine thread's CPU time per step and `outputs`
the event loop's (detokenization, RequestOutputs). The two threads share the GIL: a step that releases
it (any torch call) may wait while the event loop processes the previous step's tokens, and that wait
lands in whichever phase released it, so wall ≈ engine cpu + outputs + switching, not the phase sum.
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
TIMED = ("prepare", "model", "sample", "engine_cpu", "outputs")
PHASES = ("schedule", "prepare", "model", "sample", "launch", "wait", "finish", "outputs")  # table columns


class Timers:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(TIMED, 0.0)

    def wrap(self, name: str, fn: Callable, clock: Callable[[], float] = time.perf_counter) -> Callable:
        def timed(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += clock() - started

        return timed


def stub_forward(vocab: int, letter_ids: list[int], device: torch.device) -> Callable:
    """A forward whose logits for each sampled row peak at the letter after that row's input token."""
    nxt = torch.tensor(letter_ids[1:] + letter_ids[:1])
    targets = torch.full((vocab,), letter_ids[0])
    targets[torch.tensor(letter_ids)] = nxt
    transition = torch.full((vocab, vocab), -10.0)
    transition[torch.arange(vocab), targets] = 10.0
    transition = transition.to(device)

    def forward(input_ids, positions, kv_caches, meta, logits_indices):
        return transition[input_ids[logits_indices]]

    return forward


def build(args: argparse.Namespace, workdir: Path) -> tuple[LLM, Timers, list[int]]:
    model = make_random_checkpoint(workdir / "tiny", "tiny-llama", num_hidden_layers=1)
    max_model_len = args.context + args.steps + 16
    # On a GPU: no graphs (the stub is not capturable) and a fixed cache, so the real model never runs.
    gpu = {"enforce_eager": True, "num_kvcache_blocks": max(args.batch_sizes) * -(-max_model_len // 16)}
    llm = LLM(
        model,
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        **(gpu if args.device == "cuda" else {}),
    )
    core, engine = llm.engine.core, llm.engine
    runner = core.runner
    letters = llm.tokenizer.encode("abcdefghijklmnopqrstuvwxyz ")
    runner.model.forward = stub_forward(runner.model.config.vocab_size, letters, runner.device)
    timers = Timers()
    runner.inputs.load = timers.wrap("prepare", runner.inputs.load)
    runner.model.forward = timers.wrap("model", runner.model.forward)
    runner.sampler = timers.wrap("sample", runner.sampler)
    # CPU time of the thread, not wall time: what each thread itself costs, without waits for the GIL.
    core.step = timers.wrap("engine_cpu", core.step, time.thread_time)
    engine._on_updates = timers.wrap("outputs", engine._on_updates, time.thread_time)
    return llm, timers, letters


def run(llm: LLM, timers: Timers, prompts: list[list[int]], max_tokens: int, detokenize: bool) -> dict[str, float]:
    """Wall seconds of one generate, and the seconds of each phase (and steps) it took."""
    stats = llm.engine.core.stats

    def snapshot() -> dict[str, float]:
        return {p: getattr(stats, f"{p}_time_s") for p in (*ENGINE_PHASES, "step")} | dict(
            timers.seconds, steps=stats.num_steps
        )

    off = {} if detokenize else {"detokenize": False}  # only when asked: engines before the option still run
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **off)
    before = snapshot()
    started = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - started
    after = snapshot()
    return {k: after[k] - before[k] for k in after} | {"wall": wall}


def measure(llm: LLM, timers: Timers, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """Microseconds per decode step, medians over `args.repeats` pairs of runs."""
    steps, detokenize = args.steps, not args.no_detokenize
    run(llm, timers, prompts, 4, detokenize)  # warm-up
    samples: list[dict[str, float]] = []
    for _ in range(args.repeats):
        full, prefill = run(llm, timers, prompts, steps + 1, detokenize), run(llm, timers, prompts, 1, detokenize)
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
    parser.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the host side of a GPU step")
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
            rows.append({"batch": batch, **measure(llm, timers, prompts, args)})
        if args.profile:
            profile(llm, prompts, args.steps, args.top)
        llm.shutdown()
    columns = [("batch", "batch", "d"), ("wall", "wall µs", ".0f"), ("step", "engine µs", ".0f")]
    columns += [("engine_cpu", "engine cpu µs", ".0f")]
    columns += [(p, f"{p} µs", ".0f") for p in PHASES]
    print_table(
        f"host µs per decode step (context {args.context}, {args.steps} steps, median of {args.repeats}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}, "
        f"detokenize {'off' if args.no_detokenize else 'on'}, {args.device})",
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
