"""Builds the proxy application: `create_app(settings)`; owns start-up and shutdown order.

Start: migrate (optional), engines, recorder, replica probes, active policy.
Stop (after uvicorn has let in-flight calls end): probes, then the recorder's flush
with a deadline (leftovers spooled), then connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncConnection

from proxy import store
from proxy.admission import Admission
from proxy.balancer import Balancer
from proxy.errors import install_error_handlers
from proxy.hosted import load_hosted
from proxy.policy import ActivePolicy
from proxy.recorder import Recorder
from proxy.relay import Relay
from proxy.routes import admin, health, lifecycle
from proxy.routes.relayed import relayed_routes
from proxy.upstream import Upstream
from shared.db.engine import create_async_db, create_sync_db, is_sqlite
from shared.db.migrate import upgrade
from shared.settings import Settings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


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
            await store.upsert_replica(conn, replica.url, replica.weight_mode, "active")

    await app.state.recorder.run(op, 30.0)


def create_app(settings: Settings) -> FastAPI:
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
        recorder = Recorder(settings.proxy.recorder, writer, writer_sync)
        policy = ActivePolicy()
        app.state.settings = settings
        app.state.reader = reader
        app.state.recorder = recorder
        app.state.balancer = balancer
        app.state.policy = policy
        app.state.admission = admission
        app.state.relay = Relay(settings.proxy, upstream, balancer, policy, recorder, admission, hosted,
                                on_policy_unknown=lambda: _resolve_policy(app))
        await recorder.start()
        await balancer.start()
        await balancer.wait_first_probe(timeout_s=10.0)
        await _resolve_policy(app)
        await _persist_replicas(app)
        logger.info("proxy ready: %d replica(s), policy %s v%s", len(settings.proxy.replicas),
                    policy.served_name, policy.version)
        try:
            yield
        finally:
            await balancer.stop()
            await recorder.stop(settings.proxy.shutdown_timeout_s)
            await upstream.close()
            await asyncio.gather(writer.dispose(), reader.dispose())
            logger.info("proxy stopped; %d records written", recorder.written_total)

    app = FastAPI(title="Rolltap proxy", version="1", lifespan=lifespan, routes=relayed_routes())
    app.include_router(lifecycle.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    install_error_handlers(app)
    return app
