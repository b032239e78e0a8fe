"""Relaying a server-sent event stream to the client, chunk by chunk, recorded whatever happens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from shared.types import CallStatus

__all__ = ["RelayStream"]


class _SourceFailed(Exception):
    """The stream's source (the replica) failed; its error is the `__cause__`."""


class RelayStream(Response):
    """An ASGI response that relays a stream as it arrives and always finishes the call.

    Not a `StreamingResponse` over a generator: a generator abandoned at `yield` when the
    client leaves is finalised whenever the garbage collector gets to it. Here a watcher
    on `receive()` notices the disconnect and cancels the relay; then `close()` drops the
    replica's connection (vLLM aborts the request) and `finish()` records the call, all
    before this returns. A failing source ends the stream with a final error event: bytes
    have reached the client already, so no other replica may be tried.

    `seal(kept, truncated)` runs before the stream's end reaches the client (before the
    terminal event, which the route's `is_terminal` finds in a chunk (`proxy.formats`), or
    the empty last body message): the call's record is journaled by the
    time the client can see the call complete, so a crash after that point loses nothing.

    The record keeps the stream's first `max_kept_bytes`; once a chunk goes past them
    (`truncated`), `read_cut` is given the whole stream, from its first byte (an event may
    straddle the cut), chunk by chunk as it passes, so the record's token fields can still
    be those of the whole answer. An uncut stream never calls it.
    """

    def __init__(
        self,
        call: object,
        chunks: AsyncIterator[bytes],
        *,
        status_code: int,
        headers: list[tuple[bytes, bytes]],
        max_kept_bytes: int,
        close: Callable[[], None],
        on_source_error: Callable[[BaseException], dict[str, object]],
        seal: Callable[[bytes, bool], Awaitable[None]],
        finish: Callable[[bytes, bool], Awaitable[None]],
        read_cut: Callable[[bytes], None],
        is_terminal: Callable[[bytes], bool],
    ) -> None:
        self._call = call
        self._chunks = chunks
        self.status_code = status_code
        self.raw_headers = headers
        self.background = None
        self._max_kept = max_kept_bytes
        self._close = close
        self._on_source_error = on_source_error
        self._seal = seal
        self._finish = finish
        self._read_cut = read_cut
        self._is_terminal = is_terminal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Plain asyncio rather than an anyio task group: the group (scopes, task wrappers,
        # cancellation delivery) cost ~10% of the proxy's CPU per streamed call.
        call = self._call
        is_complete = False
        left = False  # the client left before the end and the watcher cancelled the relay
        kept: list[bytes] = []
        kept_bytes = 0
        truncated = False
        watcher: asyncio.Task[None] | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            relay = asyncio.current_task()
            assert relay is not None

            async def watch_disconnect() -> None:
                nonlocal left
                message: Message = await receive()
                while message["type"] != "http.disconnect":
                    message = await receive()
                if not is_complete:
                    call.fail(CallStatus.CLIENT_DISCONNECTED,  # type: ignore[attr-defined]
                              {"message": "client disconnected before the response ended",
                               "type": "client_disconnected"})
                    left = True
                    relay.cancel()

            watcher = asyncio.get_running_loop().create_task(watch_disconnect())
            chunks = self._chunks.__aiter__()
            is_terminal = self._is_terminal  # the call's format's (`proxy.formats`); a local: runs per chunk
            try:
                try:
                    while True:
                        try:
                            chunk = await chunks.__anext__()
                        except StopAsyncIteration:
                            break
                        except Exception as exc:  # noqa: BLE001 - any source failure ends the stream alike
                            raise _SourceFailed from exc
                        if not truncated and kept_bytes + len(chunk) <= self._max_kept:
                            kept.append(chunk)
                            kept_bytes += len(chunk)
                        else:
                            if not truncated:
                                for piece in kept:
                                    self._read_cut(piece)
                            truncated = True
                            self._read_cut(chunk)
                        if is_terminal(chunk):
                            # Clients hang up on the terminal event without waiting for the
                            # source to close: from here on, leaving is not a disconnect.
                            is_complete = True
                            await self._seal(b"".join(kept), truncated)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if not is_complete:
                        is_complete = True
                        await self._seal(b"".join(kept), truncated)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except _SourceFailed as failed:
                    # Only the replica's side counts here: our own errors (the seal, the client's
                    # socket) must never be blamed on the replica (and get it ejected).
                    is_complete = True
                    error = self._on_source_error(failed.__cause__ or failed)
                    event = b"data: " + orjson.dumps({"error": error}) + b"\n\n"
                    if not truncated:
                        kept.append(event)  # the record keeps the bytes the client got, this event too
                    await send({"type": "http.response.body", "body": event, "more_body": False})
            except asyncio.CancelledError:
                # Our own watcher's cancel ends the relay (the call is recorded below); any
                # other cancellation (server shutdown) goes on up once the call is recorded.
                if not left or relay.uncancel() > 0:
                    if not left and not is_complete:
                        call.fail(CallStatus.INTERRUPTED,  # type: ignore[attr-defined]
                                  {"message": "the proxy shut down before the stream ended",
                                   "type": "interrupted", "code": "proxy_shutdown"})
                    raise
        finally:
            # Cancelled before anything else can run: from here on the watcher cannot cancel us.
            if watcher is not None:
                watcher.cancel()
            self._close()
            with anyio.CancelScope(shield=True):
                await self._finish(b"".join(kept), truncated)
