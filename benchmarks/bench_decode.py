"""Decode ms/step against the weight-read roofline (weight bytes ÷ copy bandwidth measured in the same run).

    python benchmarks/bench_decode.py --preset qwen3-0.6b --batch-sizes 1 8 64 256 --context 400
    python benchmarks/bench_decode.py --preset llama-3-8b --batch-sizes 1 8 64 256
    python benchmarks/bench_decode.py --artifact A --batch-sizes 1 --context 400 1536 --max-model-len 8192

Exports the preset with random weights, then for each context and batch size streams `context`-token prompts
through the engine and reports two times per decode step: `engine` (the whole step once every
sequence decodes, scheduling, sampling and the outputs' delivery included; see `timed_decode`)
and `graph` (replaying the step's CUDA graph alone at the timed steps' mean context, timed with
CUDA events): `engine - graph` is what host work and the per-step extras around the graph add.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import product
from pathlib import Path

import torch
import uvloop
from bench_common import copy_bandwidth, device_name, dummy_artifact, print_table, step_weight_bytes, write_json

from atom_runtime import LLM, SamplingParams
from atom_runtime.config import KV_CACHE_DTYPES, EngineConfig
from atom_runtime.cuda_graphs import GraphKey
from atom_runtime.scheduler import ScheduledChunk
from atom_runtime.sequence import Sequence

PHASES = ("schedule", "launch", "wait", "finish")
REPLAY_ROOM = 128  # tokens a sequence's timed graph replays may move on (each one's draw advances the inputs)


def head_start_steps(num_prompts: int, context: int, budget: int) -> int:
    """Steps the request prefilled first may decode before the last one has its first token: prefilling
    `num_prompts` prompts of `context` tokens at `budget` tokens a step, doubled, since the decodes of the requests
    already started share each step's budget (a 1/8/64/256 sweep at context 400 once ran a request out early)."""
    return 2 * (-(-num_prompts * context // budget) + 1)


def timed_decode(
    llm: LLM,
    prompts: list[list[int]],
    steps: int,
    on_mark: Callable[[str], None] | None = None,
    temperature: float = 0.0,
) -> tuple[float, dict[str, float]]:
    """Seconds per decode step while every sequence decodes, and the engine's seconds per step in each phase.

    Every request streams, and asks for enough tokens to outlast the prefill of the others. Once the
    request prefilled last has its first token, each step is a decode step of the whole batch: the next
    `steps` of them are timed (the outputs' arrival on the event loop, so host work on both threads
    counts) and the engine's phase times read before and after; then every request is dropped (aborted),
    so no step of a shrinking batch is timed. `on_mark("start")` and `on_mark("end")` are called at both ends.
    """
    if steps < 1:
        raise ValueError(f"time at least one decode step, got {steps}")
    slack = head_start_steps(len(prompts), max(map(len, prompts)), llm.engine.core.config.max_num_batched_tokens)
    params = SamplingParams(temperature=temperature, max_tokens=steps + slack + 1, ignore_eos=True)
    stats = llm.engine.core.stats
    num_started = 0  # requests that have their first token
    marks: dict[str, tuple[float, int, dict[str, float]]] = {}
    arrivals: list[float] = []  # the timed request's outputs after the start mark

    def mark(name: str, tokens: int) -> None:
        marks[name] = (time.perf_counter(), tokens, {p: getattr(stats, f"{p}_time_s") for p in PHASES})
        if on_mark is not None:
            on_mark(name)

    async def one(ids: list[int]) -> None:
        nonlocal num_started
        tokens, last_to_start = 0, False
        async with contextlib.aclosing(llm.engine.generate(None, params, prompt_token_ids=ids)) as outputs:
            async for output in outputs:
                if "end" in marks:
                    return  # closing the stream aborts the request
                if not tokens:
                    num_started += 1
                    last_to_start = num_started == len(prompts)
                tokens = len(output.outputs[0].token_ids)
                if not last_to_start:
                    continue
                if "start" not in marks:
                    mark("start", tokens)
                    continue
                arrivals.append(time.perf_counter())
                if tokens - marks["start"][1] >= steps:
                    mark("end", tokens)
                    return
        raise RuntimeError("a request finished before the timed steps ended: too few max_tokens")

    async def run_all() -> None:
        await asyncio.gather(*(one(ids) for ids in prompts))

    uvloop.run(run_all())  # the event loop `LLM` and the server use
    (t0, n0, phases0), (t1, n1, phases1) = marks["start"], marks["end"]
    measured = n1 - n0
    gaps = sorted(b - a for a, b in zip([t0, *arrivals], arrivals, strict=False))
    phases = {p: (phases1[p] - phases0[p]) / measured for p in PHASES}
    # Steps are even unless something stalls now and then (a median far below the mean says so).
    phases |= {"median_step": gaps[len(gaps) // 2], "slowest_step": gaps[-1]}
    return (t1 - t0) / measured, phases


def profile_step(llm: LLM, batch: int, out: Path) -> None:
    """Kernel time of one eager decode step (outside the graph), top kernels to a text file."""
    runner = llm.engine.core.runner
    args = runner._step_args(*runner.inputs.load([], pad_seqs_to=batch))
    with torch.inference_mode():
        for _ in range(3):
            runner.model.forward(*args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.model.forward(*args)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    out.write_text(table)
    print(f"\neager decode step, batch {batch}, 5 steps:\n{table}")


def profile_engine(llm: LLM, prompts: list[list[int]], steps: int, out: Path) -> dict:
    """Where an engine step's wall time goes: GPU busy time (kernels and copies) against idle gaps.

    A trace of the decode steps `timed_decode` times (prefill left out); the GPU's busy intervals are
    merged, and the gaps between them are where the device waited for the host. The host side's time
    by op goes to `OUT.host.txt` (what a launch spends its time on).
    """
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=activities)
    timed_decode(llm, prompts, steps, on_mark=lambda name: prof.start() if name == "start" else prof.stop())
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    out.with_suffix(".host.txt").write_text(host)
    # CUDA API calls and kernels of every thread; CPU ops only of the event-loop thread, which started the profiler
    print(f"\nhost time of {steps} engine steps, by op:\n{host}")
    trace = out.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    if not gpu:
        return {}
    busy, gaps, end = 0.0, [], gpu[0][0]
    for start, stop, name in gpu:
        if start > end:
            gaps.append((start - end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    wall = end - gpu[0][0]
    gaps.sort(reverse=True)
    by_name: dict[str, list[float]] = {}  # name -> [calls, µs]: the graph's kernels and what runs around it
    for start, stop, name in gpu:
        entry = by_name.setdefault(name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:16]
    summary = {
        "steps": steps,
        "gpu_span_ms_per_step": wall / steps / 1e3,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (wall - busy) / steps / 1e3,
        "gaps_over_20us_per_step": sum(1 for g, _ in gaps if g > 20) / steps,
        "largest_gaps_us_before": [[round(g, 1), name[:60]] for g, name in gaps[:8]],
        "gpu_calls_and_us_per_step": [[name, round(c / steps, 2), round(us / steps, 1)] for name, (c, us) in top],
    }
    print(f"\nengine trace, batch {len(prompts)}: " + json.dumps(summary, indent=1))
    return summary


@contextlib.contextmanager
def decode_graph_inputs(llm: LLM, batch: int, context: int, replays: int) -> Iterator[GraphKey | None]:
    """Load the runner's inputs for a decode step of `batch` sequences for `replays` replays of the graph the engine
    would pick for it (its key; None if no graph of that size), at the last replay's context: a short graph only if
    every replay fits it.

    Each replay's draw moves the inputs a token on (`sample_rows`' `advance`), as decoding does: the sequences start
    `replays // 2` tokens short of `context`, so the replays' contexts centre on it. Their KV-cache blocks are
    allocated (random content) for REPLAY_ROOM tokens more and freed on exit.
    """
    if replays > REPLAY_ROOM:
        raise ValueError(f"at most {REPLAY_ROOM} replays a load, got {replays}")
    context = max(1, context - replays // 2)
    core = llm.engine.core
    runner, blocks = core.runner, core.block_manager
    seqs = [Sequence(f"graph-{i}", 0, [0] * (context + REPLAY_ROOM), SamplingParams()) for i in range(batch)]
    try:
        for seq in seqs:
            if not blocks.allocate(seq, context + REPLAY_ROOM):
                raise RuntimeError(f"the KV cache cannot hold {batch} sequences of {context} tokens")
            del seq.token_ids[context:]  # the room stays allocated
        chunks = [ScheduledChunk(s, context - 1, 1) for s in seqs]  # each samples its last token, as decodes do
        end = context + replays - 1  # the last replay's context
        last = [ScheduledChunk(Sequence(f"last-{i}", 0, [0] * end, SamplingParams()), end - 1, 1) for i in range(batch)]
        key = runner.graphs.key_for(last) if runner.graphs is not None else None
        if key is not None and key.size != batch:  # a larger graph's padding: not the one asked for
            key = None
        if key is not None:
            runner.inputs.load(chunks, pad_seqs_to=batch)
        yield key
    finally:
        for seq in seqs:
            blocks.free(seq)


def graph_step_ms(llm: LLM, batch: int, context: int, reps: int = 50) -> float | None:
    """Replay time of the batch-`batch` decode graph, its sequences' contexts centred on `context` tokens.

    The GPU time an engine step at that context cannot go below (its KV-cache reads included).
    """
    graphs = llm.engine.core.runner.graphs
    with decode_graph_inputs(llm, batch, context, 5 + reps) as key:
        if key is None:
            return None
        for _ in range(5):
            graphs.replay(key)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graphs.replay(key)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / reps


def critical_path(replays: list[list[tuple[float, float, str]]]) -> dict:
    """Per kernel (name and grid, see `activity_name`), what it adds to a replay's span: the step's critical path.

    `replays`: each replay's GPU activities as (start, end, name), in µs. Kernels launch with PDL, so a
    kernel starts early and its duration includes its wait for the one before: durations overcount. Each
    kernel is credited instead with how far it pushes the replay's end, `end_i - max(end_<i, first start)`
    (never below 0), so the credits of a replay sum to its span, first start to last end.
    """
    totals: dict[str, list[float]] = {}  # name -> [calls, increment, duration]
    span = 0.0
    for kernels in replays:
        kernels = sorted(kernels)
        reached = kernels[0][0]
        for start, end, name in kernels:
            entry = totals.setdefault(name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += max(0.0, end - reached)
            entry[2] += end - start
            reached = max(reached, end)
        span += reached - kernels[0][0]
    n = len(replays)
    rows = [
        {
            "name": name,
            "calls_per_step": calls / n,
            "incremental_us_per_step": increment / n,
            "duration_us_per_step": duration / n,
            "share_of_step": increment / span if span else 0.0,
        }
        for name, (calls, increment, duration) in totals.items()
    ]
    rows.sort(key=lambda r: -r["incremental_us_per_step"])
    return {
        "replays": n,
        "kernels_per_step": sum(r["calls_per_step"] for r in rows),
        "span_us_per_step": span / n,
        "duration_us_per_step": sum(r["duration_us_per_step"] for r in rows),
        "kernels": rows,
    }


def format_critical_path(profile: dict) -> str:
    lines = [f"{'kernel':<60}  {'calls':>6}  {'incr us':>8}  {'dur us':>8}  {'share':>6}"]
    for r in profile["kernels"]:
        lines.append(
            f"{r['name'][:60]:<60}  {r['calls_per_step']:>6.1f}  {r['incremental_us_per_step']:>8.2f}  "
            f"{r['duration_us_per_step']:>8.2f}  {r['share_of_step']:>6.1%}"
        )
    lines.append(
        f"{'total (span of a replay)':<60}  {profile['kernels_per_step']:>6.1f}  {profile['span_us_per_step']:>8.2f}  "
        f"{profile['duration_us_per_step']:>8.2f}  {1:>6.1%}"
    )
    return "\n".join(lines)


def activity_name(event: dict) -> str:
    """A kernel's name with its grid, which tells apart launches of one kernel (each projection's GEMV)."""
    grid = event.get("args", {}).get("grid")
    return f"{event['name'][:42]} grid {'x'.join(map(str, grid))}" if grid else event["name"]  # fits 60


def split_replays(events: list[dict], reps: int) -> list[list[tuple[float, float, str]]] | str:
    """A chrome trace's GPU activities as `reps` replays of (start, end, name), or why they are not."""
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], activity_name(e))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    if not gpu:
        return "CUPTI reported no kernels inside the graph replays"
    # Replays run back to back on one stream, each the same kernel sequence: split the sorted list evenly.
    per = len(gpu) // reps
    replays = [gpu[i * per : (i + 1) * per] for i in range(reps)]
    if len(gpu) % reps or any([n for *_, n in r] != [n for *_, n in replays[0]] for r in replays):
        return f"the trace of {reps} replays held {len(gpu)} GPU activities, not {reps} equal sequences"
    return replays


def profile_graph(llm: LLM, batch: int, context: int, out: Path, reps: int = 20) -> dict:
    """Where a decode graph replay's time goes, by kernel on the critical path (see `critical_path`).

    The eager profile (`profile_step`) runs outside the graph, and its PDL kernels' durations include
    their waits; this traces `reps` replays of the batch-`batch` graph at `context` tokens (the GPU
    time of a real step) and writes the table to `out`.
    """
    graphs = llm.engine.core.runner.graphs
    with decode_graph_inputs(llm, batch, context, 5 + reps) as key:
        if key is None:
            return {"error": f"no decode graph of batch {batch}"}
        for _ in range(5):
            graphs.replay(key)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graphs.replay(key)
            torch.cuda.synchronize()
    trace = out.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    replays = split_replays(json.loads(trace.read_text())["traceEvents"], reps)
    trace.unlink()
    if isinstance(replays, str):
        print(f"\ngraph replay profile, batch {batch}: {replays}")
        out.write_text(replays + "\n")
        return {"error": replays}
    result = {"batch": batch, "context": context} | critical_path(replays)
    title = f"decode graph replay, batch {batch}, context {context}, {reps} replays, per step:"
    table = format_critical_path(result)
    out.write_text(f"{title}\n{table}\n")
    print(f"\n{title}\n{table}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--artifact", type=Path, default=None, help="use this artifact instead of exporting")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument(
        "--context", type=int, nargs="+", default=[400], help="prompt tokens per sequence (each, one engine)"
    )
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of the timed requests (0: greedy)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (default: what the timed steps need); larger means longer block-table rows",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile an eager step and the decode graph's replays at the smallest batch, "
        "and trace the engine at the smallest and the largest batch (at the first context)",
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    needed = (
        max(args.context)
        + args.steps
        + head_start_steps(max(args.batch_sizes), max(args.context), EngineConfig().max_num_batched_tokens)
        + 16
        + REPLAY_ROOM  # the graph replays' (`decode_graph_inputs`)
    )
    if args.max_model_len is not None and args.max_model_len < needed:
        parser.error(f"--max-model-len must be at least {needed} for this context and step count")

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or dummy_artifact(args.preset, Path(tmp), "cuda")
        llm = LLM(
            artifact,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.max_model_len or needed,
            enable_prefix_caching=False,
            cudagraph_capture_sizes=args.batch_sizes,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        config = llm.engine.core.runner.model.config
        weights = llm.engine.core.runner.model.forward.weights
        weight_bytes = step_weight_bytes(weights)
        bandwidth = copy_bandwidth()
        runner = llm.engine.core.runner
        kv_token_bytes = runner.block_bytes / runner.block_size  # K and V of every layer (and any inline scales)
        generator = torch.Generator().manual_seed(0)
        rows = []
        for context, batch in product(args.context, args.batch_sizes):
            prompts = torch.randint(0, config.vocab_size, (batch, context), generator=generator).tolist()
            timed_decode(llm, prompts, 4, temperature=args.temperature)  # warm-up
            skipped = runner.inputs.skipped_uploads
            step_s, phase_s = timed_decode(llm, prompts, args.steps, temperature=args.temperature)
            skipped = runner.inputs.skipped_uploads - skipped  # steps that found their inputs on the device
            engine_ms = step_s * 1e3
            phases = {f"{p}_ms": seconds * 1e3 for p, seconds in phase_s.items()}
            kv_bytes = batch * (context + args.steps // 2) * kv_token_bytes
            roofline_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
            rows.append(
                {
                    "context": context,
                    "batch": batch,
                    "engine_ms": engine_ms,
                    "graph_ms": graph_step_ms(llm, batch, context + args.steps // 2),
                    "roofline_ms": roofline_ms,
                    "weights_only_roofline_ms": weight_bytes / bandwidth * 1e3,
                    "fraction_of_roofline": roofline_ms / engine_ms,
                    "tokens_per_s": batch / engine_ms * 1e3,
                    "uploads_skipped": skipped,
                    **phases,
                }
            )
        trace = graph_profile = None
        if args.profile:
            profile_step(llm, min(args.batch_sizes), args.out.with_suffix(".profile.txt"))
            graph_profile = profile_graph(
                llm,
                min(args.batch_sizes),
                args.context[0] + args.steps // 2,
                args.out.with_name(f"{args.out.stem}-graph.txt"),
            )
            trace = {}
            for batch in sorted({min(args.batch_sizes), max(args.batch_sizes)}):
                prompts = torch.randint(0, config.vocab_size, (batch, args.context[0]), generator=generator).tolist()
                trace[batch] = profile_engine(llm, prompts, 32, args.out.with_name(f"{args.out.stem}-b{batch}"))
        llm.shutdown()
    manifest = llm.engine.core.runner.model.forward.manifest
    scheme = (manifest["quantization"] or {}).get("method") or manifest["dtype"]
    model_name = Path(args.artifact).name if args.artifact else args.preset
    print_table(
        f"decode, {model_name}, {scheme}, {device_name()}, copy {bandwidth / 1e12:.2f} TB/s, "
        f"weights {weight_bytes / 1e9:.2f} GB",
        rows,
        [
            ("context", "context", "d"),
            ("batch", "batch", "d"),
            ("engine_ms", "engine ms", ".3f"),
            ("median_step_ms", "median ms", ".3f"),
            ("graph_ms", "graph ms", ".3f"),
            ("roofline_ms", "roofline ms", ".3f"),
            ("fraction_of_roofline", "of roofline", ".2f"),
            ("tokens_per_s", "tok/s", ".0f"),
            ("launch_ms", "launch ms", ".3f"),
            ("wait_ms", "wait ms", ".3f"),
            ("uploads_skipped", "no copy", "d"),
        ],
    )
    write_json(
        args.out,
        {
            "preset": None if args.artifact else args.preset,  # the preset is exported only without --artifact
            "artifact": str(args.artifact) if args.artifact else None,
            "context": args.context,
            "temperature": args.temperature,
            "copy_bandwidth": bandwidth,
            "weight_bytes": weight_bytes,
            "rows": rows,
            "engine_trace": trace,
            "graph_profile": graph_profile,
        },
    )


if __name__ == "__main__":
    main()
