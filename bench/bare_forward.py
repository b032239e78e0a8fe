"""The least a Python relay can do on the proxy's stack: `bare` in `bench.proxy_overhead`.

A Starlette route under uvicorn (uvloop + httptools) forwarding `POST /v1/chat/completions`
(and `/v1/completions`) to one replica through ONE shared `aiohttp.ClientSession` set up as
the proxy's was until 2026-12-07: explicit timeouts, a connection cap, keep-alive below
vLLM's, identity encoding, no cookie jar. No parsing beyond the `stream` flag, no recording:
Rolltap's CPU per call over this one's is issue 23's measure of what recording and routing cost.

`--client rolltap` forwards through the proxy's own client instead (`proxy.upstream`, on
`proxy.http1`): the same relay with what Rolltap sends upstream with, so a ratio against it
counts recording and routing alone, not the client.

(aiohttp was chosen over httpx for the proxy by a benchmark of both clients behind this same
app, `bench/upstream_client.py`, retired once decided: docs/benchmarks.md has its results and
the commit that last held it.)

    python -m bench.bare_forward --upstream http://127.0.0.1:8001 --port 8100 [--client rolltap]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import yarl

from bench.harness import REPO_ROOT, listen, stop_process, wait_ready

__all__ = ["BareForward", "build_app", "build_rolltap_client_app", "start_bare_forward"]

# The proxy's client settings (shared/settings.py's defaults for `proxy.*_timeout_s`).
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # per socket read: a non-streamed generation sends nothing until done
POOL_TIMEOUT_S = 30.0
KEEPALIVE_EXPIRY_S = 4.0  # below vLLM's 5 s idle keep-alive: never reuse a socket it is closing
UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


def _relay_app(completions: Any, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> Any:
    """The Starlette app both relays share: the two completion routes on `completions`, a health
    route, and the client's `start` and `stop` around the app's life (inside the running loop)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def health(request: Request) -> Response:
        return Response(b"", 200)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await start()
        try:
            yield
        finally:
            await stop()

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health, methods=["GET"])], lifespan=lifespan)


async def _nothing() -> None:
    return None


def build_rolltap_client_app(upstream: str, max_connections: int) -> Any:
    """The same relay on `proxy.upstream.Upstream`: status, content type and bytes passed on as they come."""
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

    from proxy.upstream import JSON_HEADERS, Upstream
    from shared.settings import ProxySettings

    client = Upstream(ProxySettings(max_connections=max_connections))

    async def completions(request: Request) -> Response:
        body = await request.body()
        r = await client.post(upstream, request.url.path, body, JSON_HEADERS)
        if orjson.loads(body).get("stream") is not True or not r.is_stream:
            return Response(await r.read(), r.status, media_type=r.content_type)

        async def release() -> None:  # async on purpose: Starlette runs a sync one in a thread
            r.release()

        return StreamingResponse(r.aiter(), r.status, media_type=r.content_type, background=BackgroundTask(release))

    return _relay_app(completions, _nothing, client.close)


def build_app(upstream: str, max_connections: int) -> Any:
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

    state: dict[str, aiohttp.ClientSession] = {}
    urls: dict[str, yarl.URL] = {}

    def url_of(path: str) -> yarl.URL:
        url = urls.get(path)
        if url is None:
            url = urls[path] = yarl.URL(upstream + path)
        return url

    async def completions(request: Request) -> Response:
        body = await request.body()
        session = state["session"]
        if orjson.loads(body).get("stream") is not True:
            async with session.post(url_of(request.url.path), data=body) as r:
                return Response(await r.read(), r.status, media_type=r.headers.get("content-type"))
        r = await session.post(url_of(request.url.path), data=body)
        if r.status != 200:
            data = await r.read()
            r.release()
            return Response(data, r.status, media_type=r.headers.get("content-type"))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.content.iter_any():
                    yield chunk
            finally:
                r.release()

        async def release() -> None:  # async on purpose: Starlette runs a sync one in a thread
            r.release()

        return StreamingResponse(chunks(), r.status, media_type=r.headers.get("content-type"),
                                 background=BackgroundTask(release))

    async def start() -> None:  # the connector binds to the running loop
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0,
                                           keepalive_timeout=KEEPALIVE_EXPIRY_S, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, connect=POOL_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S,
                                          sock_read=READ_TIMEOUT_S),
            headers=UPSTREAM_HEADERS, auto_decompress=False, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())

    async def stop() -> None:
        await state["session"].close()

    return _relay_app(completions, start, stop)


@dataclasses.dataclass
class BareForward:
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        stop_process(self.proc)


def start_bare_forward(upstream: str, max_connections: int, client: str = "aiohttp") -> BareForward:
    """Serve the relay on `client` in a child process on a socket bound here; return once it answers."""
    sock = listen()
    port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "bench.bare_forward", "--upstream", upstream, "--fd", str(sock.fileno()),
           "--max-connections", str(max_connections), "--parent-pid", str(os.getpid()), "--client", client]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    finally:
        sock.close()
    forward = BareForward(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(forward.url, "/health", proc, 20.0)
    except BaseException:
        forward.stop()
        raise
    return forward


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from bench.instant_replica import exit_with_parent

    parser = argparse.ArgumentParser(prog="python -m bench.bare_forward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--fd", type=int, default=None, help="serve on this inherited listening socket")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--client", choices=("aiohttp", "rolltap"), default="aiohttp",
                        help="aiohttp (issue 23's reference) or the proxy's own client (proxy.upstream)")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else socket.create_server(
        ("127.0.0.1", args.port), backlog=2048)
    build = build_rolltap_client_app if args.client == "rolltap" else build_app
    config = uvicorn.Config(build(args.upstream.rstrip("/"), args.max_connections), loop="uvloop",
                            http="httptools", lifespan="on", access_log=False, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
