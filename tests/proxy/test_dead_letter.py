"""A record the database refuses (not an outage) is never silent, and is replayed exactly once.

The refusal is real: a CHECK constraint (PostgreSQL) or a trigger (SQLite) that an operator
added, rejecting one call's row. The proxy keeps the record in its dead-letter spool; `finish`
answers 507 `attempt_not_durable`, GET attempt names the call and the reason, `/metrics`
counts it and `/readyz` says degraded. Once the constraint is gone, `rolltap-proxy spool
replay` writes it, once: a second replay finds nothing left to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.metrics import metric
from tests.support.servers import serve_in_thread

POISON = "refused-model"


def _sql(db_url: str, statement: str) -> None:
    engine = create_engine(sync_url(db_url))
    try:
        with engine.begin() as conn:
            conn.execute(text(statement))
    finally:
        engine.dispose()


def _refuse_poison(db_url: str) -> None:
    if db_url.startswith("sqlite"):
        _sql(db_url, f"CREATE TRIGGER poison BEFORE INSERT ON calls WHEN NEW.requested_model = '{POISON}' "
                     "BEGIN SELECT RAISE(ABORT, 'poison row refused'); END")
    else:
        _sql(db_url, f"ALTER TABLE calls ADD CONSTRAINT poison CHECK (requested_model IS DISTINCT FROM '{POISON}')")


def _accept_poison(db_url: str) -> None:
    _sql(db_url, "DROP TRIGGER poison" if db_url.startswith("sqlite") else "ALTER TABLE calls DROP CONSTRAINT poison")


def _spool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "proxy.main", "spool", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_refused_record_is_reported_and_replayed_once(proxy_for: ProxyFactory, db_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with serve_in_thread(FaultReplica()) as (replica, _), proxy_for([replica]) as proxy, \
            httpx.Client(timeout=30) as http:
        _refuse_poison(db_url)
        base = proxy.base_url("dl", "0")
        before = metric(http.get(f"{proxy.url}/metrics").text, "rolltap_records_undurable_total")
        call_ids = []
        for model in ("m", POISON, "m"):
            answer = http.post(f"{base}/chat/completions",
                               json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200
            call_ids.append(answer.headers["x-rolltap-call-id"])

        finished = http.post(f"{proxy.url}/rollout/dl/attempt/0/finish", json={"status": "succeeded"})
        assert finished.status_code == 507, finished.text
        error = finished.json()["error"]
        assert (error["type"], error["code"]) == ("storage_error", "attempt_not_durable")
        assert call_ids[1] in error["message"]

        attempt = http.get(f"{proxy.url}/rollout/dl/attempt/0").json()
        assert attempt["is_durable"] is False and attempt["status"] == "succeeded"
        [undurable] = attempt["undurable_calls"]
        assert undurable["call_id"] == call_ids[1] and "poison" in undurable["reason"]
        assert [c["call_id"] for c in attempt["calls"]] == [call_ids[0], call_ids[2]]

        metrics = http.get(f"{proxy.url}/metrics").text
        assert metric(metrics, "rolltap_records_undurable_total") == before + 1
        assert metric(metrics, "rolltap_dead_letter_records") == 1
        ready = http.get(f"{proxy.url}/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert ready.json()["checks"]["dead_letter_records"] == 1

        listed = _spool_cli("list", "--spool-dir", str(spool))
        assert listed.returncode == 0 and call_ids[1] in listed.stdout and "poison" in listed.stdout

        still = _spool_cli("replay", "--spool-dir", str(spool), "--db", db_url)  # the cause is not fixed yet
        assert still.returncode == 1 and "1 still refused" in still.stdout

        _accept_poison(db_url)
        replayed = _spool_cli("replay", "--spool-dir", str(spool), "--db", db_url)
        assert replayed.returncode == 0 and "1 written" in replayed.stdout, replayed.stdout + replayed.stderr
        again = _spool_cli("replay", "--spool-dir", str(spool), "--db", db_url)
        assert again.returncode == 0 and "0 written, 0 already in the database" in again.stdout

        attempt = http.get(f"{proxy.url}/rollout/dl/attempt/0").json()
        assert attempt["is_durable"] is True and attempt["undurable_calls"] == []
        assert sorted(c["call_id"] for c in attempt["calls"]) == sorted(call_ids)  # each exactly once
        refused = next(c for c in attempt["calls"] if c["call_id"] == call_ids[1])
        assert refused["requested_model"] == POISON and refused["response"]["choices"][0]["message"]["content"] == "ok"
        finished = http.post(f"{proxy.url}/rollout/dl/attempt/0/finish", json={"status": "succeeded"})
        assert finished.status_code == 200 and finished.json()["is_durable"] is True
        assert http.get(f"{proxy.url}/readyz").json()["status"] == "ready"
