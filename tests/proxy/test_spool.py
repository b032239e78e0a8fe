"""Database down: records wait on local disk, readiness turns false, nothing is dropped.

PostgreSQL goes down for real: the proxy reaches it through a TCP tap that the test
cuts (connections refused and reset) and restores.

SQLite has no server to lose, and as root a read-only file or directory does not stop
writes. Its real failure mode is another process holding the write lock (a long
transaction, a backup): the writer waits `sqlite_busy_timeout_ms`, then gets
"database is locked". The test holds `BEGIN EXCLUSIVE` from its own connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from shared.settings import Settings
from tests.support.fault_replica import FaultReplica
from tests.support.servers import run_proxy, serve_in_thread
from tests.support.db_outage import Outage, wait_until

CALLS_DURING_OUTAGE = 6


def _settings(outage: Outage, replica: str, spool: Path) -> Settings:
    return Settings(
        db={"url": outage.proxy_url, "sqlite_busy_timeout_ms": 200},
        proxy={"replicas": [replica], "port": 0, "health_interval_s": 0.5, "shutdown_timeout_s": 10, "open_access": True,
               "recorder": {"spool_dir": str(spool), "retry_interval_s": 0.2}},
    )


def _rows(url: str) -> list[Any]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(
                "SELECT call_id, rollout_id, attempt_id, seq, status, is_streaming, completion_token_ids "
                "FROM calls ORDER BY rollout_id, attempt_id, seq")).all())
    finally:
        engine.dispose()


def _spooled(spool: Path) -> list[dict[str, Any]]:
    # Batch files only: `*.tmp` is a batch being written, `dead/` holds records for a human.
    return [orjson.loads(line) for path in sorted(spool.glob("*.jsonl"))
            for line in path.read_bytes().splitlines() if line.strip()]


def _call(http: httpx.Client, base: str, *, is_streaming: bool) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": is_streaming}
    response = http.post(f"{base}/chat/completions", json=body)
    assert response.status_code == 200, response.text  # the database never fails a call
    if is_streaming:
        assert response.text.rstrip().endswith("data: [DONE]")
    return response.headers["x-rolltap-call-id"]


def _readiness(http: httpx.Client, url: str) -> tuple[int, dict[str, Any]]:
    response = http.get(f"{url}/readyz")
    return response.status_code, response.json()["checks"]


def _assert_landed_once(url: str, call_ids: list[str]) -> None:
    rows = _rows(url)
    assert len(rows) == len(call_ids)
    assert len({r.call_id for r in rows}) == len(rows)
    # Numbered 0..n-1 in the order the calls were made, across the outage.
    assert [r.call_id for r in rows] == call_ids
    assert [r.seq for r in rows] == list(range(len(call_ids)))
    assert all(r.status == "ok" for r in rows)
    assert all(r.completion_token_ids for r in rows)  # the full record, not a stub


def test_outage_spools_and_replays_exactly_once(outage: Outage, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with serve_in_thread(FaultReplica()) as (replica, _), \
            run_proxy(_settings(outage, replica, spool)) as proxy, httpx.Client(timeout=30) as http:
        base = proxy.base_url("spool", "a0")
        call_ids = [_call(http, base, is_streaming=False)]
        wait_until(lambda: len(_rows(outage.read_url)) == 1, what="the first record")
        assert _readiness(http, proxy.url)[0] == 200

        outage.cut()
        call_ids += [_call(http, base, is_streaming=i % 2 == 0) for i in range(CALLS_DURING_OUTAGE)]
        status, checks = wait_until(lambda: (r := _readiness(http, proxy.url))[0] == 503 and r,
                                    what="readiness to turn false")
        assert checks["database"] is False and checks["replica"] is True
        spooled = wait_until(lambda: len(s := _spooled(spool)) == CALLS_DURING_OUTAGE and s,
                             what="every record of the outage on disk")
        assert [r["call_id"] for r in spooled] == call_ids[1:]
        assert len(_rows(outage.read_url)) == 1  # nothing reached the database meanwhile
        assert _readiness(http, proxy.url)[0] == 503  # still down: still not ready

        outage.restore()
        wait_until(lambda: len(_rows(outage.read_url)) == len(call_ids), what="the spool to be replayed")
        wait_until(lambda: _readiness(http, proxy.url)[0] == 200, what="readiness to return")
        assert _spooled(spool) == []
        # After the replay, new calls go straight to the database again.
        call_ids.append(_call(http, base, is_streaming=True))
        finish = http.post(f"{proxy.url}/rollout/spool/attempt/a0/finish", json={"status": "succeeded"})
        assert finish.status_code == 200, finish.text
    _assert_landed_once(outage.read_url, call_ids)
    assert _spooled(spool) == []


def test_records_spooled_by_a_stopped_proxy_are_written_by_the_next(outage: Outage, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with serve_in_thread(FaultReplica()) as (replica, _):
        with run_proxy(_settings(outage, replica, spool)) as proxy, httpx.Client(timeout=30) as http:
            base = proxy.base_url("restart", "a0")
            call_ids = [_call(http, base, is_streaming=False)]
            wait_until(lambda: len(_rows(outage.read_url)) == 1, what="the first record")
            outage.cut()
            call_ids += [_call(http, base, is_streaming=i % 2 == 1) for i in range(CALLS_DURING_OUTAGE)]
        # Stopped while the database is down: the shutdown flush could only spool.
        assert [r["call_id"] for r in _spooled(spool)] == call_ids[1:]
        assert len(_rows(outage.read_url)) == 1

        outage.restore()
        with run_proxy(_settings(outage, replica, spool)) as proxy, httpx.Client(timeout=30) as http:
            wait_until(lambda: len(_rows(outage.read_url)) == len(call_ids), what="the next proxy to replay")
            assert _spooled(spool) == []
            assert _readiness(http, proxy.url)[0] == 200
            call_ids.append(_call(http, proxy.base_url("restart", "a0"), is_streaming=False))
    _assert_landed_once(outage.read_url, call_ids)
