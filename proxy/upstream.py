"""The one HTTP client to the replicas, and the one place its errors are mapped.

Connections are `proxy.http1`'s (keep-alive, explicit limits and time limits; chosen over aiohttp,
and aiohttp over httpx before it, by measurement: docs/benchmarks.md). Bodies are passed as bytes
and read as bytes: nothing is re-encoded, and the replica is asked for no content encoding.

`Upstream.post` answers an `UpstreamResponse` (status, content type, `read()`, `aiter()`,
`release()`), and every transport failure, at any point of a call, is one of our errors: before
the answer's headers `UpstreamUnavailable` (503, tried on another replica) or `UpstreamTimeout`
(504); after them `UpstreamDisconnected` or `UpstreamTimeout`. Hosted models (`proxy.hosted`)
answer the same type, so the relay serves both alike.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proxy.http1 import (
    BadResponse,
    BadURL,
    CallTimeout,
    ConnectTimeout,
    Connection,
    Pool,
    ReadTimeout,
    ReplicaClosed,
    Target,
)
from shared.errors import UpstreamDisconnected, UpstreamTimeout, UpstreamUnavailable
from shared.settings import ProxySettings

__all__ = ["Upstream", "UpstreamResponse", "shown_url"]

JSON_HEADERS = {"content-type": "application/json", "accept": "*/*"}  # the client's Accept-Encoding is never forwarded
# Below vLLM's 5 s idle timeout (uvicorn's default), so a request does not land on a socket the
# replica is closing.
KEEPALIVE_S = 4.0


def shown_url(url: str) -> str:
    """A replica URL as it may be logged or shown (logs, `/metrics`, the admin API, the dashboard,
    call records): credentials (`user:password@`) become `***@`. Connections use the real URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable replica URL>"  # rather than risk a password
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


_TRANSPORT_ERRORS = (OSError, BadResponse, BadURL)  # TimeoutError and ReplicaClosed are OSErrors


