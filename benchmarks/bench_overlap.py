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

--split-sms K...: nano-batches on disjoint partitions, the layout a mixed step would take (NanoFlow): the decodes'
chain (their four linears at M = batch, attention after qkv) on a green context of K multiprocessors, the prompt
tokens' linears on another holding the rest, each captured into a graph on its own green-context stream (a node runs
where its capture stream's context does), both replayed at once; against the step as atom runs it, one chain of
linears at M = batch + prefill tokens with the decodes' attention, on the whole GPU. The two partitions come from one
split of the device's multiprocessors through the driver API (torch 2.11's green contexts each split the whole
device, so two of them share multiprocessors).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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


class Driver:
    """The few CUDA driver calls that split the multiprocessors into disjoint green contexts."""

    RESOURCE_BYTES = 144  # sizeof(CUdevResource): the same in CUDA 12.4 and 13.1's headers
    SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount
    SM_RESOURCE, GREEN_CTX_DEFAULT_STREAM, STREAM_NON_BLOCKING = 1, 1, 1

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(self.device), torch.cuda.current_device())

    def call(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            raise RuntimeError(f"{name}: CUresult {result}")

    def resource(self) -> ctypes.Array:
        return (ctypes.c_ubyte * self.RESOURCE_BYTES)()

    def sm_count(self, resource: ctypes.Array) -> int:
        return int.from_bytes(bytes(resource[self.SM_COUNT_OFFSET : self.SM_COUNT_OFFSET + 4]), "little")

    def split_streams(self, first_sms: int) -> list[tuple[torch.cuda.ExternalStream, int]]:
        """A stream on a green context of `first_sms` multiprocessors (rounded up to the architecture's granularity)
        and one on the rest, with their SM counts; the contexts live as long as the process."""
        whole, first, rest = self.resource(), self.resource(), self.resource()
        self.call("cuDeviceGetDevResource", self.device, whole, self.SM_RESOURCE)
        groups = ctypes.c_uint(1)
        self.call("cuDevSmResourceSplitByCount", first, ctypes.byref(groups), whole, rest, 0, first_sms)
        streams = []
        for part in (first, rest):
            desc, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            self.call("cuDevResourceGenerateDesc", ctypes.byref(desc), part, 1)
            self.call("cuGreenCtxCreate", ctypes.byref(context), desc, self.device, self.GREEN_CTX_DEFAULT_STREAM)
            self.call("cuGreenCtxStreamCreate", ctypes.byref(stream), context, self.STREAM_NON_BLOCKING, 0)
            streams.append((torch.cuda.ExternalStream(stream.value), self.sm_count(part)))
        return streams


def graph_on(stream: torch.cuda.Stream, calls: list) -> torch.cuda.CUDAGraph:
    """`calls` captured on `stream` (run once there first), to replay on it."""
    on(stream, calls)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    return graph


def replay_ms(pairs: list[tuple[torch.cuda.Stream, torch.cuda.CUDAGraph]]) -> float:
    """Wall time of replaying each graph on its stream, all at once."""

    def run() -> None:
        for stream, graph in pairs:
            with torch.cuda.stream(stream):
                graph.replay()
        for stream, _ in pairs:
            stream.synchronize()

    return wall_ms(run, reps=20)


def split_rows(attend: list, batch: int, layers: int, weights: dict, ms: list[int], splits: list[int]) -> list[dict]:
    """The decodes' chain and the prompt tokens' linears on disjoint partitions, against one chain on the whole GPU."""

    def chain(m: int, with_attention: bool) -> list:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=DTYPE)
        h = torch.randn(m, INTERMEDIATE, device="cuda", dtype=DTYPE)
        calls = []
        for layer in range(layers):
            for name, w in weights.items():
                calls.append(partial(torch.mm, h if name == "down" else x, w.T))
                if name == "qkv" and with_attention:
                    calls.append(attend[layer])
        return calls

    driver = Driver()
    whole = torch.cuda.Stream()
    decodes = chain(batch, True)
    rows = []
    for m in ms:
        prompts = chain(m, False)
        serial = replay_ms([(whole, graph_on(whole, chain(batch + m, True)))])
        side = torch.cuda.Stream()
        both_whole = replay_ms([(whole, graph_on(whole, decodes)), (side, graph_on(side, prompts))])
        for k in splits:
            (decode_stream, decode_sms), (prompt_stream, prompt_sms) = driver.split_streams(k)
            decode_graph, prompt_graph = graph_on(decode_stream, decodes), graph_on(prompt_stream, prompts)
            decode_ms = replay_ms([(decode_stream, decode_graph)])
            prompt_ms = replay_ms([(prompt_stream, prompt_graph)])
            split_ms = replay_ms([(decode_stream, decode_graph), (prompt_stream, prompt_graph)])
            rows.append(
                dict(
                    tokens=m,
                    decode_sms=decode_sms,
                    prompt_sms=prompt_sms,
                    serial_ms=serial,
                    two_streams_ms=both_whole,
                    decode_ms=decode_ms,
                    prompt_ms=prompt_ms,
                    split_ms=split_ms,
                    gain=1 - split_ms / serial,
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
    parser.add_argument("--split-sms", type=int, nargs="*", default=[], help="the decodes' partition sizes to try")
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
    split = split_rows(attend, args.batch, args.layers, weights, args.ms, args.split_sms) if args.split_sms else []
    if split:
        print_table(
            f"nano-batches on disjoint green contexts: the decodes' chain ({args.batch} sequences) on K "
            "multiprocessors, the prompt tokens' linears on the rest, against one chain on all (graphs, wall clock)",
            split,
            [
                ("tokens", "prefill tokens", "d"),
                ("decode_sms", "K", "d"),
                ("prompt_sms", "rest", "d"),
                ("serial_ms", "one chain ms", ".3f"),
                ("two_streams_ms", "two streams, all SMs ms", ".3f"),
                ("decode_ms", "decodes on K ms", ".3f"),
                ("prompt_ms", "prompts on rest ms", ".3f"),
                ("split_ms", "both split ms", ".3f"),
                ("gain", "vs one chain", ".0%"),
            ],
        )
    write_json(
        args.out,
        dict(
            batch=args.batch, layers=args.layers, copy_tbps=copy_tbps, rows=rows, partitioned=partitioned, split=split
        ),
    )


if __name__ == "__main__":
    main()
