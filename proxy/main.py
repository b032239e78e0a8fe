"""`rolltap-proxy`: command line, logging, migrations, then uvicorn.

    rolltap-proxy [serve] --replica URL [--replica URL ...] --db URL --host H --port P [--workers N]
    rolltap-proxy keys create|list|revoke ...      (agent keys; see `proxy.keystore`)
    rolltap-proxy spool list|replay [--spool-dir D] [--db URL]   (see proxy/spool_cli.py)

Every flag has an environment equivalent (`ROLLTAP_PROXY__REPLICAS`, `ROLLTAP_DB__URL`,
`ROLLTAP_PROXY__HOST`, `ROLLTAP_PROXY__PORT`, ...) and a config-file key
(`ROLLTAP_CONFIG=rolltap.toml`); flags win.

SIGTERM (or Ctrl+C) drains: new relayed calls get 503 `proxy_draining`, calls in flight
may end within `proxy.shutdown_timeout_s`, and the listener stays open meanwhile so that
reward, finish and GET attempt still answer (until `proxy.drain_grace_s` passed without
any call); then uvicorn stops and the recorder flushes.
A second signal stops at once (calls still in flight end as `interrupted`).

`--workers N` (N > 1, PostgreSQL only) forks N proxy processes that accept on one listening
socket; each is a full member of the cluster (`proxy.cluster`). The parent only passes
signals on and starts a worker again if one dies.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from proxy.app import cluster_enabled, create_app
from proxy.drain import Drain
from proxy.keystore import cli as keys_cli
from proxy.server import protocol_class
from proxy.upstream import shown_url
from shared.db.engine import is_sqlite, redacted_url
from shared.db.migrate import upgrade
from shared.settings import Settings

__all__ = ["DrainingServer", "main", "parse_settings"]


_SUBCOMMANDS = """subcommands:
  serve [flags]          run the proxy (the default: `rolltap-proxy [flags]` is the same)
  keys create|list|revoke  agent keys in the database (`rolltap-proxy keys --help`)
  spool list|replay      records the database refused, waiting on disk (`rolltap-proxy spool --help`)
