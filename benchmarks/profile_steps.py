"""Where an engine step's device time goes in the steady state of an offline workload: each kernel's time a step.

    python benchmarks/profile_steps.py --artifact A --max-num-batched-tokens 512 --warm-steps 350
    python benchmarks/profile_steps.py --artifact A --num-prompts 256 --warm-steps 400   # decode-only steps

The engine's own core (`create_core`, no HTTP, no detokenization) takes `--num-prompts` requests of `--input-len`
random tokens and `--output-len` tokens to generate, steps `--warm-steps` times, then times `--timed-steps` steps
(wall time, the engine overlapping host and GPU as it does when serving) and profiles `--profiled-steps` more under
torch.profiler: each CUDA kernel's device time a step, largest first (on a CPU: each op's own CPU time). Also what
the steps held: sequences, tokens (prefill tokens ride along in mixed steps), the context their decodes read, and that
context's KV bytes over the attention kernels' wall time a step (tiles and decodes overlap); and the host's phases a
step (launch: preparing and queueing it, wait: blocked on the device), with `--host-profile` a cProfile of the timed
steps, with `--trace` the profiled steps' Chrome trace (which kernels ran side by side, on which streams).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import pstats
import time
from pathlib import Path

import torch
from bench_common import StepTrace, device_name, print_table, write_json

from atom_models.llama import head_dim_of
from atom_runtime.config import CUDAGRAPH_MODES, EngineConfig
from atom_runtime.loading import create_core
from atom_runtime.sampling_params import SamplingParams

# The host's phases a step (`EngineStats`): a step that waits little for the device is bound by the host.
PHASES = ("schedule", "launch", "wait", "finish")


def covered_us(intervals) -> float:
    """Microseconds covered by the union of `intervals` (each with .start and .end)."""
    covered, end = 0.0, float("-inf")
    for interval in sorted(intervals, key=lambda i: i.start):
        covered += max(0.0, interval.end - max(interval.start, end))
        end = max(end, interval.end)
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--cudagraph-mode", default=EngineConfig.cudagraph_mode, choices=CUDAGRAPH_MODES)
    parser.add_argument("--warm-steps", type=int, default=350)
    parser.add_argument("--timed-steps", type=int, default=40)
    parser.add_argument("--profiled-steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=15, help="kernels listed")
    parser.add_argument("--host-profile", action="store_true", help="also where the timed steps' host time goes")
    parser.add_argument("--trace", type=Path, help="also write the profiled steps' Chrome trace")
    parser.add_argument("--out", type=Path, default=Path("profile_steps.json"))
    args = parser.parse_args()

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 1,
        cudagraph_mode=args.cudagraph_mode,
    )
    core, _ = create_core(args.artifact, config=config)
    cuda = core.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    activity, device_type = (
        (torch.profiler.ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA)
        if cuda
        else (torch.profiler.ProfilerActivity.CPU, torch.autograd.DeviceType.CPU)
    )
    model = core.runner.model.config
    kv_bytes = 2 * model.num_hidden_layers * model.num_key_value_heads * head_dim_of(model)
    kv_bytes *= core.runner.kv_caches[0].element_size()
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = torch.randint(0, model.vocab_size, (args.input_len,), generator=generator).tolist()
        core.add_request(str(i), prompt, params)
    steps = StepTrace.attach(core.scheduler)
    for _ in range(args.warm_steps):
        core.step()
    sync()
    before = dataclasses.replace(core.stats)
    host = cProfile.Profile() if args.host_profile else None
    started = time.perf_counter()
    with host or contextlib.nullcontext():
        for _ in range(args.timed_steps):
            core.step()
        sync()
    wall_ms = (time.perf_counter() - started) / args.timed_steps * 1e3
    spent = {phase: getattr(core.stats, f"{phase}_time_s") - getattr(before, f"{phase}_time_s") for phase in PHASES}
    phases = {f"{phase}_ms": seconds / args.timed_steps * 1e3 for phase, seconds in spent.items()}
    with torch.profiler.profile(activities=[activity]) as profile:
        for _ in range(args.profiled_steps):
            core.step()
        sync()
    if args.trace:
        profile.export_chrome_trace(str(args.trace))
    profiled = steps.steps[-args.profiled_steps :]
    n = args.profiled_steps

    def own_us(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    kernels = [
        {"kernel": e.key, "ms": own_us(e) / n / 1e3, "launches": e.count / n}
        for e in profile.key_averages()
        if e.device_type == device_type and own_us(e) > 0
    ]
    kernels.sort(key=lambda k: -k["ms"])
    # Wall time, not the kernels' sum: a step's prefill tiles run beside its decode programs, and a tile launch
    # stretched over the decodes' tail would count twice (a FULL graph's step: 8.42 ms summed, 6.94 ms of wall).
    attention = [e.time_range for e in profile.events() if e.device_type == device_type and "attention" in e.name]
    attention_ms = covered_us(attention) / n / 1e3
    context = sum(keys for *_, keys in profiled) / n
    summary = {
        "wall_ms": wall_ms,
        **phases,
        "kernel_ms": sum(k["ms"] for k in kernels),
        "seqs": sum(seqs for _, seqs, *_ in profiled) / n,
        "tokens": sum(tokens for _, _, tokens, *_ in profiled) / n,
        "decode_context": context,
        "attention_ms": attention_ms,
        "kv_tb_s": context * kv_bytes / (attention_ms * 1e-3) / 1e12 if attention_ms else None,
        "preemptions": core.scheduler.num_preemptions,
    }
    title = f"{args.artifact.name}: steps {args.warm_steps + 1}-{len(steps.steps)}, {device_name()}"
    print_table(
        title,
        [summary],
        [
            ("wall_ms", "wall ms/step", ".2f"),
            ("launch_ms", "launch", ".2f"),
            ("wait_ms", "wait", ".2f"),
            ("finish_ms", "finish", ".2f"),
            ("kernel_ms", "kernels ms", ".2f"),
            ("seqs", "seqs", ".1f"),
            ("tokens", "tokens", ".1f"),
            ("decode_context", "decode ctx", ".0f"),
            ("attention_ms", "attention ms", ".3f"),
            ("kv_tb_s", "KV TB/s", ".2f"),
            ("preemptions", "preempt", "d"),
        ],
    )
    print_table(
        "kernels, device time a step",
        kernels[: args.top],
        [("ms", "ms", ".3f"), ("launches", "launches", ".1f"), ("kernel", "kernel", "")],
    )
    if host is not None:
        print(f"\nthe host's time over the {args.timed_steps} timed steps (cProfile): own time, then with callees")
        for order in ("tottime", "cumulative"):
            pstats.Stats(host).sort_stats(order).print_stats(args.top * 2)
    run_args = vars(args) | {"artifact": str(args.artifact), "out": str(args.out)}
    write_json(args.out, {"args": run_args, **summary, "kernels": kernels})


if __name__ == "__main__":
    main()
