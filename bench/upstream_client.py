"""Benchmark: which upstream HTTP client should the forwarding proxy use?

This module owns the httpx-vs-aiohttp decision for the proxy -> vLLM hop. It

1. starts an instant replica (``bench.instant_replica``) in its own process;
2. starts one minimal forwarding app per client under uvicorn (uvloop +
   httptools), each in its own process. The app is a Starlette route that
   forwards ``POST /v1/chat/completions`` to the replica through ONE shared
   client (``httpx.AsyncClient`` or ``aiohttp.ClientSession``) configured the
   way we would configure it in production (explicit timeouts, connection
   limits, keep-alive, identity encoding). Streams are passed through as raw
   upstream bytes (httpx ``aiter_raw()`` / aiohttp ``content.iter_any()``);
3. drives load with ``wrk`` (C, one thread, so it stays off the proxy's core
   as much as possible on a 2-core box) at each concurrency, streamed and
   non-streamed, against the replica directly and through each forwarder,
   interleaving targets so background noise hits all of them alike;
4. prints requests/s, p50/p99 latency, the forwarder's CPU time per request
   (from /proc, the number least disturbed by other load on the machine) and
   ratios versus the direct path.

The forwarders do nothing but forward, so the gap to "direct" is the cost of
uvicorn + Starlette + the client library; the gap between the two forwarders is
the client library alone.

Usage (from the repository root)::

    python -m bench.upstream_client                      # full matrix, 6 s cells
    python -m bench.upstream_client --duration 10 --repeat 3
    python -m bench.upstream_client serve --client httpx --upstream URL --port P   # forwarder only

Requires ``wrk`` on PATH (``apt-get install -y wrk``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson

ClientKind = Literal["httpx", "aiohttp", "httpx2", "none"]
# httpx2 (pydantic's fork of httpx, pulled in by recent `openai` releases) is an
# optional third candidate: same API, reworked connection pool. "none" is the
# floor: the same uvicorn + Starlette app replaying a cached upstream response
# without any upstream I/O, so "client X - none" is what client X itself costs.
# Neither runs by default.
CLIENTS: tuple[ClientKind, ...] = ("httpx", "aiohttp", "httpx2", "none")
DEFAULT_CLIENTS: tuple[ClientKind, ...] = ("httpx", "aiohttp")
REPO_ROOT = Path(__file__).resolve().parent.parent

# --- production-shaped client settings, shared by both forwarders ---------------
# Connect fast-fails: a replica that does not accept within 5 s is down.
CONNECT_TIMEOUT_S = 5.0
# Read timeout is per socket read, not per request. A non-streamed generation
# sends nothing until it is done, so this bounds the longest generation we accept.
READ_TIMEOUT_S = 600.0
WRITE_TIMEOUT_S = 30.0
# How long a request may wait for a free pooled connection (httpx only; aiohttp
# folds this into its connect timeout).
POOL_TIMEOUT_S = 30.0
# Must stay BELOW the replica's idle keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
# default 5 s): otherwise the client may reuse a socket the server is closing and
# the (non-idempotent, so never retried) POST fails with a disconnect error.
KEEPALIVE_EXPIRY_S = 4.0
DEFAULT_MAX_CONNECTIONS = 256
# Ask for an uncompressed body: the proxy must parse what it records, and vLLM
# does not compress anyway, so compression could only add cost.
UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


# =============================================================================
# Forwarding app (runs in a child process under uvicorn)
# =============================================================================


class Forwarder(Protocol):
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def forward(self, path: str, body: bytes) -> Any: ...
    async def stream(self, path: str, body: bytes) -> Any: ...


class HttpxForwarder:
    """One shared ``httpx.AsyncClient`` (HTTP/1.1, pooled, keep-alive).

    ``module`` is "httpx" or "httpx2" (API-compatible fork).
    """

    def __init__(self, upstream: str, max_connections: int, module: str = "httpx") -> None:
        import importlib

        self._httpx = importlib.import_module(module)
        self._upstream = upstream
        self._max_connections = max_connections
        self._client: Any = None
        self._urls: dict[str, Any] = {}

    async def start(self) -> None:
        httpx = self._httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, write=WRITE_TIMEOUT_S, pool=POOL_TIMEOUT_S
            ),
            # max_keepalive_connections defaults to 20: above 20 concurrent
            # requests every extra connection would be closed after use and
            # reopened on the next request. Keep it equal to max_connections.
            limits=httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            headers=UPSTREAM_HEADERS,
            # trust_env=False: no HTTP(S)_PROXY/NO_PROXY/SSL_CERT_* lookups for an
            # in-cluster hop (a stray HTTP_PROXY would silently reroute it).
            trust_env=False,
            follow_redirects=False,
        )

    def _url(self, path: str) -> Any:
        # Pre-parsed URL objects: httpx otherwise re-parses/joins the URL per request.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self._httpx.URL(self._upstream + path)
        return url

    async def close(self) -> None:
        await self._client.aclose()

    async def forward(self, path: str, body: bytes) -> Any:
        from starlette.responses import Response

        r = await self._client.post(self._url(path), content=body)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def stream(self, path: str, body: bytes) -> Any:
        from starlette.background import BackgroundTask
        from starlette.responses import Response, StreamingResponse

        r = await self._client.send(self._client.build_request("POST", self._url(path), content=body), stream=True)
        if r.status_code != 200:
            await r.aread()
            await r.aclose()
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        # background=aclose as well: if the downstream client disconnects the
        # generator may never be resumed, and the pooled connection must be freed.
        return StreamingResponse(
            chunks(), r.status_code, media_type=r.headers.get("content-type"), background=BackgroundTask(r.aclose)
        )


class NullForwarder:
    """No upstream I/O: replays the first upstream response seen for each request body.

    Streams are replayed one SSE event per ASGI send, the arrival pattern of an
    unloaded replica, so this is the framework's cost with per-event sends.
    """

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._cache: dict[tuple[str, bytes], tuple[int, str, list[bytes]]] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _fetch(self, path: str, body: bytes) -> tuple[int, str, list[bytes]]:
        host, port = self._upstream.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("POST", path, body, UPSTREAM_HEADERS)
            resp = conn.getresponse()
            data = resp.read()
            ctype = resp.getheader("content-type", "")
            if not ctype.startswith("text/event-stream"):
                return resp.status, ctype, [data]
            return resp.status, ctype, [e + b"\n\n" for e in data.split(b"\n\n") if e]
        finally:
            conn.close()

    async def _get(self, path: str, body: bytes) -> tuple[int, str, list[bytes]]:
        import asyncio

        key = (path, body)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = await asyncio.to_thread(self._fetch, path, body)
        return hit

    async def forward(self, path: str, body: bytes) -> Any:
        from starlette.responses import Response

        status, ctype, events = await self._get(path, body)
        return Response(b"".join(events), status, media_type=ctype)

    async def stream(self, path: str, body: bytes) -> Any:
        from starlette.responses import StreamingResponse

        status, ctype, events = await self._get(path, body)

        async def chunks() -> AsyncIterator[bytes]:
            for e in events:
                yield e

        return StreamingResponse(chunks(), status, media_type=ctype)


class AiohttpForwarder:
    """One shared ``aiohttp.ClientSession`` over one ``TCPConnector``."""

    def __init__(self, upstream: str, max_connections: int) -> None:
        import aiohttp
        import yarl

        self._aiohttp = aiohttp
        self._yarl = yarl
        self._upstream = upstream
        self._max_connections = max_connections
        self._session: Any = None
        self._urls: dict[str, Any] = {}

    async def start(self) -> None:
        aiohttp = self._aiohttp
        # Must be created inside the running loop (the connector binds to it).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,  # one replica per session here; `limit` is the cap
                keepalive_timeout=KEEPALIVE_EXPIRY_S,  # default 15 s > vLLM's 5 s
                ttl_dns_cache=300,
            ),
            # The default ClientTimeout(total=300) would kill long generations and
            # long streams; bound connect and per-read instead.
            timeout=aiohttp.ClientTimeout(
                total=None, connect=POOL_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
            ),
            headers=UPSTREAM_HEADERS,
            # We want the bytes vLLM sent: never let aiohttp transparently
            # decompress (or, with identity, never have to).
            auto_decompress=False,
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy must not keep upstream cookies
        )

    def _url(self, path: str) -> Any:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self._yarl.URL(self._upstream + path)
        return url

    async def close(self) -> None:
        await self._session.close()

    async def forward(self, path: str, body: bytes) -> Any:
        from starlette.responses import Response

        async with self._session.post(self._url(path), data=body) as r:
            data = await r.read()
            return Response(data, r.status, media_type=r.headers.get("content-type"))

    async def stream(self, path: str, body: bytes) -> Any:
        from starlette.background import BackgroundTask
        from starlette.responses import Response, StreamingResponse

        r = await self._session.post(self._url(path), data=body)
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

        async def release() -> None:
            # An async wrapper on purpose: Starlette runs a *sync* background
            # callable in a worker thread, a thread hop per request.
            r.release()

        return StreamingResponse(
            chunks(), r.status, media_type=r.headers.get("content-type"), background=BackgroundTask(release)
        )


def build_app(client: ClientKind, upstream: str, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> Any:
    """The minimal forwarding app: what a tracing proxy is before it records anything."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    fwd: Forwarder
    if client == "aiohttp":
        fwd = AiohttpForwarder(upstream, max_connections)
    elif client == "none":
        fwd = NullForwarder(upstream)
    else:
        fwd = HttpxForwarder(upstream, max_connections, module=client)

    async def completions(request: Request) -> Response:
        body = await request.body()
        # A real proxy parses the request to record it; do the same so that the
        # stream/non-stream decision costs what it will cost in production.
        stream = orjson.loads(body).get("stream") is True
        path = request.url.path
        return await (fwd.stream(path, body) if stream else fwd.forward(path, body))  # type: ignore[no-any-return]

    async def health(request: Request) -> Response:
        return Response(b"", 200)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await fwd.start()
        try:
            yield
        finally:
            await fwd.close()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def serve_forwarder(client: ClientKind, upstream: str, sock: socket.socket, max_connections: int) -> None:
    import uvicorn

    config = uvicorn.Config(
        build_app(client, upstream, max_connections),
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )
    uvicorn.Server(config).run(sockets=[sock])


