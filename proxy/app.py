"""Builds the proxy application: `create_app(settings)`; owns start-up and shutdown order.

Start: migrate (optional), engines, journal recovery (records of a dead proxy are
written before anything else), recorder, replica probes, active policy.
Stop (after the SIGTERM drain and uvicorn have let in-flight calls end): probes, then the
recorder's flush with a deadline (leftovers spooled), then the journal, then connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncConnection
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy import store
from proxy.access import KeyRing, Slots
from proxy.admission import Admission
from proxy.balancer import Balancer
from proxy.cluster import Cluster
from proxy.drain import Drain
from proxy.errors import error_response, install_error_handlers
from proxy.hosted import load_hosted
from proxy.journal import Journal, recover
from proxy.keystore import ensure_key
from proxy.limits import check_framing, check_headers, limited_receive
from proxy.openapi import install_openapi
from proxy.policy import ActivePolicy
from proxy.recorder import Recorder
from proxy.relay import Relay
from proxy.routes import adapters, admin, health, lifecycle, ui
from proxy.routes.relayed import has_dot_segment, match_relayed_post, relay_post, relayed_routes
from proxy.tracing import load_tracing
from proxy.upstream import Upstream
from shared.db.engine import create_async_db, create_sync_db, is_sqlite
from shared.db.migrate import upgrade
from shared.errors import NotFound, RolltapError
from shared.settings import LimitSettings, Settings

__all__ = ["ProxyApp", "create_app"]

logger = logging.getLogger(__name__)


class ProxyApp(FastAPI):
    """FastAPI, except that relayed POSTs (the hot path) skip its routing and middleware layers.

    Every HTTP request first passes the checks no route may skip: header limits (431), HTTP/1.0
    with a chunked body (400), and paths with `.`/`..` segments (404, refused rather than
    resolved, before any routing).
    Then relayed POSTs: the framework's layers (error middleware, telemetry, body limit,
    exception middleware, exit stack, router, request wrapper) are pass-throughs for them
    but cost a few percent of the proxy's CPU per call, so a relayed POST is matched here
    (the same paths its routes match), served by the same endpoint, and an exception
    becomes a response through the same handlers (`proxy.errors`). Everything else goes
    through FastAPI, its body counted against `proxy.limits.max_body_bytes`.
    """

    limits = LimitSettings()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        path = scope["path"]  # percent-decoded by the server: `%2e%2e` is `..` here
        try:
            check_headers(scope, self.limits)
            check_framing(scope)
            if has_dot_segment(path):
                raise NotFound(f"no route {scope['method']} {path[:200]}: '.' and '..' segments are refused",
                               code="unknown_route")
            if scope["method"] != "POST" or self.root_path or (target := match_relayed_post(path)) is None:
                # A LoRA adapter upload (admin only) may be far larger than any call's body.
                limit = (self.limits.max_adapter_bytes if path.startswith(adapters.UPLOAD_PREFIX)
                         else self.limits.max_body_bytes)
                receive = limited_receive(scope, receive, limit, self.limits.body_timeout_s)
                target = None
        except RolltapError as exc:
            await error_response(exc.status_code, exc.message, exc.type, code=exc.code)(scope, receive, send)
            return
        if target is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await relay_post(request, *target)
        except Exception as exc:  # noqa: BLE001 - answered as the error handlers would
            response = await self._handle_error(request, exc)
        await response(scope, receive, send)

    async def _handle_error(self, request: Request, exc: Exception) -> Response:
        for cls in type(exc).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                response = handler(request, exc)
                return await response if inspect.isawaitable(response) else response
        raise exc  # no handler (install_error_handlers registers one for Exception)


async def _resolve_policy(app: FastAPI) -> None:
    """Active policy from the database; else the base model (settings, or what replicas serve)."""
    state = app.state
    async with state.reader.connect() as conn:
        active = await store.load_active_policy(conn)
    if active is not None:
        state.policy.set(*active)
        return
    base = state.settings.proxy.model or state.balancer.base_model()
    if base is None:
        return  # no replica answered yet; the relay retries on the first call
    state.policy.set(0, base)

    async def op(conn: AsyncConnection) -> None:
        await store.save_base_policy(conn, base)

    await state.recorder.run(op, 30.0)


async def _persist_replicas(app: FastAPI) -> None:
    """Write the configured replicas and their weight mode where the trainer can read them."""
    replicas = app.state.balancer.replicas

    async def op(conn: AsyncConnection) -> None:
        for replica in replicas:
            await store.upsert_replica(conn, replica.shown_url, replica.weight_mode, "active")  # no credentials

    await app.state.recorder.run(op, 30.0)


async def _ensure_agent_key(app: FastAPI, key: str) -> None:
    """`proxy.agent_key` stored (hashed) before keys are loaded, so it works from the first call."""
    async def op(conn: AsyncConnection) -> None:
        await ensure_key(conn, key, "proxy.agent_key")

    await app.state.recorder.run(op, 30.0)


def _journal(settings: Settings) -> Journal | None:
    rec = settings.proxy.recorder
    if not rec.journal:
        return None
    return Journal(rec.journal_dir or rec.spool_dir / "journal", fsync=rec.journal_fsync,
                   segment_bytes=rec.journal_segment_bytes)


async def _recover_journals(journal: Journal, recorder: Recorder) -> None:
    """Write what dead proxies journaled (into the database, or the spool) before serving."""
    recovery = await anyio.to_thread.run_sync(recover, journal.directory)
    if recovery.files:
        await recorder.recover(recovery.records)
        logger.warning("journal: recovered %d record(s) of a stopped proxy, %d of them interrupted calls",
                       len(recovery.records), recovery.interrupted)
    recovery.release()


def _quiet_gc() -> None:
    """Keep the garbage collector's pauses off the tail of call latency.

    What start-up made lives as long as the process: frozen, later collections skip it. A call
    allocates a few hundred short-lived objects, so at the default thresholds the collector ran
    hundreds of times a second and its older-generation passes walked the whole heap on the
    event loop: the longest stalls calls saw (`docs/benchmarks.md`, "Tail latency").
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)