class UpstreamResponse(abc.ABC):
    """A replica's (or hosted model's) answer once its headers arrived; its body is read once, whole or
    chunk by chunk. Errors while reading are ours: `UpstreamDisconnected` (the replica went away
    mid-body) or `UpstreamTimeout` (it did not finish within `proxy.limits.call_timeout_s`)."""

    status: int
    content_type: str

    @property
    def is_stream(self) -> bool:
        """A successful server-sent event stream (anything else is read whole)."""
        return self.status == 200 and self.content_type.startswith("text/event-stream")

    @abc.abstractmethod
    async def read(self) -> bytes:
        """The whole body."""

    @abc.abstractmethod
    def aiter(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive."""

    @abc.abstractmethod
    def release(self) -> None:
        """Done with the answer, read or not: its connection is kept for reuse if the answer came whole,
        else dropped, and with it the replica's request (the client left, or the call failed)."""


class _ReplicaResponse(UpstreamResponse):
    __slots__ = ("_upstream", "_connection", "_replica", "_returned", "status", "content_type")

    def __init__(self, upstream: Upstream, connection: Connection, replica: str) -> None:
        self._upstream = upstream
        self._connection = connection
        self._replica = replica  # as shown: no credentials
        self._returned = False
        self.status = connection.status
        self.content_type = connection.content_type.decode("latin-1")

    async def read(self) -> bytes:
        connection = self._connection
        parts = []
        try:
            while part := await connection.body_part():
                parts.append(part)
        except _TRANSPORT_ERRORS as exc:
            raise self._upstream.mapped(exc, self._replica, answering=True) from exc
        finally:
            self.release()  # reused if whole, else dropped (a cancelled read: the client left)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aiter(self) -> AsyncIterator[bytes]:
        connection = self._connection
        try:
            while part := await connection.body_part():
                yield part
        except _TRANSPORT_ERRORS as exc:
            raise self._upstream.mapped(exc, self._replica, answering=True) from exc

    def release(self) -> None:
        if not self._returned:
            self._returned = True
            self._upstream.pool.release(self._connection)


class Upstream:
    def __init__(self, settings: ProxySettings) -> None:
        self._settings = settings
        self._call_timeout_s = settings.limits.call_timeout_s
        self._read_timeout_s = settings.read_timeout_s
        self._pool: Pool | None = None
        self._targets: dict[str, tuple[Target, str]] = {}  # replica URL -> where it is, how it is shown

    @property
    def pool(self) -> Pool:
        if self._pool is None:  # created on first use, inside the running loop
            self._pool = Pool(limit=self._settings.max_connections, keepalive_s=KEEPALIVE_S,
                              connect_timeout_s=self._settings.connect_timeout_s)
        return self._pool

    def mapped(self, exc: BaseException, replica: str, *,
               answering: bool) -> UpstreamUnavailable | UpstreamTimeout | UpstreamDisconnected:
        """Our error for a transport failure; `replica` as shown, `answering`: the answer's headers had come."""
        if isinstance(exc, CallTimeout):
            return UpstreamTimeout(f"replica {replica} did not finish the response within {self._call_timeout_s:g} s "
                                   "(proxy.limits.call_timeout_s)", code="call_timeout")
        if isinstance(exc, ReadTimeout):
            return UpstreamTimeout(f"replica {replica} sent nothing for {self._read_timeout_s:g} s "
                                   "(proxy.read_timeout_s)", code="call_timeout")
        if answering:
            return UpstreamDisconnected(f"replica {replica} failed mid-response: {exc.__class__.__name__}: {exc}")
        if isinstance(exc, ConnectTimeout):  # nothing was sent: another replica may take it
            return UpstreamUnavailable(f"replica {replica} unreachable: {exc} (proxy.connect_timeout_s)")
        return UpstreamUnavailable(f"replica {replica} unreachable: {exc.__class__.__name__}: {exc}")

    async def post(self, replica: str, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send a request; returns once the status line and headers arrived. The caller releases it."""
        return await self._exchange(replica, b"POST", path, headers or JSON_HEADERS, body, self._call_timeout_s)

    async def get(self, replica: str, path: str, timeout_s: float | None = None) -> tuple[int, bytes, str]:
        response = await self._exchange(replica, b"GET", path, {"accept": "*/*"}, None,
                                         timeout_s or self._call_timeout_s)
        return response.status, await response.read(), response.content_type or "application/json"

    async def _exchange(self, replica: str, method: bytes, path: str, headers: Mapping[str, str], body: bytes | None,
                        call_timeout_s: float) -> _ReplicaResponse:
        pool = self.pool
        fresh = False
        while True:
            connection: Connection | None = None
            try:
                found = self._targets.get(replica)
                if found is None:
                    found = self._targets[replica] = (Target(replica), shown_url(replica))
                target, shown = found
                connection = await pool.connection(target, fresh=fresh)
                connection.send(target.request(method, path, headers, body), call_timeout_s, self._read_timeout_s)
                await connection.response_head()
                return _ReplicaResponse(self, connection, shown)
            except _TRANSPORT_ERRORS as exc:
                if connection is not None:
                    pool.release(connection)
                    # A kept-alive connection the replica closed before answering: once more, on a new one.
                    if (isinstance(exc, ReplicaClosed) and connection.uses > 1 and connection.untouched
                            and not fresh):
                        fresh = True
                        continue
                raise self.mapped(exc, shown_url(replica), answering=False) from exc
            except BaseException:
                if connection is not None:
                    connection.abort()  # cancelled while awaiting the answer: the replica drops the request
                    pool.release(connection)
                raise

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            await asyncio.sleep(0)  # the aborted sockets close on the loop's next turn: let it come


def forwardable_headers(headers: Any) -> dict[str, str]:
    """Request headers worth passing upstream: content negotiation only, never client credentials.

    An allow-list, so `authorization`, `x-api-key`, cookies and whatever else a client sends
    stay here; the replica gets no agent key.
    """
    out = {"content-type": headers.get("content-type", "application/json"), "accept": headers.get("accept", "*/*")}
    return out
