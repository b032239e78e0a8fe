"""Request limits checked before anything is routed: header block size and count, body size.

Headers are checked on every request from the ASGI scope (uvicorn has parsed them
already; its h11 parser is also told to stop at `max_header_bytes`). Bodies are counted
as they arrive, so an oversized chunked body is refused without being held whole.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.requests import Request
from starlette.types import Message, Receive, Scope

from shared.errors import HeadersTooLarge, PayloadTooLarge
from shared.settings import LimitSettings

__all__ = ["check_headers", "declared_length", "limited_receive", "read_body"]


def check_headers(scope: Scope, limits: LimitSettings) -> None:
    headers = scope["headers"]
    if len(headers) > limits.max_headers:
        raise HeadersTooLarge(f"{len(headers)} request headers; at most {limits.max_headers} are accepted")
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
    if size > limits.max_header_bytes:
        raise HeadersTooLarge(f"request headers of {size} bytes; at most {limits.max_header_bytes} are accepted")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body larger than {limit} bytes (proxy.limits.max_body_bytes)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` (declared or counted)."""
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def limited_receive(scope: Scope, receive: Receive, limit: int) -> Receive:
    """`receive` that raises 413 once the body passes `limit` (for the framework-routed endpoints)."""
    declared = declared_length(scope)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                # FastAPI turns anything but an HTTPException raised while it reads a body into a 400.
                raise HTTPException(413, _too_large(limit).message)
        return message

    return counted