def cluster_enabled(settings: Settings) -> bool:
    """`proxy.cluster.enabled`, defaulting to on for PostgreSQL; refused on SQLite (one process only)."""
    enabled = settings.proxy.cluster.enabled
    if enabled is None:
        return not is_sqlite(settings.db.url)
    if enabled and is_sqlite(settings.db.url):
        raise ValueError("proxy.cluster needs PostgreSQL: a SQLite database serves one proxy process")
    return enabled


def create_app(settings: Settings) -> ProxyApp:
    drain = Drain()
    is_cluster = cluster_enabled(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.db.migrate_on_start:
            await anyio.to_thread.run_sync(upgrade, settings.db)
        # One writer task writes (SQLite allows one writer); a pool serves reads. On SQLite the
        # recorder writes record batches through a sync connection in a thread of its own.
        writer = create_async_db(settings.db, pool_size=1, json_serializer=store.dumps_json)
        writer_sync = (create_sync_db(settings.db, keep_connection=True, json_serializer=store.dumps_json)
                       if is_sqlite(settings.db.url) else None)
        reader = create_async_db(settings.db)
        upstream = Upstream(settings.proxy)
        balancer = Balancer(settings.proxy.replicas, upstream, settings.proxy.pool, settings.proxy.health_interval_s)
        admission = Admission(settings.proxy.pool.pause_wait_s)
        hosted = load_hosted(settings.proxy.litellm_config)
        tracing = load_tracing(settings.proxy.tracing)
        journal = _journal(settings)
        recorder = Recorder(settings.proxy.recorder, writer, writer_sync,
                            on_durable=journal.durable if journal is not None else None, release_leases=is_cluster)
        if journal is not None:
            await _recover_journals(journal, recorder)
            with contextlib.suppress(OSError):  # a full disk at start: logged; new calls get 507 until it has room
                journal.open()
        keys = KeyRing(settings.proxy, reader)
        policy = ActivePolicy()
        # Its own small pool: barriers and waits poll while calls are recorded.
        cluster_db = (create_async_db(settings.db, pool_size=4, json_serializer=store.dumps_json)
                      if is_cluster else None)
        cluster = (Cluster(settings.proxy.cluster, settings.db.url, cluster_db, policy, admission, balancer)
                   if cluster_db is not None else None)
        balancer.hash_rollouts = cluster is not None  # every proxy binds a rollout to the same replica
        if cluster is not None:
            recorder.on_committed = cluster.committed  # unleased calls are accounted for once committed
        app.state.cluster = cluster
        app.state.settings = settings
        app.state.reader = reader
        app.state.recorder = recorder
        app.state.journal = journal
        app.state.balancer = balancer
        app.state.policy = policy
        app.state.admission = admission
        app.state.keys = keys
        app.state.upstream = upstream
        app.state.relay = Relay(settings.proxy, upstream, balancer, policy, recorder, admission, hosted,
                                on_policy_unknown=lambda: _resolve_policy(app), tracing=tracing,
                                slots=Slots(settings.proxy.limits.max_calls_in_flight), journal=journal, drain=drain,
                                cluster=cluster)
        await recorder.start()
        if settings.proxy.agent_key is not None:
            await _ensure_agent_key(app, settings.proxy.agent_key.get_secret_value())
        await keys.start()
        await balancer.start()
        await balancer.wait_first_probe(timeout_s=10.0)
        await _resolve_policy(app)
        if cluster is not None:
            await cluster.start()  # the shared policy and pause apply from here on
        await _persist_replicas(app)
        _quiet_gc()
        logger.info("proxy ready: %d replica(s), policy %s v%s", len(settings.proxy.replicas),
                    policy.served_name, policy.version)
        try:
            yield
        finally:
            await keys.stop()
            await balancer.stop()
            await recorder.stop(settings.proxy.shutdown_timeout_s)
            if cluster is not None:
                await cluster.stop()  # after the flush: the registry row outlives this proxy's leases
            if journal is not None:
                journal.close()
            await upstream.close()
            await asyncio.gather(writer.dispose(), reader.dispose(),
                                 *([cluster_db.dispose()] if cluster_db is not None else []))
            if tracing is not None:
                await anyio.to_thread.run_sync(tracing.shutdown)  # flushes the spans still queued
            logger.info("proxy stopped; %d records written", recorder.written_total)

    app = ProxyApp(title="Rolltap proxy", version="1", lifespan=lifespan, routes=relayed_routes())
    app.limits = settings.proxy.limits
    app.state.drain = drain
    app.include_router(lifecycle.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(adapters.router)
    app.include_router(ui.router)
    install_error_handlers(app)
    install_openapi(app)
    return app
