"""`rolltap-proxy`: command line, logging, migrations, then uvicorn.

    rolltap-proxy --replica URL [--replica URL ...] --db URL --host H --port P
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
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn

from proxy.app import create_app
from proxy.drain import Drain
from proxy.keystore import cli as keys_cli
from shared.db.engine import redacted_url
from shared.settings import Settings

__all__ = ["DrainingServer", "main", "parse_settings"]


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="rolltap-proxy", description="Rolltap tracing proxy for vLLM replicas")
    parser.add_argument("--replica", action="append", dest="replicas", metavar="URL",
                        help="vLLM replica base URL (repeatable); env ROLLTAP_PROXY__REPLICAS")
    parser.add_argument("--db", metavar="URL", help="database URL; env ROLLTAP_DB__URL (default sqlite:///./rolltap.db)")
    parser.add_argument("--host", help="listen address; env ROLLTAP_PROXY__HOST (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port; env ROLLTAP_PROXY__PORT (default 8000)")
    parser.add_argument("--model", help="served model to rewrite to before a policy is set; env ROLLTAP_PROXY__MODEL")
    parser.add_argument("--admin-token", help="bearer token for /admin; env ROLLTAP_PROXY__ADMIN_TOKEN")
    parser.add_argument("--log-level", help="logging level; env ROLLTAP_PROXY__LOG_LEVEL (default info)")
    args = parser.parse_args(argv)
    proxy: dict[str, Any] = {}
    for name in ("replicas", "host", "port", "model", "admin_token", "log_level"):
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
    # Secrets stay out of the log: SecretStr fields dump as "**********", the database password is masked.
    shown = settings.model_copy(update={"db": settings.db.model_copy(update={"url": redacted_url(settings.db.url)})})
    logging.getLogger(__name__).info("settings: %s", shown.model_dump_json())
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.proxy.host,
        port=settings.proxy.port,
        log_level=settings.proxy.log_level.lower(),
        access_log=False,  # per-request lines cost more than the proxy itself; metrics cover it
        # Nothing here reads the client address, so X-Forwarded-* rewriting (a middleware layer
        # on every request) buys nothing.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.proxy.shutdown_timeout_s),
        lifespan="on",
        # With the h11 parser, stop reading a header block past the limit (httptools has none of its
        # own); every request's headers are checked again in `ProxyApp` either way.
        h11_max_incomplete_event_size=settings.proxy.limits.max_header_bytes,
    )
    signal.signal(signal.SIGTERM, _exit_cleanly)  # restored by uvicorn after its shutdown, then re-raised
    DrainingServer(config, app.state.drain, settings.proxy.shutdown_timeout_s, settings.proxy.drain_grace_s).run()


if __name__ == "__main__":
    main()
