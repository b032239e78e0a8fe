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
    """Liveness: the process answers."""
    return {"status": "ok"}


async def _database_ok(request: Request) -> bool:
    try:
        async with asyncio.timeout(2.0):
            async with request.app.state.reader.connect() as conn:
                await conn.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any failure means "not ready"
        return False
    return True


def _local_storage_error(request: Request) -> str | None:
    journal = request.app.state.journal
    if journal is not None:
        journal.probe()  # once the disk has room again, say so without waiting for a call
    error: str | None = request.app.state.recorder.local_storage_error
    return error or (f"journal: {journal.error}" if journal is not None and journal.error else None)


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: the database reachable and a replica healthy, not draining (503 otherwise); `degraded` with dead letters or a full disk."""
    state = request.app.state
    checks: dict[str, Any] = {
        "database": await _database_ok(request) and state.recorder.is_db_healthy,
        "replica": state.balancer.has_healthy,
        "recorder_queue_depth": state.recorder.queue_depth,
        "dead_letter_records": state.recorder.dead_letter_records,
        "local_storage": _local_storage_error(request) or "ok",
        "draining": state.drain.is_draining,  # SIGTERM: takes no new relayed calls
    }
    ready = bool(checks["database"] and checks["replica"] and not checks["draining"])
    # Degraded: still answering (200: lifecycle calls and calls in flight go on), but records the
    # database refused wait in the dead-letter spool for `rolltap-proxy spool replay`, or the
    # proxy's own disk refuses writes (new relayed calls get 507 until it takes them again).
    is_degraded = checks["dead_letter_records"] or checks["local_storage"] != "ok"
    status = ("degraded" if is_degraded else "ready") if ready else "not_ready"
    return JSONResponse({"status": status, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (`proxy/metrics.py`)."""
    DEAD_LETTER_RECORDS.set(request.app.state.recorder.dead_letter_records)
    for replica in request.app.state.balancer.replicas:
        REPLICA_IN_FLIGHT.labels(replica.shown_url).set(replica.in_flight)
        REPLICA_HEALTHY.labels(replica.shown_url).set(1 if replica.is_healthy else 0)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
