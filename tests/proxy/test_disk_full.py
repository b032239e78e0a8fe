"""The proxy's own disk (journal and spool) fills up: a real small filesystem, both databases.

What must hold (issue "at the edges"): no stream is cut for it (the client gets every byte
and `[DONE]`); new calls get 507 with Retry-After before anything goes upstream; `/readyz`
says `degraded`; no replica is ejected for a local error; once space (and the database)
return, every call the clients saw complete is recorded exactly once and `finish` answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.conftest import make_settings
from tests.support.db_outage import Outage, wait_until
from tests.support.fault_replica import FaultReplica
from tests.support.metrics import metric
from tests.support.servers import RunningProxy, run_proxy, serve_in_thread
from tests.support.small_disk import SmallDisk, small_disk

STREAMS = 8
CHUNKS = 12


def _stream_body(i: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"s{i}"}], "max_tokens": CHUNKS, "stream": True,
            "fault": {"delay_s": 0.1}}


async def _stream(proxy: RunningProxy, http: httpx.AsyncClient, i: int) -> tuple[str, str]:
    async with http.stream("POST", f"{proxy.base_url(f'disk-{i}', '0')}/chat/completions",
                           json=_stream_body(i)) as response:
        assert response.status_code == 200
        body = (await response.aread()).decode()
        return response.headers["x-rolltap-call-id"], body


def _refused_until_full(http: httpx.Client, proxy: RunningProxy, replica: FaultReplica) -> httpx.Response:
    """Small new calls until one is refused: the journal's last page has no room left either."""
    for n in range(200):
        before = replica.stats.requests
        response = http.post(f"{proxy.base_url('probe', str(n))}/chat/completions",
                             json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        if response.status_code == 507:
            assert replica.stats.requests == before  # refused before anything went upstream
            return response
        assert response.status_code == 200, response.text
    raise AssertionError("no new call was refused on a full disk")


def _metric(http: httpx.Client, url: str, name: str) -> float:
    return metric(http.get(f"{url}/metrics").text, name, default=0.0)


def _records(url: str) -> dict[str, Any]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT call_id, status, completion_token_ids FROM calls "
                                     "WHERE rollout_id LIKE 'disk-%'")).all()
    finally:
        engine.dispose()
    assert len(rows) == len({r.call_id for r in rows})  # never twice
    return {r.call_id: r for r in rows}


def _assert_complete(rows: dict[str, Any], streams: list[tuple[str, str]]) -> None:
    for call_id, body in streams:
        assert body.rstrip().endswith("data: [DONE]") and '"error"' not in body  # not cut, no error event
        assert rows[call_id].status == "ok"
        tokens = rows[call_id].completion_token_ids
        tokens = json.loads(tokens) if isinstance(tokens, str) else tokens  # SQLite hands JSON back as text
        assert tokens == [100 + n for n in range(CHUNKS)]  # the whole record, every token


def _finish(http: httpx.Client, proxy: RunningProxy, i: int) -> httpx.Response:
    return http.post(f"{proxy.url}/rollout/disk-{i}/attempt/0/finish", json={"status": "succeeded"})


def _assert_507(response: httpx.Response) -> None:
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("storage_error", "local_storage_unavailable")


def _run_streams(proxy: RunningProxy, during: Any) -> list[tuple[str, str]]:
    async def main() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(_stream(proxy, http, i)) for i in range(STREAMS)]
            await asyncio.sleep(0.4)  # every stream has started (journaled) and is in flight
            await asyncio.to_thread(during)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


@pytest.fixture
def disk(tmp_path: Path) -> Any:
    with small_disk(tmp_path / "disk") as mounted:
        yield mounted


