"""HTTP/1.1 to the replicas: one asyncio protocol per keep-alive connection, responses parsed by
httptools (the parser uvicorn serves with), and a pool with a cap on connections in use.

Not aiohttp: its client was half of a bare relay's CPU per call (docs/benchmarks.md, "Half of the
bare relay is its HTTP client"). This one does what a relay to vLLM needs and no more:

- a cap on connections in use (`limit`); past it, calls wait first come, first served;
- keep-alive: an idle connection is reused for `keepalive_s`, kept below vLLM's 5 s so a request
  does not land on a socket the replica is closing. One the replica closed anyway before a byte of
  its answer came is retried once, on a new connection: the request reached nothing that answers;
- time limits: connecting; the longest silence while a response is awaited or read (not counted
  while reading is paused for a slow consumer); the whole call, from sending to the last byte;
- TLS for `https://` replicas, and credentials in a replica URL sent as Basic authorization;
- bodies framed by content-length, chunked, or ended by the connection's close; interim 1xx
  responses skipped;
- back-pressure: reading pauses while more than `HIGH_WATER` bytes wait for the consumer;
- a body's bytes handed on once per socket read, not once per HTTP chunk (per-chunk hand-offs
  cost more than aiohttp on streams).

Failures are plain exceptions: `OSError` (connecting, a reset, `ReplicaClosed`), `TimeoutError`
(`ConnectTimeout`, `ReadTimeout`, `CallTimeout`), `BadResponse`, `BadURL`. `proxy.upstream` maps
them to Rolltap's errors, in one place.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

__all__ = ["BadResponse", "BadURL", "CallTimeout", "ConnectTimeout", "Connection", "Pool", "ReadTimeout",
           "ReplicaClosed", "Target", "HIGH_WATER"]

HIGH_WATER = 1 << 20  # body bytes waiting for the consumer past which the socket is not read


class BadURL(ValueError):
    """A replica URL this client cannot connect to (not http or https, no host)."""


class BadResponse(Exception):
    """The replica's bytes are not an HTTP/1.1 response."""


class ReplicaClosed(ConnectionError):
    """The replica closed the connection before its answer was whole."""


class ConnectTimeout(TimeoutError):
    pass


class ReadTimeout(TimeoutError):
    """No byte came for the read timeout while one was awaited."""


class CallTimeout(TimeoutError):
    """The call did not end within its whole-call limit."""


