"""`atom-run`: serve a model over HTTP, or generate once from the command line.

    atom-run serve [MODEL] [--host H] [--port P] [--api-key K] [--served-model-name NAME]
                   [--enable-auto-tool-choice --tool-call-parser P] [--reasoning-parser P] [engine flags]
    atom-run generate [MODEL] (--prompt TEXT | --prompt-token-ids 1,2,3) [--max-tokens N] [--stop TEXT]... [--json]
        [engine flags]

MODEL is a model directory (or a compiled artifact directory); it goes to `create_engine` as is.
Without MODEL, the demo model shipped with atom runs, from an artifact exported once and cached
(`atom_runtime.default_model`); --device, --dtype, --quantization and --quantization-exclude choose that export.
Bad input is a one-line error and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

import uvloop

from atom_runtime.engine_args import add_engine_args, create_engine_kwargs
from atom_runtime.sampling_params import SamplingParams, with_defaults
from atom_runtime.server.reasoning import REASONING_PARSERS
from atom_runtime.server.tool_calls import TOOL_CALL_PARSERS

# The engine, the server and the demo model's export import torch (~3 s): `main` imports them after the flags parse,
# so --help and bad flags answer at once.

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, without argparse's usage block
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def check_listen_address(host: str, port: int) -> None:
    """Fails now, in one line, where uvicorn would fail only after the model has loaded: a port in use, a host
    that is not this machine's. Binds what uvicorn's server binds (asyncio's `create_server`): every address the
    host resolves to ("" is all of them), IPv6 ones IPv6-only, with SO_REUSEADDR."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    probes: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            probes.append(probe := socket.socket(family, kind, proto))
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    except (OSError, OverflowError, UnicodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ValueError(f"cannot listen on {shown}: {reason}") from None
    finally:
        for probe in probes:
            probe.close()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="atom-run", description="Serve or run an LLM with atom.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", type=Path, nargs="?", help="model or artifact directory (default: the demo model)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ATOM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on all routes but /health, /metrics, /version ($ATOM_API_KEY)",
    )
    serve.add_argument("--served-model-name", help="the model name clients use (default: the directory's name)")
    serve.add_argument(
        "--chat-template", help="a Jinja chat template, or its file, instead of the model's (for /v1/chat/completions)"
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose to call tools (tool_choice "auto"), with --tool-call-parser reading its calls',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="the tool-call format the model writes: hermes (Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="send a reasoning model's thinking as reasoning_content: qwen3 (<think>...</think>), deepseek_r1",
    )
    serve.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    serve.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per request (for busy servers)"
    )
    add_engine_args(serve)

    generate = commands.add_parser("generate", help="generate once and print the result")
    generate.add_argument("model", type=Path, nargs="?", help="model or artifact directory (default: the demo model)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    # Sampling flags left out take the model's generation config (--generation-config), then SamplingParams' defaults.
    generate.add_argument(
        "--max-tokens", type=int, default=SamplingParams.max_tokens, help="most tokens to generate (%(default)s)"
    )
    generate.add_argument("--temperature", type=float, help=f"0: greedy (default: {SamplingParams.temperature})")
    generate.add_argument("--top-p", type=float, help=f"nucleus (default: {SamplingParams.top_p})")
    generate.add_argument("--top-k", type=int, help=f"-1: off (default: {SamplingParams.top_k})")
    generate.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)"
    )
    generate.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens past end-of-sequence tokens")
    generate.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason"}')
    add_engine_args(generate)  # its --seed also seeds this request's sampling
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A server reports its setup (KV-cache size, ...); a one-shot generate prints only its result.
    logging.basicConfig(
        level=logging.INFO if args.command == "serve" else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.model is not None and not args.model.exists():
        parser.error(f"model directory {str(args.model)!r} does not exist")
    if args.command == "serve" and args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        # Bad sampling and engine flags fail now, not after the demo model's export (half a minute on a CPU).
        if args.command == "generate":
            with_defaults({}, **_sampling_flags(args))
        create_engine_kwargs(args)
        if args.command == "serve":  # before the model loads (or the demo model exports), and before torch imports
            check_listen_address(args.host, args.port)
            if args.chat_template is not None:
                from atom_runtime.loading import read_chat_template

                args.chat_template = read_chat_template(args.chat_template)
        from atom_runtime.default_model import DEMO_NAME, default_artifact
        from atom_runtime.server.api_server import run_server

        if args.model is None:
            args.model = default_artifact(
                args.device, args.dtype, args.quantization, args.quantization_exclude, args.block_size
            )
            args.device, args.dtype, args.quantization = "auto", "auto", None  # fixed by that export
            args.quantization_exclude = []
            if args.command == "serve":
                args.served_model_name = args.served_model_name or DEMO_NAME
        if args.command == "serve":
            run_server(args)
        else:
            uvloop.run(_generate(args))
    except (ValueError, OSError) as error:  # InvalidRequestError and ArtifactError are ValueErrors
        parser.error(str(error))
    except KeyboardInterrupt:
        sys.exit(130)


def _sampling_flags(args: argparse.Namespace) -> dict:
    """`with_defaults` arguments from `generate`'s sampling flags."""
    return dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


async def _generate(args: argparse.Namespace) -> None:
    from atom_runtime.loading import create_engine
    from atom_runtime.server.profiler import EngineProfiler

    flags = _sampling_flags(args)
    engine = create_engine(args.model, **create_engine_kwargs(args))
    params = with_defaults(engine.sampling_defaults, **flags)
    profiler = None
    try:
        if args.torch_profiler_dir is not None:
            profiler = EngineProfiler(engine, args.torch_profiler_dir)
            await profiler.start()
        async for output in engine.generate(args.prompt, params, prompt_token_ids=args.prompt_token_ids):
            final = output
        if profiler is not None:
            print(f"trace written to {await profiler.stop()}", file=sys.stderr)
    finally:
        engine.shutdown()
    completion = final.outputs[0]
    if args.json:
        print(
            json.dumps(
                {"text": completion.text, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
            )
        )
    else:
        print(completion.text)


if __name__ == "__main__":  # `python -m atom_runtime.cli`, like `python -m atom_runtime`
    main()
