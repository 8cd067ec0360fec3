"""Online serving benchmark against an OpenAI-compatible server, with ATOM's (vLLM's) benchmark_serving flags.

    python benchmarks/benchmark_serving.py --backend openai --base-url http://127.0.0.1:8000 --model NAME \\
        --dataset-name random --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.8 \\
        --num-prompts 1280 --max-concurrency 128 --request-rate inf --ignore-eos \\
        --save-result --percentile-metrics ttft,tpot,itl,e2el

Every request streams; TTFT is the time to the first chunk with output (text or token ids), ITL the gaps between
chunks, TPOT the mean time per output token after the first, E2EL the whole request. Token
counts come from the server's usage report (`stream_options.include_usage`). The API key,
if the server wants one, is read from $OPENAI_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm.asyncio import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
}
METRICS["e2el"] = "End-to-end Latency"


@dataclass
class Request:
    prompt: str
    output_len: int


@dataclass
class Result:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def random_requests(
    tokenizer: PreTrainedTokenizerBase, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Request]:
    """Prompts of random tokens, lengths uniform in [len * (1 - ratio), len * (1 + ratio)], as vLLM's random set."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])

    def lengths(mean: int) -> np.ndarray:
        return rng.integers(max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio)) + 1, size=num)

    return [
        Request(tokenizer.decode(rng.choice(vocab, size=int(n_in)).tolist()), int(n_out))
        for n_in, n_out in zip(lengths(input_len), lengths(output_len), strict=True)
    ]


def payload(args: argparse.Namespace, request: Request) -> dict:
    body = {
        "model": args.model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
        # Token ids with every chunk (vLLM's and atom's extension): a token whose text is held back (part of a
        # character, or a random-weight model's ids past its tokenizer's vocabulary) still counts as it arrives.
        "return_token_ids": True,
    }
    if args.backend == "openai-chat":
        body.update(messages=[{"role": "user", "content": request.prompt}], max_completion_tokens=request.output_len)
    else:
        body.update(prompt=request.prompt, max_tokens=request.output_len)
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Result:
    result = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    result.error = data["error"]["message"]
                    return result
                if data.get("usage"):
                    result.prompt_len = data["usage"]["prompt_tokens"]
                    result.output_len = data["usage"]["completion_tokens"]
                choices = data.get("choices") or [{}]
                text = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                if text or choices[0].get("token_ids"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = repr(error)
    return result


async def arrivals(num: int, rate: float, burstiness: float, seed: int):
    """Request indices at Poisson (burstiness 1) or gamma-distributed intervals; all at once when rate is inf."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def benchmark(args: argparse.Namespace, requests: list[Request]) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    url = args.base_url.rstrip("/") + (args.endpoint or ENDPOINTS[args.backend])
    chat = args.backend == "openai-chat"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(6 * 3600), limits=limits) as client:
        print("Starting initial single prompt test run...")
        test = await send(client, url, payload(args, Request(requests[0].prompt, min(requests[0].output_len, 8))), chat)
        if not test.success:
            raise SystemExit(f"the test request failed: {test.error}")
        if args.profile:
            (await client.post(args.base_url.rstrip("/") + "/start_profile")).raise_for_status()
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="Requests")

        async def one(request: Request) -> Result:
            if semaphore is None:
                result = await send(client, url, payload(args, request), chat)
            else:
                async with semaphore:
                    result = await send(client, url, payload(args, request), chat)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one(requests[i]))
            async for i in arrivals(len(requests), args.request_rate, args.burstiness, args.seed)
        ]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        if args.profile:
            stopped = await client.post(args.base_url.rstrip("/") + "/stop_profile")
            print(f"profile: {stopped.text}")
    return results, duration


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.success]
    total_in, total_out = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    for name in args.percentile_metrics.split(","):
        values_ms = np.array(samples[name] or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(values_ms))
        summary[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    summary.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        errors=[r.error for r in results],
    )
    return summary


def print_table(args: argparse.Namespace, s: dict) -> None:
    row = lambda label, value: print(
        f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value}"
    )
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for name in args.percentile_metrics.split(","):
        print("{s:{c}^50}".format(s=METRICS[name], c="-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", s[f"median_{name}_ms"])
        for p in args.metric_percentiles.split(","):
            row(f"P{float(p):g} {upper} (ms):", s[f"p{float(p):g}_{name}_ms"])
    print("=" * 50)


def load_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """From --tokenizer, else --model if it is a directory, else the model directory the server reports."""
    source = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    if source is None:
        headers = (
            {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
        )
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers).raise_for_status().json()["data"]
        source = next((m.get("root") for m in models if m["id"] == args.model), None)
        if source is None:
            raise SystemExit(f"the server does not serve {args.model!r}; pass --tokenizer")
    return AutoTokenizer.from_pretrained(source)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--endpoint", help="API path (default: the backend's)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--tokenizer", help="tokenizer directory for the random prompts (default: see docs)")
    parser.add_argument(
        "--dataset-name", choices=["random"], default="random", help="random token prompts (the only set; ATOM's flag)"
    )
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"subset of {','.join(METRICS)}")
    parser.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename")
    parser.add_argument("--profile", action="store_true", help="record a torch.profiler trace on the server")
    parser.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        parser.error(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METRICS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args)
    requests = random_requests(
        tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed
    )
    results, duration = asyncio.run(benchmark(args, requests))
    summary = summarize(args, results, duration)
    print_table(args, summary)
    if summary["failed"]:
        first = next(r.error for r in results if not r.success)
        print(f"{summary['failed']} requests failed; the first: {first}", file=sys.stderr)
    if args.save_result:
        summary.update(
            date=datetime.now().strftime("%Y%m%d-%H%M%S"),
            backend=args.backend,
            model_id=args.model,
            num_prompts=args.num_prompts,
            request_rate=args.request_rate if args.request_rate < float("inf") else "inf",
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
        )
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps-concurrency{args.max_concurrency}"
            f"-{Path(args.model).name}-{summary['date']}.json"
        )
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"results written to {path}")


if __name__ == "__main__":
    main()