class Target:
    """A replica URL, parsed once: where to connect and the header lines every request to it carries."""

    __slots__ = ("key", "host", "port", "tls", "prefix", "fixed")

    def __init__(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise BadURL(f"unparsable URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadURL(f"not an http(s) URL with a host (scheme {parts.scheme!r})")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.tls else 80)
        self.key = (self.host, self.port, self.tls)
        self.prefix = parts.path.rstrip("/").encode()
        try:
            authority = parts.netloc.rpartition("@")[2].encode("ascii")
        except UnicodeEncodeError:
            try:
                authority = parts.netloc.rpartition("@")[2].encode("idna")  # an internationalised host name
            except UnicodeError as exc:
                raise BadURL(f"host name not encodable: {exc}") from None
        fixed = b"host: " + authority + b"\r\naccept-encoding: identity\r\n"
        if parts.username is not None or parts.password is not None:
            secret = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
            fixed += b"authorization: Basic " + base64.b64encode(secret) + b"\r\n"
        self.fixed = fixed

    def request(self, method: bytes, path: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
        """The request's bytes. Header values come from a parsed request or from us: no CR or LF."""
        head = [method, b" ", self.prefix, path.encode(), b" HTTP/1.1\r\n", self.fixed]
        for name, value in headers.items():
            head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        if body is None:
            head.append(b"\r\n")
            return b"".join(head)
        head += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        return b"".join(head)


class Connection(asyncio.Protocol):
    """One connection to a replica, carrying one exchange (request, response) at a time."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool]) -> None:
        self._pool = pool
        self.key = key
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.uses = 0
        self.closed = False
        self.status = 0
        self.content_type = b""
        self._framed = False  # content-length or chunked: the body does not end with the connection
        self._interim = False  # parsing a 1xx response, which is not the answer
        self._head = False  # the answer's status line and headers are in
        self._done = False  # ... and its whole body
        self._keep_alive = False
        self._got_bytes = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._read_timeout_s = 0.0
        self._last_data = 0.0

    # The exchange, driven by `proxy.upstream`

    def send(self, request: bytes, call_timeout_s: float, read_timeout_s: float) -> None:
        """Start an exchange: the request goes out, the time limits start."""
        assert self._transport is not None and not self.closed
        self.uses += 1
        self.status = 0
        self.content_type = b""
        self._framed = self._interim = self._head = self._done = self._keep_alive = self._got_bytes = False
        self._chunks = []
        self._buffered = 0
        self._error = None
        now = self._loop.time()
        self._deadline = now + call_timeout_s
        self._read_timeout_s = read_timeout_s
        self._last_data = now
        self._timer = self._loop.call_at(min(self._deadline, now + read_timeout_s), self._on_timer)
        self._transport.write(request)

    @property
    def untouched(self) -> bool:
        """No byte of an answer came: the request may be sent again elsewhere."""
        return not self._got_bytes

    @property
    def reusable(self) -> bool:
        """The answer is whole and the replica keeps the connection open."""
        return self._done and self._keep_alive and self._error is None and not self.closed

    async def response_head(self) -> None:
        """Wait for the answer's status line and headers."""
        while not self._head:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def body_part(self) -> bytes:
        """The body's bytes that came since the last call; b"" once the body is whole."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                self._buffered = 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._last_data = self._loop.time()  # the silence starts now, not when reading paused
                    self._transport.resume_reading()
                return data
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()

    def abort(self) -> None:
        """Drop the connection at once: a replica aborts the request whose connection is gone."""
        if self._transport is not None and not self.closed:
            self._transport.abort()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = error
        self._stop_timer()
        self.abort()
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._done or self._error is not None:
            return
        now = self._loop.time()
        if now >= self._deadline:
            self._fail(CallTimeout("the call did not end in time"))
            return
        due = self._deadline
        if not self._paused:  # a paused socket is the consumer's doing, not the replica's silence
            silent_until = self._last_data + self._read_timeout_s
            if now >= silent_until:
                self._fail(ReadTimeout(f"no byte from the replica for {self._read_timeout_s:g} s"))
                return
            due = min(due, silent_until)
        self._timer = self._loop.call_at(due, self._on_timer)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one in all but its class

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._done:  # bytes after a whole answer: the answer stands, the connection does not
                self._keep_alive = False
                self.abort()
            else:
                self._fail(BadResponse(f"unparsable response: {exc}"))
            return
        if self._chunks or self._done:
            if self._buffered > HIGH_WATER and not self._paused and not self._done and self._transport is not None:
                self._paused = True
                self._transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport; `connection_lost` decides what the end means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        self._stop_timer()
        if self._done or self._error is not None:
            self._wake()
            return
        if self._head and not self._framed and exc is None:
            self._done = True  # a body that ends with the connection, and it ended
            self._wake()
            return
        where = "mid-response" if self._head else "before answering"
        error = ReplicaClosed(f"the replica closed the connection {where}")
        if exc is not None:
            error.__cause__ = exc
        self._fail(error)

    # httptools' callbacks (called from `feed_data`)

    def on_message_begin(self) -> None:
        if self._done:  # a second message on a connection that carries one at a time: not reused
            self._keep_alive = False
            return
        self.content_type = b""
        self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer follows
            self._interim = True
            return
        self.status = status
        self._head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self._done:
            self._chunks.append(body)
            self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._done:
            return
        self._done = True
        self._keep_alive = self._parser.should_keep_alive()
        self._stop_timer()


class Pool:
    """Connections to replicas: at most `limit` in use at once, idle ones kept for `keepalive_s`."""

    def __init__(self, *, limit: int, keepalive_s: float, connect_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._ssl_context = ssl_context
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._idle: dict[tuple[str, int, bool], deque[Connection]] = {}
        self._closed = False

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def idle(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def connection(self, target: Target, *, fresh: bool = False) -> Connection:
        """A connection to `target`, counted in use until `release`: an idle one unless `fresh`."""
        if self._closed:
            raise ReplicaClosed("the proxy is shutting down")
        await self._take_slot()
        try:
            connection = None if fresh else self._idle_connection(target.key)
            return connection if connection is not None else await self._open(target)
        except BaseException:
            self._give_slot()
            raise

    def release(self, connection: Connection) -> None:
        """Give a connection back: kept for reuse if its exchange ended cleanly, else dropped."""
        self._give_slot()
        if connection.reusable and not self._closed:
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.setdefault(connection.key, deque()).append(connection)
        else:
            connection.abort()

    def forget(self, connection: Connection) -> None:
        """A connection closed: out of the idle ones if it was there."""
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in list(idle):
                connection.abort()
        self._idle.clear()

    async def _take_slot(self) -> None:
        if self._in_use < self._limit and not self._waiters:
            self._in_use += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # a released slot is handed over: `_in_use` already counts it
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._give_slot()  # handed over as we were cancelled: hand it on
            else:
                self._waiters.remove(waiter)
            raise

    def _give_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._in_use -= 1

    def _idle_connection(self, key: tuple[str, int, bool]) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_kept = asyncio.get_running_loop().time() - self._keepalive_s
        while idle and idle[0].idle_since < oldest_kept:
            idle.popleft().abort()
        return idle.pop() if idle else None  # the most recently used: the others may expire

    async def _open(self, target: Target) -> Connection:
        loop = asyncio.get_running_loop()
        if target.tls and self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, target.key), target.host, target.port,
                    ssl=self._ssl_context if target.tls else None,
                    server_hostname=target.host if target.tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self._connect_timeout_s:g} s") from None
        return connection
