"""A small real HTTP load balancer for tests: each request goes to the next backend in turn.

Raw ASGI (served by uvicorn through `serve_in_thread`), forwarding with aiohttp and
streaming the answer back chunk by chunk, so a streamed call is cut when its backend dies,
as behind nginx. A backend that cannot be reached answers 502. `served` maps each call id
(`x-rolltap-call-id`) to the backend that answered it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import aiohttp

_HOP_BY_HOP = {b"host", b"connection", b"content-length", b"transfer-encoding", b"keep-alive"}
_SKIP_BACK = {"connection", "content-length", "transfer-encoding", "keep-alive", "date", "server"}


class RoundRobin:
    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self.served: dict[str, str] = {}
        self.requests: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._session is not None:
                        await self._session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        backend = self.backends[next(self._turn) % len(self.backends)]
        self.requests[backend] += 1
        if self._session is None:
            # keep-alive below uvicorn's 5 s, or a request may go out on a connection the proxy is closing
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=120))
        url = backend + scope["raw_path"].decode() + ("?" + scope["query_string"].decode()
                                                      if scope["query_string"] else "")
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in _HOP_BY_HOP}
        try:
            async with self._session.request(scope["method"], url, data=body, headers=headers) as resp:
                call_id = resp.headers.get("x-rolltap-call-id")
                if call_id:
                    self.served[call_id] = backend
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(k.lower().encode(), v.encode()) for k, v in resp.headers.items()
                                        if k.lower() not in _SKIP_BACK]})
                try:
                    async for chunk in resp.content.iter_any():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except (aiohttp.ClientError, OSError):
                    return  # the backend died mid-answer: the client sees the connection cut
                await send({"type": "http.response.body", "body": b""})
        except (aiohttp.ClientError, OSError) as exc:
            text = f'{{"error": {{"message": "backend {backend} unreachable: {exc.__class__.__name__}"}}}}'
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": text.encode()})
