"""Every failure leaves the server as an OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`.

Clients (the `openai` SDK among them) key on that shape and the status code, so validation,
engine refusals, unknown routes and internal faults all go through the handlers here,
and none of them can stop the server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from atom_runtime.async_engine import EngineDeadError
from atom_runtime.sampling_params import InvalidRequestError
from atom_runtime.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status and OpenAI error type/code."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def error_body(error: APIError) -> str:
    return ErrorResponse(error=error.info).model_dump_json()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=error.info).model_dump(), status_code=error.status)


def as_api_error(error: Exception) -> APIError:
    """Maps the exceptions a request can raise to what the client is told."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.param)
    if isinstance(error, RequestValidationError):
        return validation_error(error.errors())
    if isinstance(error, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(error), type="service_unavailable_error")
    if isinstance(error, HTTPException):
        return APIError(error.status_code, str(error.detail), type=_http_error_type(error.status_code))
    logger.exception("request failed", exc_info=error)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {error!r}", type="internal_server_error")


def validation_error(problems: Sequence[dict[str, Any]]) -> APIError:
    """A request body that does not parse (a model the server builds wrong is a 500, not the client's fault)."""
    if problems[0]["type"] == "json_invalid":
        return APIError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {problems[0]['msg']}")
    details = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg']}" for p in problems)
    param = str(problems[0]["loc"][0]) if problems[0]["loc"] else None
    return APIError(HTTPStatus.BAD_REQUEST, f"invalid request: {details}", param=param)


def _http_error_type(status: int) -> str:
    if status == HTTPStatus.NOT_FOUND:
        return "not_found_error"
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    return "invalid_request_error" if status < 500 else "internal_server_error"


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, error: Exception) -> JSONResponse:
        return error_response(as_api_error(error))

    for kind in (
        APIError,
        InvalidRequestError,
        RequestValidationError,
        EngineDeadError,
        HTTPException,
        Exception,
    ):
        app.add_exception_handler(kind, handle)
