"""Shared by the benchmark scripts: dummy-weight artifacts of real model shapes, copy bandwidth, timers, tables."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import triton

from atom_models.checkpoints import make_config, make_config_only
from atom_models.llama import head_dim_of
from atom_runtime.cuda_graphs import fits_short_graph, short_table_blocks
from atom_runtime.scheduler import ScheduledChunk, Scheduler

# The served max_model_len (Llama-3's) the kernel benchmarks' block tables are as wide as: a lone sequence's decode
# launch takes its splits from its table's width (`attention.decode_splits`), so the tables are those the engine's
# decode graphs pass.
SERVED_MAX_MODEL_LEN = 8192


def served_table_blocks(num_seqs: int, max_context: int, block_size: int) -> int:
    """Columns of the block table the engine's decode graph passes for this batch (the short batch-1 graph's, for a
    lone sequence that fits it)."""
    full = max(-(-SERVED_MAX_MODEL_LEN // block_size), -(-max_context // block_size))
    short = short_table_blocks(full, block_size)
    return short if short is not None and fits_short_graph(num_seqs, max_context) else full


def projections(preset: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of each distinct GEMM of a decoder layer, and the LM head; qkv and gate_up are packed."""
    c = make_config(preset)
    head_dim = head_dim_of(c)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return [
        ("qkv", q + 2 * kv, c.hidden_size),
        ("o", c.hidden_size, q),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size),
        ("down", c.hidden_size, c.intermediate_size),
        ("lm_head", c.vocab_size, c.hidden_size),
    ]


def git_commit() -> str:
    """The commit measured; the GPU host gets a copy of the tree without .git, so it passes ATOM_COMMIT, or the tree
    says its own (`branch_trees.sh` writes `.commit`: git there would name the enclosing checkout's)."""
    if os.environ.get("ATOM_COMMIT"):
        return os.environ["ATOM_COMMIT"]
    stamp = Path(__file__).resolve().parents[1] / ".commit"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


EMBEDDING = "model.embed_tokens.weight"


