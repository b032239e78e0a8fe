"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from sqlalchemy import text
from starlette.responses import JSONResponse, PlainTextResponse, Response

from proxy.metrics import DEAD_LETTER_RECORDS

__all__ = ["router"]

router = APIRouter()

REPLICA_IN_FLIGHT = Gauge("rolltap_replica_in_flight", "Calls in flight per replica", ["replica"])
REPLICA_HEALTHY = Gauge("rolltap_replica_healthy", "1 when the replica passes its probes", ["replica"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def _database_ok(request: Request) -> bool:
    try:
        async with asyncio.timeout(2.0):
            async with request.app.state.reader.connect() as conn:
                await conn.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any failure means "not ready"
        return False
    return True


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    state = request.app.state
    checks: dict[str, Any] = {
        "database": await _database_ok(request) and state.recorder.is_db_healthy,
        "replica": state.balancer.has_healthy,
        "recorder_queue_depth": state.recorder.queue_depth,
        "dead_letter_records": state.recorder.dead_letter_records,
        "draining": state.drain.is_draining,  # SIGTERM: takes no new relayed calls
    }
    ready = bool(checks["database"] and checks["replica"] and not checks["draining"])
    # Degraded: still serving (200, so a load balancer keeps sending calls), but records the
    # database refused wait in the dead-letter spool for `rolltap-proxy spool replay`.
    status = ("degraded" if checks["dead_letter_records"] else "ready") if ready else "not_ready"
    return JSONResponse({"status": status, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    DEAD_LETTER_RECORDS.set(request.app.state.recorder.dead_letter_records)
    for replica in request.app.state.balancer.replicas:
        REPLICA_IN_FLIGHT.labels(replica.shown_url).set(replica.in_flight)
        REPLICA_HEALTHY.labels(replica.shown_url).set(1 if replica.is_healthy else 0)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
