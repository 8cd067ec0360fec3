"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncEngine`, run by uvicorn on uvloop.

Routes: /v1/completions, /v1/chat/completions, /v1/models[/{model}], /tokenize, /detokenize, /health, /metrics,
/version, /start_profile, /stop_profile. With an API key, every route but /health, /metrics and /version wants
`Authorization: Bearer KEY` (as vLLM's: a Prometheus scraper needs no key).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response

import atom_models
from atom_runtime.async_engine import AsyncEngine
from atom_runtime.engine_args import create_engine_kwargs
from atom_runtime.loading import create_engine
from atom_runtime.server.errors import APIError, error_response, install_error_handlers, validation_error
from atom_runtime.server.profiler import EngineProfiler
from atom_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from atom_runtime.server.serving import OpenAIServing

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger(__name__)


def _body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """Parses the body ourselves rather than through FastAPI, to name the problem: not UTF-8, not
    JSON, or which field is wrong (FastAPI answers 422 in its own shape)."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise APIError(HTTPStatus.BAD_REQUEST, f"the request body is not valid UTF-8: {error}") from error
        try:
            parsed = model.model_validate_json(text)
        except ValidationError as error:
            raise validation_error(error.errors()) from error
        if ignored := getattr(parsed, "ignored_fields", None):
            names = ", ".join(repr(name[:64]) for name in ignored[:16])
            logger.warning("%s: ignored fields the server does not know: %s", request.url.path, names)
        return parsed

    return parse


_bearer = HTTPBearer(auto_error=False)


def _api_key_check(api_key: str) -> Callable[..., Awaitable[None]]:
    async def check(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise APIError(
                HTTPStatus.UNAUTHORIZED,
                "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    torch_profiler_dir: str | Path | None = None,
    model_path: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The app for one engine; the caller owns the engine (and shuts it down). `tool_call_parser`: tool_choice
    "auto" is on, reading calls in that format; `reasoning_parser`: chat replies' thinking as reasoning_content."""
    serving = OpenAIServing(engine, served_model_name, tool_call_parser, reasoning_parser)
    profiler = EngineProfiler(engine, torch_profiler_dir) if torch_profiler_dir is not None else None
    app = FastAPI(title="atom", summary="OpenAI-compatible LLM server")
    install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(
                APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine has stopped", type="service_unavailable_error")
            )
        return Response(status_code=HTTPStatus.OK)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": atom_models.__version__})

    router = APIRouter(dependencies=[Depends(_api_key_check(api_key))] if api_key else [])

    @router.post("/v1/completions")
    async def completions(
        raw: Request, request: Annotated[CompletionRequest, Depends(_body(CompletionRequest))]
    ) -> Response:
        return await serving.completions(request, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(
        raw: Request, request: Annotated[ChatCompletionRequest, Depends(_body(ChatCompletionRequest))]
    ) -> Response:
        return await serving.chat(request, raw)

    @router.post("/tokenize")
    async def tokenize(request: Annotated[TokenizeRequest, Depends(_body(TokenizeRequest))]) -> TokenizeResponse:
        return await serving.tokenize(request)

    @router.post("/detokenize")
    async def detokenize(
        request: Annotated[DetokenizeRequest, Depends(_body(DetokenizeRequest))],
    ) -> DetokenizeResponse:
        return await serving.detokenize(request)

    card = ModelCard(id=served_model_name, root=model_path, max_model_len=engine.max_model_len)

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return card

    def need_profiler() -> EngineProfiler:
        if profiler is None:
            raise APIError(
                HTTPStatus.BAD_REQUEST, "profiling is off; start the server with --torch-profiler-dir DIR to enable it"
            )
        return profiler

    @router.post("/start_profile")
    async def start_profile() -> JSONResponse:
        await need_profiler().start()
        return JSONResponse({"status": "recording"})

    @router.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        trace = await need_profiler().stop()
        return JSONResponse({"status": "stopped", "trace": str(trace)})

    app.include_router(router)
    return app


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_server(args: argparse.Namespace) -> None:
    """`atom-run serve`: loads the model, serves until interrupted (Ctrl-C, SIGTERM), then stops the engine."""
    # uvicorn shuts down gracefully on SIGTERM, then raises it again under the handler found before it started:
    # by default that ends the process there, before the engine process is stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = create_engine(
        args.model, served_model_name=args.served_model_name, engine_process=True, **create_engine_kwargs(args)
    )
    if args.chat_template is not None:
        engine.tokenizer.chat_template = args.chat_template
    app = build_app(
        engine,
        engine.model_name,
        api_key=args.api_key,
        torch_profiler_dir=args.torch_profiler_dir,
        model_path=str(args.model),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
        )
    )
    died = False

    def exit_after_engine_death() -> None:
        # As vLLM does: a server that can only answer 503 should go, so that a supervisor restarts it. (Any thread:
        # uvicorn's loop reads should_exit on its next tick, and in-flight requests get the error first.)
        nonlocal died
        died = True
        logger.error("the engine stopped after an error: the server shuts down")
        server.should_exit = True

    engine.on_dead = exit_after_engine_death
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again once it has shut down (uvicorn.run drops it too)
        pass
    finally:
        engine.shutdown()
    if died:
        raise SystemExit(1)
