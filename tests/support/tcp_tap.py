"""A TCP forwarder on loopback that a test can cut and restore: a database outage on demand.

    with TcpTap("127.0.0.1", 5432) as tap:   # point clients at 127.0.0.1:tap.port
        tap.cut()      # listener closed (new connections refused), open connections aborted
        tap.restore()  # listening again on the same port

Runs its own asyncio loop in a daemon thread, so it serves whatever thread the client is in.
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType
from typing import Any

__all__ = ["TcpTap"]


class TcpTap:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections_total = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-tap", daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    # -- control, from the test's thread ----------------------------------------------------

    def start(self) -> TcpTap:
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    def stop(self) -> None:
        self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def is_cut(self) -> bool:
        return self._server is None

    def __enter__(self) -> TcpTap:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # -- the loop's side ------------------------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        for writer in list(self._open):
            writer.transport.abort()  # an RST, as when a database host vanishes
        self._open.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._server is None:
            client_w.transport.abort()
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self.connections_total += 1
        self._open |= {client_w, upstream_w}
        try:
            await asyncio.gather(self._pump(client_r, upstream_w), self._pump(upstream_r, client_w))
        finally:
            for writer in (client_w, upstream_w):
                writer.transport.abort()
                self._open.discard(writer)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.transport.abort()  # one side gone: the other goes too
