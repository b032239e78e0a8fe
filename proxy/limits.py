"""Request limits checked before anything is routed: header block size and count, framing, body size and time.

Headers are checked on every request from the ASGI scope (uvicorn has parsed them
already). Bodies are counted
as they arrive, so an oversized chunked body is refused without being held whole, and
must arrive within `body_timeout_s` (the header block's time is the server's:
`proxy.server`).
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from starlette.requests import Request
from starlette.types import Message, Receive, Scope

from shared.errors import HeadersTooLarge, InvalidRequest, PayloadTooLarge, RequestTimeout
from shared.settings import LimitSettings

__all__ = ["check_framing", "check_headers", "declared_length", "limited_receive", "read_body"]


def check_headers(scope: Scope, limits: LimitSettings) -> None:
    headers = scope["headers"]
    if len(headers) > limits.max_headers:
        raise HeadersTooLarge(f"{len(headers)} request headers; at most {limits.max_headers} are accepted")
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
    if size > limits.max_header_bytes:
        raise HeadersTooLarge(f"request headers of {size} bytes; at most {limits.max_header_bytes} are accepted")


def check_framing(scope: Scope) -> None:
    """HTTP/1.0 has no chunked transfer coding (RFC 9112 6.1): such a body's end is ambiguous, refused."""
    if scope["http_version"] != "1.0":
        return
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            raise InvalidRequest("Transfer-Encoding: chunked is HTTP/1.1 only; send Content-Length with HTTP/1.0",
                                 code="chunked_http10")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body larger than {limit} bytes (proxy.limits.max_body_bytes)")


def _too_slow(timeout_s: float) -> RequestTimeout:
    return RequestTimeout(f"request body not received within {timeout_s:g} s of its headers "
                          "(proxy.limits.body_timeout_s)", code="body_timeout")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` (declared or counted), or 408
    when it has not arrived whole within `timeout_s`."""
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise _too_slow(timeout_s) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def limited_receive(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> Receive:
    """`receive` that raises 413 once the body passes `limit`, 408 when it is not whole `timeout_s` from
    now (for the framework-routed endpoints)."""
    declared = declared_length(scope)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    seen = 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    is_whole = False

    async def counted() -> Message:
        nonlocal seen, is_whole
        if is_whole:
            return await receive()  # waiting for a disconnect, while the response is sent, takes its time
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            # FastAPI turns anything but an HTTPException raised while it reads a body into a 400.
            raise HTTPException(408, _too_slow(timeout_s).message) from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, _too_large(limit).message)
            is_whole = not message.get("more_body", False)
        return message

    return counted