"""


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="rolltap-proxy", description="Rolltap tracing proxy for vLLM replicas",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_SUBCOMMANDS)
    parser.add_argument("--replica", action="append", dest="replicas", metavar="URL",
                        help="vLLM replica base URL (repeatable); env ROLLTAP_PROXY__REPLICAS")
    parser.add_argument("--db", metavar="URL", help="database URL; env ROLLTAP_DB__URL (default sqlite:///./rolltap.db)")
    parser.add_argument("--host", help="listen address; env ROLLTAP_PROXY__HOST (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port; env ROLLTAP_PROXY__PORT (default 8000)")
    parser.add_argument("--model", help="served model to rewrite to before a policy is set; env ROLLTAP_PROXY__MODEL")
    parser.add_argument("--admin-token", help="bearer token for /admin; env ROLLTAP_PROXY__ADMIN_TOKEN")
    parser.add_argument("--log-level", help="logging level; env ROLLTAP_PROXY__LOG_LEVEL (default info)")
    parser.add_argument("--workers", type=int, help="proxy processes on the one port (more than 1 needs "
                        "PostgreSQL); env ROLLTAP_PROXY__WORKERS (default 1)")
    args = parser.parse_args(argv)
    proxy: dict[str, Any] = {}
    for name in ("replicas", "host", "port", "model", "admin_token", "log_level", "workers"):
        value = getattr(args, name)
        if value is not None:
            proxy[name] = value
    overrides: dict[str, Any] = {"proxy": proxy}
    if args.db is not None:
        overrides["db"] = {"url": args.db}
    return Settings(**overrides)


def _exit_cleanly(signum: int, frame: object) -> None:
    # uvicorn re-raises the SIGTERM it handled once its graceful shutdown is over. By then
    # in-flight calls have ended and records are flushed (or spooled): a clean stop, so exit 0
    # rather than die by the signal (143), which supervisors and `docker stop` report as a failure.
    raise SystemExit(0)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains before the listener closes.

    uvicorn closes its listener as soon as the signal arrives, so the `finish` that follows
    an agent's last call would find no proxy. Here the signal only starts the drain; the
    server's own tick (every 0.1 s) turns it into uvicorn's usual graceful exit once the
    drain is done.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float, grace_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.is_draining or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: uvicorn's own way
            if self._drain.is_draining:
                self.force_exit = True
            return
        self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
        self._drain.begin(self._drain_timeout_s, self._grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain.is_done:
            self.should_exit = True
        return await super().on_tick(counter)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    if argv[:1] == ["keys"]:
        raise SystemExit(keys_cli(argv[1:]))
    if argv[:1] == ["spool"]:
        from proxy.spool_cli import spool_main  # a maintenance command: no server, no uvicorn set-up

        raise SystemExit(spool_main(argv[1:]))
    settings = parse_settings(argv)
    level = settings.proxy.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.proxy.replicas:
        raise SystemExit("rolltap-proxy: no replica configured (--replica URL or ROLLTAP_PROXY__REPLICAS)")
    # Secrets stay out of the log: SecretStr fields dump as "**********", the database password and
    # replica credentials are masked.
    shown = settings.model_copy(update={
        "db": settings.db.model_copy(update={"url": redacted_url(settings.db.url)}),
        "proxy": settings.proxy.model_copy(update={"replicas": [shown_url(u) for u in settings.proxy.replicas]})})
    logging.getLogger(__name__).info("settings: %s", shown.model_dump_json())
    if settings.proxy.workers > 1:
        if is_sqlite(settings.db.url):
            raise SystemExit("rolltap-proxy: --workers > 1 needs PostgreSQL (--db postgresql://...): a SQLite "
                             "database takes one proxy process; run one worker, or point the proxies at PostgreSQL")
        if not cluster_enabled(settings):
            raise SystemExit("rolltap-proxy: --workers > 1 needs proxy.cluster.enabled (the workers share state "
                             "through the database)")
        raise SystemExit(_serve_workers(settings))
    _serve(settings, None)


def _serve(settings: Settings, sock: socket.socket | None) -> None:
    app = create_app(settings)
    config = server_config(app, settings)
    signal.signal(signal.SIGTERM, _exit_cleanly)  # restored by uvicorn after its shutdown, then re-raised
    server = DrainingServer(config, app.state.drain, settings.proxy.shutdown_timeout_s, settings.proxy.drain_grace_s)
    server.run(sockets=[sock] if sock is not None else None)


def server_config(app: Any, settings: Settings, port: int | None = None) -> uvicorn.Config:
    """The HTTP server's configuration (`port` overrides the settings' one)."""
    return uvicorn.Config(
        app,
        host=settings.proxy.host,
        port=settings.proxy.port if port is None else port,
        log_level=settings.proxy.log_level.lower(),
        access_log=False,  # per-request lines cost more than the proxy itself; metrics cover it
        # The scope keeps the direct peer's address: the dashboard's sign-in alone reads
        # X-Forwarded-Proto/Host, from `proxy.trusted_proxies` only (proxy/forwarded.py), so a
        # rewriting middleware on every request buys nothing.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.proxy.shutdown_timeout_s),
        lifespan="on",
        # httptools (uvicorn's own choice when installed), timing how long a request takes to arrive.
        http=protocol_class(settings.proxy.limits),
        timeout_keep_alive=settings.proxy.keep_alive_s,
    )


def _serve_workers(settings: Settings) -> int:
    """Bind once, fork the workers (before any thread or event loop exists here), supervise them."""
    log = logging.getLogger(__name__)
    if settings.db.migrate_on_start:
        # Once, here: N workers migrating one database at the same moment would race.
        upgrade(settings.db)
        settings = settings.model_copy(update={"db": settings.db.model_copy(update={"migrate_on_start": False})})
    sock = uvicorn.Config(None, host=settings.proxy.host, port=settings.proxy.port).bind_socket()  # type: ignore[arg-type]
    workers: dict[int, int] = {}  # pid -> worker number
    stopping = False

    def spawn(n: int) -> None:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                _serve(settings, sock)
            except SystemExit as exc:
                os._exit(exc.code if isinstance(exc.code, int) else 1)
            except BaseException:  # noqa: BLE001 - reported, then the worker exits non-zero
                log.exception("worker %d failed", n)
                os._exit(1)
            os._exit(0)
        workers[pid] = n

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(workers):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for n in range(settings.proxy.workers):
        spawn(n)
    log.info("rolltap-proxy: %d workers on %s:%d", settings.proxy.workers, settings.proxy.host, settings.proxy.port)
    worst = 0
    while workers:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in workers:
            continue
        n = workers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if stopping:
            worst = max(worst, abs(code))
        else:
            log.error("worker %d (pid %d) exited with %d; starting it again", n, pid, code)
            time.sleep(0.5)
            spawn(n)
    sock.close()
    return worst  # the loop ends only once stopping: a worker that failed its shutdown shows here


if __name__ == "__main__":
    main()
