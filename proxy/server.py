"""The proxy's HTTP connections: uvicorn's httptools protocol, with time limits on receiving requests.

uvicorn times a connection out only once a response ended (`timeout_keep_alive`), and any byte
the client sends stops that timer: a connection that never sends a whole request lives forever,
and an ASGI app never sees a header block that is still arriving. Here, per connection:

- idle: `proxy.keep_alive_s` from the connection's opening as well as from each response's end;
- header block: whole within `limits.header_timeout_s` of the opening, or of a later request's
  first byte; else the connection is closed, with a 408 when part of a request came;
- body: whole within `limits.body_timeout_s` of its headers. The app answers that one (a 408 in
  OpenAI's shape, recorded when a relayed call; `proxy.limits.read_body`); here the connection
  is only closed once that answer is sent, rather than left to read the rest of the body.

A response takes as long as it takes: no limit here applies while one is being sent.
This is the one module that knows uvicorn's protocol internals (checked against uvicorn 0.55).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from shared.errors import RequestTimeout
from shared.settings import LimitSettings

__all__ = ["protocol_class"]

logger = logging.getLogger(__name__)

_IDLE, _HEAD, _BODY = 0, 1, 2  # what the connection waits for: a new request, its header block, its body


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header, body and idle timers described above."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._phase = _HEAD
        self._has_request_bytes = False  # part of a request's header block came
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)
        # uvicorn arms its idle timer only after a response; the first byte that comes stops it.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_header_timer()
        self._cancel_body_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Timers are armed only for what is still missing once the bytes that came are parsed:
        # a request that arrives whole in one read (nearly all of them) arms none.
        if self._phase == _HEAD:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)
        elif self._phase == _BODY and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)

    # Parser callbacks (called from `data_received`, in order, for each request in the bytes)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._has_request_bytes = True

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._has_request_bytes = False
        cycle = self.cycle
        super().on_headers_complete()
        # No new cycle: a WebSocket upgrade took the connection over; it is no longer ours to time.
        self._phase = _BODY if self.cycle is not cycle else _IDLE

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        self._phase = _IDLE
        super().on_message_complete()

    # Timers

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request still arriving while a response is sent: the response ends whole,
            # then the connection closes.
            self.cycle.keep_alive = False
            return
        if self._has_request_bytes:
            logger.debug("%s: request header block not whole within %g s; closed", self.client, self.header_timeout_s)
            self._send_408(f"request header block not received within {self.header_timeout_s:g} s "
                           "(proxy.limits.header_timeout_s)")
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is None:
            return
        if self.cycle.response_complete:
            self.transport.close()  # answered without the rest of the body: nothing waits for it
        else:
            self.cycle.keep_alive = False  # the app answers (408 from `read_body`); then the connection closes

    def _send_408(self, message: str) -> None:
        body = orjson.dumps(RequestTimeout(message, code="header_timeout").body())
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)


def protocol_class(limits: LimitSettings) -> type[asyncio.Protocol]:
    """The protocol uvicorn serves connections with (`uvicorn.Config(http=...)`), timed by `limits`."""
    class Timed(TimedHttpProtocol):
        header_timeout_s = limits.header_timeout_s
        body_timeout_s = limits.body_timeout_s

    return Timed
