"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is a 400 (never FastAPI's default 422, never a 500), and no
error body carries a traceback, file path or memory address: clients get our message only.
"""
from __future__ import annotations

import logging
import re
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tokenmill.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "internal_error"}
# "... 0x7f3a... at line ..." and "/path/to/file.py" never leave the server.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_PATH = re.compile(r"(/[\w.\-]+){2,}\.py")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None):
    return OpenAIError(400, message, param, code)


def error_body(status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    message = _PATH.sub("<path>", _ADDRESS.sub("<addr>", message))
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def from_value_error(e: ValueError, params: Sequence[str], default: Optional[str] = None,
                     renames: Optional[dict] = None) -> OpenAIError:
    """Turn an engine / SamplingParams ValueError into a 400, guessing ``param`` from the
    message (their messages start with or name the offending parameter)."""
    msg = str(e)
    if "max_model_len" in msg and "prompt" in msg:
        return bad_request(msg, default or "prompt", "context_length_exceeded")
    words = re.findall(r"[a-z_]+", msg)
    name = next((w for w in words if w in params), None)
    if name is None and "prompt" in msg:
        name = default
    if renames and name in renames:
        name = renames[name]
    return bad_request(msg, name or default)


# pydantic names the union member it tried inside ``loc`` ("str", "list[TextPart]", ...).
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _loc_to_param(loc: Sequence) -> Optional[str]:
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) if parts else None


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[-("))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _loc_to_param(first.get("loc", ()))
        text = first.get("msg", "invalid request")
        message = f"{param}: {text}" if param else f"invalid request body: {text}"
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        if status == 422:   # e.g. a body that is not JSON
            status = 400
        return error_response(status, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error")
