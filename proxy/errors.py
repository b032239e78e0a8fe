"""Every error leaves the proxy in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

One place maps exceptions to responses; routes just raise. Unknown exceptions become a
500 with a generic message while the traceback goes to the log.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from shared.errors import RolltapError

__all__ = ["error_response", "install_error_handlers"]

logger = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 401: "authentication_error"}
_HTTP_CODES = {404: "unknown_route", 405: "method_not_allowed", 408: "body_timeout", 413: "body_too_large"}


def error_response(
    status: int, message: str, type_: str, *, param: str | None = None, code: str | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    headers = {"retry-after": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _rolltap_error(_: Request, exc: Exception) -> JSONResponse:
    # Messages name ids, routes and limits; they never carry a key, token or URL password.
    assert isinstance(exc, RolltapError)
    response = error_response(exc.status_code, exc.message, exc.type, param=exc.param, code=exc.code,
                              retry_after_s=exc.retry_after_s)
    if exc.call_id is not None:  # the call was recorded: a reward or a search can name it
        response.headers["x-rolltap-call-id"] = exc.call_id
    return response


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    response = error_response(exc.status_code, message, _HTTP_TYPES.get(exc.status_code, "invalid_request_error"),
                              code=_HTTP_CODES.get(exc.status_code))
    if exc.headers:  # 405's `Allow`
        response.headers.update(exc.headers)
    return response


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return error_response(400, message, "invalid_request_error", param=param, code=str(first.get("type")))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal error in the proxy; see its log", "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RolltapError, _rolltap_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
