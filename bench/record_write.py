"""Benchmark: the proxy's CPU per call record written, the database write alone.

The recorder's step after a batch leaves its queue: `proxy.store.write_calls_sync` in one
transaction, as `proxy.recorder` runs it (SQLite: a sync engine in the caller's thread;
PostgreSQL: the async engine through `run_sync`). Batches of 32 records, one per attempt
of 32 attempts (32 agents, each its own rollout), the instant replica's 16-token answer
with logprobs (`bench.record_floor`). The first batch (which creates the attempts) is left
out: the steady state is measured. CPU is this process's (SQLite's engine runs in it; the
PostgreSQL server does not).

    .venv/bin/python -m bench.record_write [--db sqlite|postgresql] [--batches 300] [--prompt-bytes 32000]

PostgreSQL: a fresh database is made and dropped at `ROLLTAP_TEST_PG_DSN` (default
postgresql://postgres@127.0.0.1:5432/test), as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson

from bench.instant_replica import PROMPT_TOKEN_IDS
from bench.proxy_overhead import request_body
from bench.record_floor import canned_response
from proxy.store import SeqCounters, dumps_json, write_calls, write_calls_sync
from shared.db.engine import create_async_db, create_sync_db
from shared.db.migrate import upgrade
from shared.settings import DbSettings
from shared.types import CallRecord
from tests.support.databases import database

AGENTS = 32


def batch(raw: bytes, request: bytes, n: int) -> list[CallRecord]:
    """One finished call per agent, as the relay hands them to the recorder."""
    records = []
    for agent in range(AGENTS):
        response = orjson.loads(raw)
        choice = response["choices"][0]
        now = datetime.now(UTC)
        records.append(CallRecord(
            call_id=uuid.uuid4().hex, rollout_id=f"bench-{agent}", attempt_id="0", route="/v1/chat/completions",
            is_streaming=False, status="ok", started_at=now, ended_at=now, first_byte_at=now, http_status=200,
            request=orjson.loads(request), response=response, prompt_token_ids=list(PROMPT_TOKEN_IDS),
            completion_token_ids=choice.get("token_ids"),
            completion_logprobs=[t["logprob"] for t in choice["logprobs"]["content"]],
            finish_reason=choice.get("finish_reason"), usage=response.get("usage"), replica="http://127.0.0.1:1",
            policy_version=0, requested_model="tiny", served_model="tiny", request_body=request,
            response_body=raw, arrival=n * AGENTS + agent))
    return records


def measure_sqlite(url: str, batches: list[list[CallRecord]]) -> float:
    engine = create_sync_db(DbSettings(url=url), keep_connection=True, json_serializer=dumps_json)
    seqs = SeqCounters()
    try:
        def write(records: list[CallRecord]) -> None:
            with engine.begin() as conn:
                write_calls_sync(conn, records, seqs=seqs)
            seqs.commit()

        return _timed(write, batches)
    finally:
        engine.dispose()


def measure_postgresql(url: str, batches: list[list[CallRecord]]) -> float:
    async def main() -> float:
        engine = create_async_db(DbSettings(url=url), pool_size=1, json_serializer=dumps_json)
        seqs = SeqCounters()

        async def write(records: list[CallRecord]) -> None:
            async with engine.begin() as conn:
                await write_calls(conn, records, seqs=seqs)
            seqs.commit()

        try:
            await write(batches[0])
            started = time.process_time()
            for records in batches[1:]:
                await write(records)
            return (time.process_time() - started) / (len(batches) - 1) / AGENTS * 1e6
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _timed(write: Callable[[list[CallRecord]], None], batches: list[list[CallRecord]]) -> float:
    write(batches[0])
    started = time.process_time()
    for records in batches[1:]:
        write(records)
    return (time.process_time() - started) / (len(batches) - 1) / AGENTS * 1e6


def run(kind: str, raw: bytes, request: bytes, n_batches: int) -> float:
    batches = [batch(raw, request, n) for n in range(n_batches + 1)]
    with tempfile.TemporaryDirectory(prefix="rolltap-record-write-") as tmp, database(kind, Path(tmp)) as url:
        upgrade(DbSettings(url=url))
        if kind == "sqlite":
            return measure_sqlite(url, batches)
        return measure_postgresql(url, batches)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.record_write", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=["sqlite", "postgresql"], action="append")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompt-bytes", type=int, default=0,
                   help="pad each request with earlier turns to about this many bytes (an agent's context)")
    a = p.parse_args()
    raw = canned_response()
    request = request_body(False, 16, a.prompt_bytes)
    for kind in a.db or ["sqlite", "postgresql"]:
        runs = sorted(run(kind, raw, request, a.batches) for _ in range(a.repeat))
        print(f"{kind}: write_calls, {AGENTS} records over {AGENTS} attempts per batch, {len(request):,}-byte requests: "
              "median "
              f"{runs[len(runs) // 2]:.1f} µs CPU per record (min {runs[0]:.1f}, max {runs[-1]:.1f}; "
              f"{a.repeat} runs of {a.batches} batches)")


if __name__ == "__main__":
    main()