# =============================================================================
# Process management and load generation (benchmark process)
# =============================================================================


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    return sock


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"forwarder exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("forwarder not healthy")
        time.sleep(0.05)


@dataclasses.dataclass
class Forwarding:
    client: ClientKind
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_forwarder(client: ClientKind, upstream: str, max_connections: int) -> Forwarding:
    """Run ``build_app(client, upstream)`` under uvicorn in a child process."""
    sock = _listen()
    port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "bench.upstream_client", "serve", "--client", client, "--upstream", upstream]
    cmd += ["--fd", str(sock.fileno()), "--max-connections", str(max_connections), "--parent-pid", str(os.getpid())]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    finally:
        sock.close()
    fwd = Forwarding(client, f"http://127.0.0.1:{port}", proc)
    try:
        _wait_healthy(port, proc)
    except BaseException:
        fwd.stop()
        raise
    return fwd


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux only)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# wrk's Lua `done` hook hands us exact percentiles; print them as one JSON line.
_WRK_LUA = r"""
wrk.method = "POST"
wrk.body = os.getenv("RT_BENCH_BODY")
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RT_RESULT {"requests":%d,"duration_us":%d,"errors":%d,"non2xx":%d,' ..
    '"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


def run_wrk(url: str, body: bytes, concurrency: int, duration_s: int, lua_path: str) -> dict[str, float]:
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{duration_s}s", "--timeout", "10s", "-s", lua_path, url]
    env = dict(os.environ, RT_BENCH_BODY=body.decode())
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("RT_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    res: dict[str, float] = orjson.loads(line.removeprefix("RT_RESULT "))
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    return res


@dataclasses.dataclass
class Cell:
    mode: str  # "non-stream" | "stream"
    concurrency: int
    target: str  # "direct" | client name
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_req: float | None  # forwarder CPU; None for direct
    errors: int


def _body(stream: bool, max_tokens: int) -> bytes:
    req: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say something."},
        ],
        "max_tokens": max_tokens,
        "logprobs": True,
        "return_token_ids": True,
    }
    if stream:
        req["stream"] = True
    return orjson.dumps(req)


def _check_passthrough(direct: str, fwds: list[Forwarding], max_tokens: int) -> None:
    """Fail fast if a forwarder alters the bytes (ids differ per request, so mask them)."""
    import re

    mask = re.compile(rb'"id":"[^"]*"')

    def fetch(base: str, body: bytes) -> bytes:
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.status
            return mask.sub(b'"id":""', resp.read())
        finally:
            conn.close()

    for stream in (False, True):
        body = _body(stream, max_tokens)
        want = fetch(direct, body)
        for f in fwds:
            got = fetch(f.url, body)
            if got != want:
                raise AssertionError(f"{f.client} forwarder altered the {'stream' if stream else 'body'}")


def _median_cell(cells: list[Cell]) -> Cell:
    c0 = cells[0]
    cpu = [c.cpu_us_per_req for c in cells if c.cpu_us_per_req is not None]
    return Cell(
        c0.mode,
        c0.concurrency,
        c0.target,
        statistics.median(c.rps for c in cells),
        statistics.median(c.p50_ms for c in cells),
        statistics.median(c.p99_ms for c in cells),
        statistics.median(cpu) if cpu else None,
        sum(c.errors for c in cells),
    )


def format_table(cells: list[Cell]) -> str:
    """Markdown table; ratios are against the direct row of the same mode/concurrency."""
    direct = {(c.mode, c.concurrency): c for c in cells if c.target == "direct"}
    rows = [
        "| mode | conc | target | req/s | × direct | p50 ms | × direct | p99 ms | × direct | fwd CPU µs/req | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        d = direct[(c.mode, c.concurrency)]
        cpu = "–" if c.cpu_us_per_req is None else f"{c.cpu_us_per_req:.0f}"
        rows.append(
            f"| {c.mode} | {c.concurrency} | {c.target} | {c.rps:,.0f} | {c.rps / d.rps:.2f} | "
            f"{c.p50_ms:.2f} | {c.p50_ms / d.p50_ms:.1f} | {c.p99_ms:.2f} | {c.p99_ms / d.p99_ms:.1f} | "
            f"{cpu} | {c.errors} |"
        )
    return "\n".join(rows)


def run_benchmark(
    *,
    clients: list[ClientKind],
    concurrencies: list[int],
    modes: list[str],
    duration_s: int,
    warmup_s: int,
    repeat: int,
    max_tokens: int,
    max_connections: int,
    split_stream: bool,
    log: Callable[[str], None] = print,
) -> list[list[Cell]]:
    from bench.instant_replica import start_instant_replica

    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    replica_url, stop_replica = start_instant_replica(split_stream=split_stream)
    fwds: list[Forwarding] = []
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
        lua.write(_WRK_LUA)
    try:
        fwds = [start_forwarder(c, replica_url, max_connections) for c in clients]
        _check_passthrough(replica_url, fwds, max_tokens)
        targets: list[tuple[str, str, int | None]] = [("direct", replica_url, None)]
        targets += [(f.client, f.url, f.proc.pid) for f in fwds]
        runs: list[list[Cell]] = []
        for rep in range(repeat):
            cells: list[Cell] = []
            for mode in modes:
                body = _body(mode == "stream", max_tokens)
                for conc in concurrencies:
                    # Rotate the order per repeat so slow drift in background
                    # load does not always favour the same target.
                    order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                    by_target: dict[str, Cell] = {}
                    for name, base, pid in order:
                        url = base + "/v1/chat/completions"
                        if warmup_s > 0:
                            run_wrk(url, body, conc, warmup_s, lua.name)
                        cpu0 = _cpu_seconds(pid) if pid else 0.0
                        r = run_wrk(url, body, conc, duration_s, lua.name)
                        cpu = (_cpu_seconds(pid) - cpu0) / r["requests"] * 1e6 if pid else None
                        by_target[name] = Cell(
                            mode,
                            conc,
                            name,
                            r["rps"],
                            r["p50_us"] / 1e3,
                            r["p99_us"] / 1e3,
                            cpu,
                            int(r["errors"] + r["non2xx"]),
                        )
                        log(f"  rep {rep + 1} {mode:10s} c={conc:<3d} {name:8s} {r['rps']:9,.0f} req/s")
                    cells += [by_target[n] for n, _, _ in targets]
            runs.append(cells)
        return runs
    finally:
        for f in fwds:
            f.stop()
        stop_replica()
        os.unlink(lua.name)


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        model = "?"
    return f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        sp = argparse.ArgumentParser(prog="python -m bench.upstream_client serve")
        sp.add_argument("--client", choices=CLIENTS, required=True)
        sp.add_argument("--upstream", required=True)
        sp.add_argument("--port", type=int, default=8100)
        sp.add_argument("--fd", type=int, default=None)
        sp.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
        sp.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS)
        a = sp.parse_args(argv[1:])
        if a.parent_pid is not None:
            from bench.instant_replica import exit_with_parent

            exit_with_parent(a.parent_pid)
        if a.fd is not None:
            sock = socket.socket(fileno=a.fd)
        else:
            sock = socket.create_server(("127.0.0.1", a.port), backlog=2048)
        serve_forwarder(a.client, a.upstream.rstrip("/"), sock, a.max_connections)
        return

    p = argparse.ArgumentParser(prog="python -m bench.upstream_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default=",".join(DEFAULT_CLIENTS), help=f"comma-separated subset of {CLIENTS}")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--modes", default="non-stream,stream")
    p.add_argument("--duration", type=int, default=6, help="seconds per measured cell (wrk takes whole seconds)")
    p.add_argument("--warmup", type=int, default=1, help="seconds of unmeasured load before each cell; 0: none")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions; medians are reported")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS)
    p.add_argument(
        "--burst-stream",
        action="store_true",
        help="replica writes a whole stream at once (default: one write per SSE event, like vLLM)",
    )
    a = p.parse_args(argv)
    clients: list[ClientKind] = [c for c in CLIENTS if c in a.clients.split(",")]
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    modes = [m for m in ("non-stream", "stream") if m in a.modes.split(",")]

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')} on {_machine()}")
    print(
        f"# load: wrk -t1, {a.duration:g} s/cell after {a.warmup:g} s warm-up, max_tokens={a.max_tokens}, "
        f"stream writes={'burst' if a.burst_stream else 'per event'}"
    )
    runs = run_benchmark(
        clients=clients,
        concurrencies=concurrencies,
        modes=modes,
        duration_s=a.duration,
        warmup_s=a.warmup,
        repeat=a.repeat,
        max_tokens=a.max_tokens,
        max_connections=a.max_connections,
        split_stream=not a.burst_stream,
    )
    for i, cells in enumerate(runs):
        print(f"\n## repeat {i + 1}\n\n{format_table(cells)}")
    if len(runs) > 1:
        medians = [_median_cell([run[i] for run in runs]) for i in range(len(runs[0]))]
        print(f"\n## median of {len(runs)} repeats\n\n{format_table(medians)}")
    # Who won each cell, per repeat: the stability of the ranking is the result.
    # "none" is a floor, not a candidate, so it is left out of the ranking.
    print("\n## fastest client per cell (req/s / forwarder CPU per request), per repeat")
    n_cells = len(runs[0])
    for i in range(0, n_cells, len(clients) + 1):
        groups = [[c for c in run[i + 1 : i + len(clients) + 1] if c.target != "none"] for run in runs]
        if not groups[0]:
            break
        by_rps = [max(g, key=lambda c: c.rps).target for g in groups]
        by_cpu = [min(g, key=lambda c: c.cpu_us_per_req or float("inf")).target for g in groups]
        c0 = runs[0][i]
        print(f"  {c0.mode:10s} c={c0.concurrency:<3d}: req/s {' '.join(by_rps)} | CPU {' '.join(by_cpu)}")


if __name__ == "__main__":
    main()