def step_weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Weight bytes a decode step reads: every weight once, except an untied embedding table (a step reads one row
    a token; counting it overstated Llama-3-8B's bf16 roofline by 1.05 GB, 0.35 ms on an H100)."""
    unique = {t.data_ptr(): t for t in weights.values()}
    embedding = weights.get(EMBEDDING)
    if embedding is not None and sum(t.data_ptr() == embedding.data_ptr() for t in weights.values()) == 1:
        del unique[embedding.data_ptr()]
    return sum(t.numel() * t.element_size() for t in unique.values())


# Decode batches by size: a run's ramp and tail (few sequences, the weights read for few tokens) against its body.
DECODE_BATCHES = ((1, 63), (64, 191), (192, None))


class StepTrace:
    """Each scheduled step's (time, sequences, tokens, decodes, cached keys its decodes read), taken where the engine
    schedules it: the time between two steps' scheduling is the first's (the loop runs a step a turn)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, int, int]] = []

    @classmethod
    def attach(cls, scheduler: Scheduler) -> StepTrace:
        """A trace of every step `scheduler` schedules from now on."""
        trace, schedule = cls(), scheduler.schedule

        def traced_schedule():
            plan = schedule()
            trace.record(plan.chunks)
            return plan

        scheduler.schedule = traced_schedule
        return trace

    def record(self, chunks: list[ScheduledChunk]) -> None:
        decodes = [c for c in chunks if c.num_tokens == 1 and c.samples]
        tokens = sum(c.num_tokens for c in chunks)
        self.steps.append((time.perf_counter(), len(chunks), tokens, len(decodes), sum(c.start + 1 for c in decodes)))

    def by_kind(self, weight_bytes: int, kv_token_bytes: float) -> list[dict]:
        """Seconds, steps and the memory read (weights once a step, decodes' keys) a second, by kind of step."""
        kinds: dict[str, list] = {}
        for (start, seqs, tokens, decodes, keys), (end, *_) in itertools.pairwise(self.steps):
            if not seqs:
                continue
            if decodes == 0:
                kind = "prefill"
            elif decodes < seqs:
                kind = "mixed"
            else:
                low, high = next((lo, hi) for lo, hi in DECODE_BATCHES if hi is None or seqs <= hi)
                kind = f"decode {low}-{high}" if high else f"decode {low}+"
            kinds.setdefault(kind, []).append((end - start, seqs, tokens, keys))
        total = sum(t for rows in kinds.values() for t, *_ in rows)
        table = []
        for kind, rows in kinds.items():
            seconds = sum(t for t, *_ in rows)
            read = len(rows) * weight_bytes + sum(k for *_, k in rows) * kv_token_bytes
            table.append(
                {
                    "kind": kind,
                    "steps": len(rows),
                    "seconds": seconds,
                    "share": seconds / total,
                    "seqs": sum(s for _, s, _, _ in rows) / len(rows),
                    "tokens": sum(n for _, _, n, _ in rows) / len(rows),
                    "ms_per_step": seconds / len(rows) * 1e3,
                    "read_tb_s": read / seconds / 1e12,
                }
            )
        return sorted(table, key=lambda row: row["kind"])


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def dummy_artifact(preset: str, workdir: Path, device: str, passes: str | None = None, **overrides) -> Path:
    """Export `preset` with random weights (config only, nothing on disk but the artifact)."""
    import atom_compile

    name = f"{preset}-{'default' if passes is None else passes.replace(',', '_')}"
    model_dir = make_config_only(workdir / f"{name}-config", preset, **overrides)
    artifact = workdir / f"{name}-artifact"
    started = time.perf_counter()
    atom_compile.export(model_dir, artifact, device=device, load_dummy=True, passes=passes, dtype="bfloat16")
    print(f"exported {preset} ({passes or 'default passes'}) in {time.perf_counter() - started:.1f} s")
    return artifact


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / sorted(times)[len(times) // 2]


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def capture_graph(*stream_work) -> torch.cuda.CUDAGraph:
    """One graph running each list of calls on its own stream, all forked from and joined to the capture stream (each
    call run once first, outside the capture, to compile and warm up)."""
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


def graph_ms(calls: list, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median time of one call, from replays of a CUDA graph that runs every call once."""
    return median_ms(capture_graph(calls).replay, warmup_ms, rep_ms) / len(calls)


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    print(f"\n{title}")
    print("  ".join(f"{header:>{max(len(header), 8)}}" for _, header, _ in columns))
    for row in rows:
        cells = []
        for key, header, fmt in columns:
            value = row.get(key)
            text = "-" if value is None else format(value, fmt)
            cells.append(f"{text:>{max(len(header), 8)}}")
        print("  ".join(cells))


def write_json(path: Path, payload: dict) -> None:
    payload = {"date": time.strftime("%Y-%m-%d"), "device": device_name(), "commit": git_commit(), **payload}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


@dataclass
class Server:
    base_url: str
    healthy_s: float  # from the process's start to its first healthy /health
    started: float  # time.perf_counter() at the process's start


@contextmanager
def served(model: str | Path, *flags: str, timeout_s: float = 300) -> Iterator[Server]:
    """`atom-run serve MODEL` (served as "m") on a free local port, healthy, for the duration of the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    command = [sys.executable, "-m", "atom_runtime", "serve", str(model), "--port", str(port)]  # also uninstalled
    server = subprocess.Popen([*command, "--served-model-name", "m", "--uvicorn-log-level", "warning", *flags])
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with status {server.returncode} before it was healthy")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > timeout_s:
                raise SystemExit(f"the server was not healthy after {timeout_s:.0f} s")
            time.sleep(0.2)
        yield Server(base, time.perf_counter() - started, started)
    finally:
        server.terminate()
        server.wait()
