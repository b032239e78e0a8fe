"""Start-up recovery of a dead proxy's journal when the database refuses some of its records.

A record the database refuses (not an outage) goes to the dead-letter spool; the others are
written; the proxy starts and serves, says `degraded`, and starts again the same way: a bad
journaled record never keeps a proxy down (it used to crash it at every start). Both databases.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from proxy.journal import Journal
from shared.db.engine import sync_url
from shared.types import CallRecord, CallStatus
from tests.conftest import make_settings
from tests.support.fault_replica import FaultReplica
from tests.support.servers import run_proxy, serve_in_thread


def _record(call_id: str, **fields: object) -> CallRecord:
    now = datetime.now(UTC)
    values: dict[str, object] = {"route": "chat/completions", **fields}
    return CallRecord(call_id=call_id, rollout_id="rec", attempt_id="0", is_streaming=False, status=CallStatus.OK,
                      started_at=now, ended_at=now + timedelta(seconds=1), http_status=200,
                      completion_token_ids=[5, 6], **values)  # type: ignore[arg-type]


def _journal_of_a_dead_proxy(directory: Path, records: list[CallRecord]) -> None:
    """What a proxy killed after journaling these records (and before committing them) leaves behind."""
    journal = Journal(directory)
    journal.open()
    for record in records:
        journal.started(record.call_id, record.rollout_id, record.attempt_id, record.route, record.started_at, 0)
        journal.ended(record)
    journal.close()  # not durable: the files stay and the lock is released, as when the process dies


def test_a_refused_journal_record_never_keeps_the_proxy_down(db_url: str, tmp_path: Path) -> None:
    # A call without a route breaks a NOT NULL constraint on either database: refused as data, not an outage.
    good, bad = _record("call-good"), _record("call-bad", route=None)
    _journal_of_a_dead_proxy(tmp_path / "spool" / "journal", [good, bad])
    with serve_in_thread(FaultReplica()) as (replica, _):
        settings = make_settings(db_url, [replica], tmp_path)
        for _ in range(2):  # and again: the dead letter stays, the start still succeeds
            with run_proxy(settings) as proxy, httpx.Client(timeout=30) as http:
                ready = http.get(f"{proxy.url}/readyz").json()
                assert ready["status"] == "degraded" and ready["checks"]["dead_letter_records"] == 1
                attempt = http.get(f"{proxy.url}/rollout/rec/attempt/0").json()
                assert [c["call_id"] for c in attempt["calls"]] == ["call-good"]
                assert attempt["undurable_calls"][0]["call_id"] == "call-bad"
                finished = http.post(f"{proxy.url}/rollout/rec/attempt/0/finish", json={"status": "succeeded"})
                assert finished.status_code == 507  # finished, and says one of its records waits for a human
    engine = create_engine(sync_url(db_url))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT call_id FROM calls")).scalars().all() == ["call-good"]
    engine.dispose()
    dead = list((tmp_path / "spool" / "dead").glob("*.jsonl"))
    assert len(dead) == 1 and b"call-bad" in dead[0].read_bytes()
