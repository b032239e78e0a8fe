"""The one HTTP client to the replicas, and the one place its errors are mapped.

aiohttp was chosen over httpx by measurement (results in `docs/benchmarks.md`, "Upstream
HTTP client"). One `ClientSession` per process, keep-alive, explicit limits
and timeouts. Bodies are passed as bytes and read as bytes: nothing is re-encoded.

Nothing of aiohttp leaves this module: `Upstream.post` answers an `UpstreamResponse`
(status, headers, `read()`, `aiter()`, `close()`, `release()`), and every transport
failure, at any point of a call, is one of our errors (`upstream_errors`). Hosted models
(`proxy.hosted`) answer the same type, so the relay serves both alike.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from shared.errors import UpstreamDisconnected, UpstreamTimeout, UpstreamUnavailable
from shared.settings import ProxySettings

__all__ = ["Upstream", "UpstreamResponse", "shown_url", "upstream_errors"]

JSON_HEADERS = {"content-type": "application/json", "accept": "*/*"}  # the client's Accept-Encoding is never forwarded


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


@asynccontextmanager
async def upstream_errors(replica: str) -> AsyncIterator[None]:
    """Map transport failures to Rolltap errors (503 unreachable, 504 silent)."""
    try:
        yield
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"replica {shown_url(replica)} did not answer in time (proxy.limits.call_timeout_s, "
                             "proxy.read_timeout_s)", code="call_timeout") from exc
    except aiohttp.ClientError as exc:
        shown = shown_url(replica)  # an error's text may hold the URL too (aiohttp's InvalidURL does)
        raise UpstreamUnavailable(f"replica {shown} unreachable: {exc.__class__.__name__}: "
                                  f"{str(exc).replace(replica, shown)}") from exc
    except OSError as exc:
        raise UpstreamUnavailable(f"replica {shown_url(replica)} unreachable: {exc}") from exc


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
    def close(self) -> None:
        """Drop the connection: a replica aborts the request (the client left, or it failed)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the connection back for reuse (the body was read whole, or is not wanted)."""


class _AiohttpResponse(UpstreamResponse):
    __slots__ = ("_response", "_replica", "_call_timeout_s", "status", "content_type")

    def __init__(self, response: aiohttp.ClientResponse, replica: str, call_timeout_s: float) -> None:
        self._response = response
        self._replica = replica  # as shown: no credentials
        self._call_timeout_s = call_timeout_s
        self.status = response.status
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except asyncio.CancelledError:
            self._response.close()  # the client left: the replica drops the request with the connection
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._response.close()
            raise self._failed(exc, "mid-response") from exc
        finally:
            self._response.release()

    async def aiter(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._failed(exc, "mid-stream") from exc

    def _failed(self, exc: Exception, where: str) -> UpstreamTimeout | UpstreamDisconnected:
        if isinstance(exc, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one too
            return UpstreamTimeout(f"replica {self._replica} did not finish the response within "
                                   f"{self._call_timeout_s:g} s (proxy.limits.call_timeout_s)", code="call_timeout")
        return UpstreamDisconnected(f"replica {self._replica} failed {where}: {exc.__class__.__name__}")

    def close(self) -> None:
        self._response.close()

    def release(self) -> None:
        self._response.release()


class Upstream:
    def __init__(self, settings: ProxySettings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Created lazily so it binds to the running loop (uvicorn's), not the importer's.
            # keepalive 4 s: below vLLM's 5 s idle timeout, or a POST can land on a socket the
            # replica is closing (aiohttp never retries a POST).
            connector = aiohttp.TCPConnector(
                limit=self._settings.max_connections, limit_per_host=0, keepalive_timeout=4.0,
                ttl_dns_cache=300, enable_cleanup_closed=True,
            )
            # total: a call's whole time, headers to last byte (`limits.call_timeout_s`), set once here
            # so no call pays for a timeout object of its own.
            timeout = aiohttp.ClientTimeout(
                total=self._settings.limits.call_timeout_s, connect=self._settings.connect_timeout_s,
                sock_read=self._settings.read_timeout_s,
            )
            # auto_decompress off: bytes go to the client exactly as the replica sent them.
            # identity encoding + no auto-decompression: the recorder parses what the client gets.
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, raise_for_status=False,
                headers={"accept-encoding": "identity"}, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def post(self, replica: str, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send a request; returns once the status line and headers arrived. The caller closes or releases it."""
        async with upstream_errors(replica):
            response = await self.session.post(replica + path, data=body, headers=headers or JSON_HEADERS)
        return _AiohttpResponse(response, shown_url(replica), self._settings.limits.call_timeout_s)

    async def get(self, replica: str, path: str, timeout_s: float | None = None) -> tuple[int, bytes, str]:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        async with upstream_errors(replica):
            async with self.session.get(replica + path, timeout=timeout) as resp:
                return resp.status, await resp.read(), resp.headers.get("content-type", "application/json")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def forwardable_headers(headers: Any) -> dict[str, str]:
    """Request headers worth passing upstream: content negotiation only, never client credentials.

    An allow-list, so `authorization`, `x-api-key`, cookies and whatever else a client sends
    stay here; the replica gets no agent key.
    """
    out = {"content-type": headers.get("content-type", "application/json"), "accept": headers.get("accept", "*/*")}
    return out
