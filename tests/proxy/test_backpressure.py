"""A full recorder queue makes callers wait; it never drops and never grows past its bound.

One record of room, one record per batch and a lingering writer make the writer the
bottleneck on purpose: 100 concurrent calls must queue behind it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

CALLS, ATTEMPTS, STREAMS = 100, 10, 10
LINGER_MS = 20
QUEUE_SIZE, BATCH_MAX = 1, 1


def _rows(db_url: str) -> list[Any]:
    engine = create_engine(sync_url(db_url))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(
                "SELECT call_id, rollout_id, attempt_id, seq FROM calls ORDER BY rollout_id, attempt_id, seq")).all())
    finally:
        engine.dispose()


async def _drive(proxy_url: str, depths: list[int]) -> tuple[list[str], float]:
    """All calls at once; meanwhile sample the live queue depth. (call ids, seconds until the last answer)"""
    limits = httpx.Limits(max_connections=CALLS + 10, max_keepalive_connections=CALLS + 10)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        done = asyncio.Event()

        async def call(i: int) -> str:
            is_streaming = i < STREAMS
            body = {"model": "m", "messages": [], "max_tokens": 2, "stream": is_streaming}
            r = await http.post(f"{proxy_url}/rollout/bp/attempt/{i % ATTEMPTS}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers["x-rolltap-call-id"]

        async def sample() -> None:
            while not done.is_set():
                r = await http.get(f"{proxy_url}/readyz")
                depths.append(r.json()["checks"]["recorder_queue_depth"])
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        call_ids = await asyncio.gather(*(call(i) for i in range(CALLS)))
        elapsed = time.perf_counter() - started
        done.set()
        await sampler
    return call_ids, elapsed


def test_full_queue_waits_and_drops_nothing(proxy_for: ProxyFactory, db_url: str) -> None:
    depths: list[int] = []
    with serve_in_thread(FaultReplica()) as (replica, _), proxy_for(
        [replica], recorder={"queue_size": QUEUE_SIZE, "batch_max": BATCH_MAX, "linger_ms": LINGER_MS}
    ) as proxy:
        call_ids, elapsed = asyncio.run(_drive(proxy.url, depths))
        written_at_end = proxy.app.state.recorder.written_total  # read at once: the writer is still going

    # Exactly once: every call answered is in the database, once, numbered per attempt.
    rows = _rows(db_url)
    assert len(rows) == CALLS
    assert sorted(r.call_id for r in rows) == sorted(call_ids)
    assert len(set(call_ids)) == CALLS
    for attempt in range(ATTEMPTS):
        assert [r.seq for r in rows if r.attempt_id == str(attempt)] == list(range(CALLS // ATTEMPTS))

    # The bound held: the queue was seen full, never beyond.
    assert max(depths) == QUEUE_SIZE, depths
    # Callers waited: a non-streamed answer leaves only once its record is queued, so when the last
    # answer arrived almost everything was already written. An unbounded queue would have let the
    # answers run ahead of a writer that does one record per LINGER_MS (about 2 s for 100).
    in_flight_bound = QUEUE_SIZE + BATCH_MAX + STREAMS  # a streamed body ends before its record is queued
    assert written_at_end >= CALLS - in_flight_bound, (written_at_end, elapsed)
    # The writer is the bottleneck: the calls cannot have finished faster than it writes.
    assert elapsed >= 0.9 * (CALLS - in_flight_bound) * LINGER_MS / 1000, elapsed
