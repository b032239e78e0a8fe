"""Real servers for tests: the proxy under uvicorn on a free port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from proxy.app import create_app
from proxy.main import server_config
from shared.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningProxy:
    url: str
    app: FastAPI
    server: uvicorn.Server
    settings: Settings

    def base_url(self, rollout_id: str, attempt_id: str) -> str:
        return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"


@contextmanager
def serve_in_thread(app: Any, *, port: int = 0, graceful_s: int = 10, startup_timeout_s: float = 60.0,
                    config: uvicorn.Config | None = None) -> Iterator[tuple[str, uvicorn.Server]]:
    """Serve an ASGI app with a real uvicorn server for the duration of the block (`config`: the
    server's own configuration, on a port of its own, instead of a plain one)."""
    port = config.port if config is not None else port or free_port()
    config = config or uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                      lifespan="on", timeout_graceful_shutdown=graceful_s)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"proxy-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("proxy failed to start (see log above)")
        if time.monotonic() > deadline:
            raise TimeoutError("proxy did not start in time")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=graceful_s + 30)


@contextmanager
def run_proxy(settings: Settings) -> Iterator[RunningProxy]:
    """Serve `create_app(settings)` as `rolltap-proxy` configures its server, for the duration of the
    block (graceful stop at exit)."""
    app = create_app(settings)
    config = server_config(app, settings, port=settings.proxy.port or free_port())
    with serve_in_thread(app, graceful_s=int(settings.proxy.shutdown_timeout_s), config=config) as (url, server):
        yield RunningProxy(url, app, server, settings)
