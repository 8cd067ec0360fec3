"""Does HTTP and tokenization work slow the engine's step loop? Step time with and without an HTTP flood.

    python benchmarks/bench_engine_isolation.py --model ARTIFACT/     # on a GPU host
    python benchmarks/bench_engine_isolation.py                       # tiny random model (smoke test)

On a 2-core CPU machine the model, the server and the load all share the cores, so only a GPU
host gives meaningful numbers.

Starts `atom-run serve`, then runs the same decode load twice: alone ("quiet"), and while other
clients flood the server with requests that cost HTTP parsing, tokenization of long prompts and
validation but no GPU work (prompts over the context limit, rejected with 400), plus /metrics and
/v1/models polls ("busy"). Reports the engine's mean step time (from /metrics) and the decode
inter-token latency of the load in both phases.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from bench_common import served, write_json


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M))


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """Time to the first streamed chunk of one greedy completion, and the gaps between chunks after it."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,  # a chunk for every token, even one whose text is held back
    }
    gaps, last, first, started = [], None, float("nan"), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                else:
                    first = now - started
                last = now
    return first, gaps


async def flood(client: httpx.AsyncClient, model: str, stop: asyncio.Event, long_prompt: str) -> int:
    sent = 0
    while not stop.is_set():
        await client.post("/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 4})
        await client.get("/metrics")
        await client.get("/v1/models")
        sent += 3
    return sent


async def phase(base: str, model: str, concurrency: int, tokens: int, flooders: int, long_prompt: str) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        before = (await client.get("/metrics")).text
        stop = asyncio.Event()
        floods = [asyncio.create_task(flood(client, model, stop, long_prompt)) for _ in range(flooders)]
        started = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_one(client, model, f"Request {i}:", tokens) for i in range(concurrency))
        )
        seconds = time.perf_counter() - started
        stop.set()
        flooded = sum(await asyncio.gather(*floods))
        after = (await client.get("/metrics")).text
    steps = metric(after, "atom:engine_steps") - metric(before, "atom:engine_steps")
    step_s = metric(after, "atom:engine_step_seconds") - metric(before, "atom:engine_step_seconds")
    wait_s = metric(after, "atom:engine_step_wait_seconds") - metric(before, "atom:engine_step_wait_seconds")
    itl = np.array([g for _, gaps in streams for g in gaps]) * 1e3
    return {
        "seconds": seconds,
        "output_tok_s": concurrency * tokens / seconds,
        "engine_steps": steps,
        "mean_step_ms": step_s / steps * 1e3,
        "mean_step_wait_ms": wait_s / steps * 1e3,
        "ttft_mean_ms": float(np.mean([first for first, _ in streams])) * 1e3,
        "itl_median_ms": float(np.median(itl)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
        "flood_requests": flooded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model or artifact (default: a tiny random Llama)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--flooders", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench_engine_isolation.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from atom_models.checkpoints import make_random_checkpoint

            model = make_random_checkpoint(Path(tmp) / "tiny", "tiny-llama")
        with served(model, "--disable-uvicorn-access-log") as server:
            base = server.base_url
            long_prompt = "lorem ipsum dolor sit amet " * 2000  # well past the context: tokenized, then refused
            asyncio.run(phase(base, "m", args.concurrency, args.tokens, 0, long_prompt))  # warm-up
            quiet = asyncio.run(phase(base, "m", args.concurrency, args.tokens, 0, long_prompt))
            busy = asyncio.run(phase(base, "m", args.concurrency, args.tokens, args.flooders, long_prompt))
    print(f"\nengine isolation, {args.concurrency} streams x {args.tokens} tokens, {args.flooders} flooding clients")
    print(
        f"{'phase':>6} {'step ms':>9} {'wait ms':>9} {'tok/s':>8} {'TTFT ms':>9} {'ITL p50':>9} {'ITL p99':>9} "
        f"{'flood req':>10}"
    )
    for name, r in (("quiet", quiet), ("busy", busy)):
        print(
            f"{name:>6} {r['mean_step_ms']:>9.3f} {r['mean_step_wait_ms']:>9.3f} {r['output_tok_s']:>8.0f} "
            f"{r['ttft_mean_ms']:>9.1f} {r['itl_median_ms']:>9.2f} {r['itl_p99_ms']:>9.2f} {r['flood_requests']:>10}"
        )
    write_json(args.out, {"quiet": quiet, "busy": busy, "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    sys.exit(main())
