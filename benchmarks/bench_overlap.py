"""How much of decode attention hides under prefill GEMMs when the two run on two streams.

    python benchmarks/bench_overlap.py [--batch 256] [--layers 8] [--ms 256 512 1024 2048] [--out bench_overlap.json]

The offline bf16-cache workload (Llama-3-8B, 1024 in / 1024 out) spends most of its time in two kinds of work that
load different units: decode attention reads the KV cache (HBM-bound) and the linears of prefill tokens multiply
(tensor-core bound). A step that ran one nano-batch's attention beside another's linears could hide one under the
other. This times, over `layers` Llama-3-8B layers captured in CUDA graphs: the decode attention of `batch`
sequences with contexts drawn from 1024-2048, the four linears of one layer for M tokens, both one after the
other on one stream, and both at once on two streams (fork/join inside one graph). `hidden` is the serial time
less the concurrent one, as a share of the shorter of the two.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from bench_common import copy_bandwidth, median_ms, print_table, projections, write_json
from bench_kernels import DTYPE, HEAD_DIM, paged_batch

from atom_models.ops.triton_kernels import attention

LINEARS = {name: (n, k) for name, n, k in projections("llama-3-8b") if name != "lm_head"}
HIDDEN, INTERMEDIATE = LINEARS["o"][0], LINEARS["down"][1]


def graph_of(*stream_work) -> torch.cuda.CUDAGraph:
    """One graph running each list of calls on its own stream, all forked from and joined to the capture stream."""
    for work in stream_work:
        for call in work:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    streams = [torch.cuda.Stream() for _ in stream_work[1:]]
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(main)
        for call in stream_work[0]:
            call()
        for stream, work in zip(streams, stream_work[1:], strict=True):
            with torch.cuda.stream(stream):
                for call in work:
                    call()
        for stream in streams:
            main.wait_stream(stream)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="decoding sequences")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ms", type=int, nargs="+", default=[256, 512, 1024, 2048], help="prefill tokens")
    parser.add_argument("--out", type=Path, default=Path("bench_overlap.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap needs a CUDA device")
    torch.manual_seed(0)
    copy_tbps = copy_bandwidth() / 1e12
    contexts = torch.randint(1024, 2049, (args.batch,)).tolist()
    kv_bytes = sum(contexts) * 8 * HEAD_DIM * 2 * 2
    config = attention.default_config(HEAD_DIM)
    batches = [paged_batch([1] * args.batch, contexts) for _ in range(args.layers)]
    attend = [partial(attention.run_paged_attention, *b, HEAD_DIM**-0.5, config) for b in batches]  # a cache a layer
    weights = {name: torch.randn(shape, device="cuda", dtype=DTYPE) * 0.02 for name, shape in LINEARS.items()}
    attn_ms = median_ms(graph_of(attend).replay)
    rows = []
    for m in args.ms:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=DTYPE)
        h = torch.randn(m, INTERMEDIATE, device="cuda", dtype=DTYPE)
        layer = [partial(torch.mm, h if name == "down" else x, w.T) for name, w in weights.items()]
        linears = layer * args.layers
        gemm_ms = median_ms(graph_of(linears).replay)
        serial_ms = median_ms(graph_of(attend + linears).replay)
        both_ms = median_ms(graph_of(attend, linears).replay)
        flops = 2 * m * sum(n * k for n, k in LINEARS.values()) * args.layers
        rows.append(
            dict(
                tokens=m,
                attention_ms=attn_ms,
                attention_tbps=kv_bytes * args.layers / attn_ms / 1e9,
                gemm_ms=gemm_ms,
                gemm_tflops=flops / gemm_ms / 1e9,
                serial_ms=serial_ms,
                concurrent_ms=both_ms,
                hidden=(serial_ms - both_ms) / min(attn_ms, gemm_ms),
            )
        )
    print_table(
        f"decode attention (batch {args.batch}, contexts 1024-2048) beside prefill linears, {args.layers} "
        f"Llama-3-8B layers, {torch.cuda.get_device_name()}, copy {copy_tbps:.2f} TB/s",
        rows,
        [
            ("tokens", "prefill tokens", "d"),
            ("attention_ms", "attention ms", ".3f"),
            ("attention_tbps", "TB/s", ".2f"),
            ("gemm_ms", "linears ms", ".3f"),
            ("gemm_tflops", "TFLOP/s", ".0f"),
            ("serial_ms", "serial ms", ".3f"),
            ("concurrent_ms", "two streams ms", ".3f"),
            ("hidden", "hidden", ".0%"),
        ],
    )
    write_json(args.out, dict(batch=args.batch, layers=args.layers, copy_tbps=copy_tbps, rows=rows))


if __name__ == "__main__":
    main()