def test_disk_full_under_streams(db_url: str, tmp_path: Path, disk: SmallDisk) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (replica_url, _):
        settings = make_settings(db_url, [replica_url], tmp_path, recorder={"spool_dir": str(disk.path / "spool")})
        with run_proxy(settings) as proxy, httpx.Client(timeout=30) as http:
            refused: list[httpx.Response] = []

            def fill() -> None:
                disk.fill()
                refused.append(_refused_until_full(http, proxy, replica))

            streams = _run_streams(proxy, fill)
            _assert_507(refused[0])
            # The streams' records could not be journaled: the fault was really hit.
            assert _metric(http, proxy.url, "rolltap_journal_write_failures_total") >= 1
            ready = http.get(f"{proxy.url}/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "degraded"
            assert ready.json()["checks"]["local_storage"].startswith("journal: OSError")
            assert all(r.is_healthy for r in proxy.app.state.balancer.replicas)  # never ejected for our disk
            for i in range(STREAMS):
                assert _finish(http, proxy, i).status_code == 200  # the database took them meanwhile
            _assert_complete(_records(db_url), streams)

            disk.free()
            assert http.get(f"{proxy.url}/readyz").json()["status"] == "ready"  # before any call probes it
            again = http.post(f"{proxy.base_url('disk-after', '0')}/chat/completions",
                              json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
            assert again.status_code == 200


@pytest.mark.parametrize("space_first", [True, False], ids=["space-then-db", "db-then-space"])
def test_disk_full_during_a_database_outage(outage: Outage, tmp_path: Path, disk: SmallDisk,
                                            space_first: bool) -> None:
    """Neither the database nor the disk takes records: they wait in memory, `finish` answers 503
    with Retry-After (never 500, never hanging), and all land exactly once when both are back."""
    replica = FaultReplica()
    with serve_in_thread(replica) as (replica_url, _):
        settings = make_settings(outage.proxy_url, [replica_url], tmp_path, finish_timeout_s=5.0,
                                 recorder={"spool_dir": str(disk.path / "spool"), "retry_interval_s": 0.2})
        settings.db.sqlite_busy_timeout_ms = 200
        with run_proxy(settings) as proxy, httpx.Client(timeout=30) as http:

            def cut_and_fill() -> None:
                outage.cut()
                disk.fill()
                _refused_until_full(http, proxy, replica)

            streams = _run_streams(proxy, cut_and_fill)
            wait_until(lambda: _metric(http, proxy.url, "rolltap_records_held_in_memory") >= 1,
                       what="records held in memory")
            started = time.monotonic()
            finish = _finish(http, proxy, 0)
            assert finish.status_code == 503 and finish.headers["retry-after"] == "1"
            assert finish.json()["error"]["type"] == "database_unavailable"
            assert time.monotonic() - started < 2.0  # answered, not held until the database returns
            assert http.get(f"{proxy.url}/readyz").json()["checks"]["local_storage"].startswith("spool: OSError")

            if space_first:
                disk.free()  # the held records go to the spool file, then to the database
                wait_until(lambda: _metric(http, proxy.url, "rolltap_records_held_in_memory") == 0,
                           what="held records spooled once the disk has room")
                outage.restore()
            else:
                outage.restore()  # straight from memory to the database, the disk still full
                wait_until(lambda: _metric(http, proxy.url, "rolltap_records_held_in_memory") == 0,
                           what="held records written to the database")
            for i in range(STREAMS):
                deadline = time.monotonic() + 30
                while (finished := _finish(http, proxy, i)).status_code == 503:
                    assert time.monotonic() < deadline, finished.text
                    time.sleep(0.2)
                assert finished.status_code == 200, finished.text
            _assert_complete(_records(outage.read_url), streams)
            disk.free()
            assert not list((disk.path / "spool").glob("*.jsonl"))


def test_a_proxy_started_on_a_full_disk_serves_once_it_has_room(tmp_path: Path, disk: SmallDisk) -> None:
    """Restarted after its disk filled (and still full): it starts, refuses new calls with 507, and
    serves as soon as there is room, with no restart."""
    replica = FaultReplica()
    with serve_in_thread(replica) as (replica_url, _):
        settings = make_settings(f"sqlite:///{tmp_path / 'rolltap.db'}", [replica_url], tmp_path,
                                 recorder={"spool_dir": str(disk.path / "spool")})
        disk.fill()
        with run_proxy(settings) as proxy, httpx.Client(timeout=30) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            refused = http.post(f"{proxy.base_url('full', '0')}/chat/completions", json=body)
            assert refused.status_code == 507 and replica.stats.requests == 0
            _assert_507(refused)
            assert http.get(f"{proxy.url}/readyz").json()["status"] == "degraded"
            disk.free()
            assert http.get(f"{proxy.url}/readyz").json()["status"] == "ready"  # the journal opened by the probe
            served = http.post(f"{proxy.base_url('full', '1')}/chat/completions", json=body)
            assert served.status_code == 200, served.text
