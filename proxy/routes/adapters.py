"""LoRA adapters as bytes, for replicas that share no filesystem with the trainer.

`PUT /admin/adapters/{name}` (admin token): the trainer uploads an adapter's folder once per push,
as an uncompressed tar with its SHA-256; the proxy checks the digest and stores it in the database,
so every proxy sharing the database serves it. `GET /adapters/{name}` (`proxy.adapter_token`, or
the admin token): a replica's Rolltap plugin (`rolltap_vllm`) fetches it when vLLM resolves the
adapter by name, which the push triggers through `POST /admin/replicas/control`
(`resolve_lora_adapter`). Closed by default: with neither token set, nothing is served.
This module never logs a token or an adapter's bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from starlette.responses import Response

from proxy import store
from proxy.routes.admin import INT_MAX, require_admin
from proxy.routes.ids import check_id
from shared.errors import DatabaseUnavailable, Forbidden, InvalidRequest, NotFound, Unauthorized

__all__ = ["DIGEST_HEADER", "STORED_HEADER", "UPLOAD_PREFIX", "router"]

UPLOAD_PREFIX = "/admin/adapters/"
DIGEST_HEADER = "x-rolltap-sha256"
# The digests the database still holds, so a replica's plugin drops its unpacked copies of the rest.
STORED_HEADER = "x-rolltap-adapters"
_SHA256 = re.compile(r"[0-9a-f]{64}")
# One write of up to `proxy.limits.max_adapter_bytes`, beside calls' records on PostgreSQL; on
# SQLite (one writer) they queue behind it meanwhile (once per push: 1-2 s for 335 MB).
_WRITE_TIMEOUT_S = 300.0


def require_adapter_reader(request: Request) -> None:
    proxy = request.app.state.settings.proxy
    tokens = [t.get_secret_value() for t in (proxy.adapter_token, proxy.admin_token) if t is not None]
    if not tokens:
        raise Forbidden("adapter fetches are disabled: set proxy.adapter_token (ROLLTAP_PROXY__ADAPTER_TOKEN)",
                        code="adapters_disabled")
    given = request.headers.get("authorization", "").encode()
    # Every token compared (no short cut): the time taken does not tell which one was close.
    matches = [hmac.compare_digest(given, f"Bearer {token}".encode()) for token in tokens]
    if not any(matches):
        raise Unauthorized("missing or wrong adapter token", code="invalid_adapter_token")


router = APIRouter()

_TAR = {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}


@router.put("/admin/adapters/{name}", status_code=201, dependencies=[Depends(require_admin)],
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def put_adapter(
    name: str,
    request: Request,
    version: Annotated[int, Query(ge=0, le=INT_MAX, description="The policy version the adapter serves")],
    x_rolltap_sha256: Annotated[str, Header(description="Hex SHA-256 of the body")],
    keep: Annotated[int | None, Query(ge=1, le=INT_MAX, description="Keep this many newest versions (and the "
                                      "active policy's); drop older adapters")] = None,
) -> dict[str, Any]:
    """Store a LoRA adapter (its folder as an uncompressed tar) for replicas to fetch by name."""
    check_id(name, "name")
    digest = x_rolltap_sha256.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise InvalidRequest(f"{DIGEST_HEADER} must be 64 hex digits", param=f"header.{DIGEST_HEADER}",
                             code="invalid_digest")
    data = await request.body()
    if not data:
        raise InvalidRequest("the body must be the adapter's folder as a tar archive", code="empty_adapter")
    actual = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(actual, digest):
        raise InvalidRequest(f"the body's SHA-256 is {actual}, not the {DIGEST_HEADER} sent: damaged on the way",
                             param=f"header.{DIGEST_HEADER}", code="adapter_digest_mismatch")
    protected = request.app.state.policy.served_name

    async def op(conn: AsyncConnection) -> list[str]:
        return await store.save_adapter(conn, name, version, digest, data, keep, protected)

    stored: list[str] = await request.app.state.recorder.run_beside(op, _WRITE_TIMEOUT_S)
    return {"object": "rolltap.lora_adapter", "name": name, "version": version, "sha256": digest,
            "size_bytes": len(data), "stored": len(stored)}


@router.get("/adapters/{name}", response_class=Response, dependencies=[Depends(require_adapter_reader)],
            responses={200: {"description": "The adapter's folder as an uncompressed tar", "content": _TAR,
                             "headers": {DIGEST_HEADER: {"description": "Hex SHA-256 of the body",
                                                         "schema": {"type": "string"}},
                                         STORED_HEADER: {"description": "Digests of every adapter stored",
                                                         "schema": {"type": "string"}}}}})
async def get_adapter(name: str, request: Request) -> Response:
    """A LoRA adapter pushed as bytes, for a replica's Rolltap plugin (`proxy.adapter_token`)."""
    check_id(name, "name")
    try:
        async with request.app.state.reader.connect() as conn:
            found = await store.load_adapter(conn, name)
    except (DBAPIError, OSError) as exc:
        raise DatabaseUnavailable(f"database unreachable: {exc.__class__.__name__}", retry_after_s=1.0) from None
    if found is None:
        raise NotFound(f"no LoRA adapter {name!r} is stored: not pushed as bytes (trainer.lora_transport), or older "
                       "than the versions kept", param="name", code="unknown_adapter")
    digest, data, stored = found
    return Response(data, media_type="application/x-tar", headers={DIGEST_HEADER: digest,
                                                                   STORED_HEADER: ",".join(stored)})
