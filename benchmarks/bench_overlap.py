"""How much of decode attention hides under prefill GEMMs when the two run on two streams.

    python benchmarks/bench_overlap.py [--batch 256] [--layers 8] [--ms 256 512 1024 2048] [--attention-sms 32 64]

The offline bf16-cache workload (Llama-3-8B, 1024 in / 1024 out) spends most of its time in two kinds of work that
load different units: decode attention reads the KV cache (HBM-bound) and the linears of prefill tokens multiply
(tensor-core bound). A step that ran one nano-batch's attention beside another's linears could hide one under the
other. This times, over `layers` Llama-3-8B layers captured in CUDA graphs: the decode attention of `batch`
sequences with contexts drawn from 1024-2048, the four linears of one layer for M tokens, both one after the
other on one stream, and both at once on two streams (fork/join inside one graph). `hidden` is the serial time
less the concurrent one, as a share of the shorter of the two.

--gemm-sms N...: also with the linears confined to N multiprocessors (cuBLAS's SM count target, through torch's
experimental SM carveout, fixed in the graph at capture), so that attention's blocks find the rest free. With torch
2.11 only cuBLASLt honours it: pass `--blas cublaslt`.

--attention-sms N...: also with attention confined to a green context of N multiprocessors (torch.cuda.green_contexts;
the linears keep the whole GPU, so they can still take the free ones), launched eagerly (green-context streams are
not captured), timed by the wall clock around both streams' work.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from functools import partial
from pathlib import Path

import torch
from bench_common import capture_graph, copy_bandwidth, median_ms, print_table, projections, write_json
from bench_kernels import DTYPE, HEAD_DIM, paged_batch

from atom_models.ops.triton_kernels import attention

LINEARS = {name: (n, k) for name, n, k in projections("llama-3-8b") if name != "lm_head"}
HIDDEN, INTERMEDIATE = LINEARS["o"][0], LINEARS["down"][1]


def wall_ms(run, reps: int = 10) -> float:
    """Median wall time of `run()` (which synchronizes what it launched), after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return sorted(times)[reps // 2] * 1e3


def on(stream: torch.cuda.Stream, calls: list) -> None:
    with torch.cuda.stream(stream):
        for call in calls:
            call()


@contextlib.contextmanager
def gemm_sms(n: int | None):
    """cuBLAS launches (and graphs capture) its GEMMs on `n` multiprocessors; None: all of them."""
    total = torch.cuda.get_device_properties(0).multi_processor_count
    torch._C._set_sm_carveout_experimental(None if n is None else total - n)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def partitioned_rows(attend: list, linears_by_m: dict[int, list], sms: list[int]) -> list[dict]:
    """Attention on a green context of n multiprocessors beside the linears on the whole GPU, eagerly."""
    from torch.cuda.green_contexts import GreenContext

    side = torch.cuda.Stream()
    full_attention = wall_ms(lambda: (on(side, attend), side.synchronize()))
    rows = []
    for n in sms:
        context = GreenContext.create(num_sms=n, device_id=0)  # alive while its stream is used
        green = context.Stream()
        confined = wall_ms(lambda g=green: (on(g, attend), g.synchronize()))
        for m, linears in linears_by_m.items():
            gemm = wall_ms(lambda ls=linears: (on(side, ls), side.synchronize()))

            def both(g=green, ls=linears) -> None:
                on(g, attend)
                on(side, ls)
                g.synchronize()
                side.synchronize()

            together = wall_ms(both)
            rows.append(
                dict(
                    attention_sms=n,
                    tokens=m,
                    attention_ms=full_attention,
                    confined_ms=confined,
                    gemm_ms=gemm,
                    concurrent_ms=together,
                    hidden=(full_attention + gemm - together) / min(full_attention, gemm),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="decoding sequences")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ms", type=int, nargs="+", default=[256, 512, 1024, 2048], help="prefill tokens")
    parser.add_argument("--gemm-sms", type=int, nargs="*", default=[], help="SM count targets of the linears")
    parser.add_argument("--blas", choices=["cublas", "cublaslt"], help="torch's preferred BLAS library")
    parser.add_argument("--attention-sms", type=int, nargs="*", default=[], help="green-context sizes to try")
    parser.add_argument("--out", type=Path, default=Path("bench_overlap.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap needs a CUDA device")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if any(not 0 < n < sms for n in args.gemm_sms):
        parser.error(f"--gemm-sms: between 1 and {sms - 1} (this GPU has {sms} multiprocessors)")
    torch.manual_seed(0)
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    copy_tbps = copy_bandwidth() / 1e12
    contexts = torch.randint(1024, 2049, (args.batch,)).tolist()
    kv_bytes = sum(contexts) * 8 * HEAD_DIM * 2 * 2
    config = attention.default_config(HEAD_DIM)
    batches = [paged_batch([1] * args.batch, contexts) for _ in range(args.layers)]
    attend = [partial(attention.run_paged_attention, *b, HEAD_DIM**-0.5, config) for b in batches]  # a cache a layer
    weights = {name: torch.randn(shape, device="cuda", dtype=DTYPE) * 0.02 for name, shape in LINEARS.items()}
    attn_ms = median_ms(capture_graph(attend).replay)
    rows, linears_by_m = [], {}
    for m, gemm in ((m, gemm) for m in args.ms for gemm in [None, *args.gemm_sms]):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=DTYPE)
        h = torch.randn(m, INTERMEDIATE, device="cuda", dtype=DTYPE)
        layer = [partial(torch.mm, h if name == "down" else x, w.T) for name, w in weights.items()]
        linears = layer * args.layers
        if gemm is None:
            linears_by_m[m] = linears
        with gemm_sms(gemm):
            gemm_ms = median_ms(capture_graph(linears).replay)
            serial_ms = median_ms(capture_graph(attend + linears).replay)
            both_ms = median_ms(capture_graph(attend, linears).replay)
        flops = 2 * m * sum(n * k for n, k in LINEARS.values()) * args.layers
        rows.append(
            dict(
                tokens=m,
                gemm_sms=gemm or sms,
                attention_ms=attn_ms,
                attention_tbps=kv_bytes * args.layers / attn_ms / 1e9,
                gemm_ms=gemm_ms,
                gemm_tflops=flops / gemm_ms / 1e9,
                serial_ms=serial_ms,
                concurrent_ms=both_ms,
                hidden=(serial_ms - both_ms) / min(attn_ms, gemm_ms),
            )
        )
    for row in rows:  # against both one after the other at full width: what the confinement buys in all
        full = next(r for r in rows if r["tokens"] == row["tokens"])
        row["gain"] = 1 - row["concurrent_ms"] / full["serial_ms"]
    print_table(
        f"decode attention (batch {args.batch}, contexts 1024-2048) beside prefill linears, {args.layers} "
        f"Llama-3-8B layers, {torch.cuda.get_device_name()}, copy {copy_tbps:.2f} TB/s",
        rows,
        [
            ("tokens", "prefill tokens", "d"),
            ("gemm_sms", "linears' SMs", "d"),
            ("attention_ms", "attention ms", ".3f"),
            ("attention_tbps", "TB/s", ".2f"),
            ("gemm_ms", "linears ms", ".3f"),
            ("gemm_tflops", "TFLOP/s", ".0f"),
            ("serial_ms", "serial ms", ".3f"),
            ("concurrent_ms", "two streams ms", ".3f"),
            ("hidden", "hidden", ".0%"),
            ("gain", "vs serial, all SMs", ".0%"),
        ],
    )
    partitioned = partitioned_rows(attend, linears_by_m, args.attention_sms) if args.attention_sms else []
    if partitioned:
        print_table(
            "attention on a green context of N multiprocessors, the linears on the whole GPU (eager, wall clock)",
            partitioned,
            [
                ("attention_sms", "N", "d"),
                ("tokens", "prefill tokens", "d"),
                ("attention_ms", "attention ms", ".3f"),
                ("confined_ms", "on N ms", ".3f"),
                ("gemm_ms", "linears ms", ".3f"),
                ("concurrent_ms", "together ms", ".3f"),
                ("hidden", "hidden", ".0%"),
            ],
        )
    write_json(
        args.out,
        dict(batch=args.batch, layers=args.layers, copy_tbps=copy_tbps, rows=rows, partitioned=partitioned),
    )


if __name__ == "__main__":
    main()
