"""Relaying a server-sent event stream to the client, chunk by chunk, recorded whatever happens."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from shared.errors import RolltapError

if TYPE_CHECKING:
    from proxy.call import CallState
    from proxy.relay import Relay
    from proxy.upstream import UpstreamResponse

__all__ = ["RelayStream"]


class RelayStream(Response):
    """An ASGI response that relays a stream as it arrives and always records the call.

    Not a `StreamingResponse` over a generator: a generator abandoned at `yield` when the
    client leaves is finalised whenever the garbage collector gets to it. Here a watcher
    on `receive()` notices the disconnect and cancels the relay; then the source's
    connection is dropped (vLLM aborts the request) and the call recorded, all before this
    returns. A failing source ends the stream with a final error event: bytes have reached
    the client already, so no other replica may be tried.

    The call is sealed (`Relay.seal`: its record journaled) before the stream's end reaches
    the client (before the terminal event, which the route's format finds in a chunk, or the
    empty last body message), so a crash
    after that point loses nothing; `Relay.record` queues it once the stream is over.
    """

    def __init__(self, relay: Relay, call: CallState, source: UpstreamResponse,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self._relay = relay
        self._call = call
        self._source = source
        self.status_code = 200
        self.raw_headers = headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Plain asyncio rather than an anyio task group: the group (scopes, task wrappers,
        # cancellation delivery) cost ~10% of the proxy's CPU per streamed call.
        call = self._call
        is_complete = False
        left = False  # the client left before the end and the watcher cancelled the relay
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
                    call.client_left("the response ended")
                    left = True
                    relay.cancel()

            watcher = asyncio.get_running_loop().create_task(watch_disconnect())
            chunks = self._source.aiter().__aiter__()
            is_terminal = call.format.is_terminal  # the route's end marker (`proxy.formats`), looked up once
            try:
                while True:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    except Exception as exc:  # noqa: BLE001 - any source failure ends the stream alike
                        # The source's errors are ours already (mapped where they arise); anything
                        # else is a bug of ours, ended the same way but never blamed on the replica.
                        is_complete = True
                        failed = exc if isinstance(exc, RolltapError) else RolltapError(
                            f"proxy error while relaying the stream: {exc.__class__.__name__}")
                        await send({"type": "http.response.body", "body": call.stream_failed(failed),
                                    "more_body": False})
                        return
                    call.keep_chunk(chunk)
                    if is_terminal(chunk):
                        # Clients hang up on the terminal event without waiting for the
                        # source to close: from here on, leaving is not a disconnect.
                        is_complete = True
                        await self._relay.seal(call)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if not is_complete:
                    is_complete = True
                    await self._relay.seal(call)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except asyncio.CancelledError:
                # Our own watcher's cancel ends the relay (the call is recorded below); any
                # other cancellation (server shutdown) goes on up once the call is recorded.
                if not left or relay.uncancel() > 0:
                    if not left and not is_complete:
                        call.interrupted("the stream")
                    raise
        finally:
            # Cancelled before anything else can run: from here on the watcher cannot cancel us.
            if watcher is not None:
                watcher.cancel()
            self._source.release()  # dropped unless it came whole: the replica aborts the request
            with anyio.CancelScope(shield=True):
                await self._relay.record(call)
