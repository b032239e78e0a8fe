"""PostgreSQL stopped (fast and immediate shutdown) and started again under 64 streaming agents.

Every call that got a 200 is recorded exactly once, nothing goes to `dead/`, and `finish`
never answers 500: while durability cannot be confirmed it answers 503 with Retry-After, and
the agent's retry on the same connection pool then succeeds. The cluster is a private one
(`tests/support/pg_cluster.py`); the shared server is never stopped. Streams come from the
fault replica (slow chunks keep them in flight across the stop).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.support.fault_replica import FaultReplica
from tests.support.pg_cluster import private_postgres
from tests.support.proxy_process import ProxyProcess
from tests.support.servers import free_port, serve_in_thread

AGENTS, TURNS = 64, 3
DOWN_S = 10.0  # long beside finish_timeout_s (1 s): a finish held until the database returns shows


@dataclass
class Outcomes:
    call_ids: list[str] = field(default_factory=list)
    finish_statuses: Counter[int] = field(default_factory=Counter)
    slowest_503_s: float = 0.0


async def _agent(proxy_url: str, rollout: str, http: httpx.AsyncClient, out: Outcomes) -> None:
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollout/{rollout}/attempt/0/v1", api_key="x",
                                http_client=http, max_retries=0)
    for turn in range(TURNS):
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=6, stream=True,
            extra_body={"fault": {"delay_s": 0.05}})
        text_ = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text_  # a 200 with the whole stream
        out.call_ids.append(stream.response.headers["x-rolltap-call-id"])
    deadline = time.monotonic() + 120
    while True:
        asked = time.monotonic()
        finished = await http.post(f"{proxy_url}/rollout/{rollout}/attempt/0/finish", json={"status": "succeeded"})
        out.finish_statuses[finished.status_code] += 1
        if finished.status_code == 503:
            out.slowest_503_s = max(out.slowest_503_s, time.monotonic() - asked)
        if finished.status_code == 200:
            return
        assert finished.status_code == 503, finished.text  # never 500
        assert finished.json()["error"]["type"] == "database_unavailable"
        assert time.monotonic() < deadline, "finish never succeeded after the database came back"
        await asyncio.sleep(float(finished.headers["retry-after"]))


def _spooled_total(body: str) -> float:
    match = re.search(r"^rolltap_records_spooled_total (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_shutdown_under_64_streaming_agents(mode: str, tmp_path: Path) -> None:
    with private_postgres() as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE rolltap")
        db_url = cluster.url.rsplit("/", 1)[0] + "/rolltap"
        out = Outcomes()
        with serve_in_thread(FaultReplica()) as (replica, _):
            # Its own process, as deployed: a proxy in a thread here shares one GIL with 64 agents and the
            # replica, and its answers would carry their scheduling delays (seen as 2-3 s on 2 cores).
            proxy = ProxyProcess(tmp_path, db_url, [replica], free_port(), ROLLTAP_PROXY__FINISH_TIMEOUT_S="1.0",
                                 ROLLTAP_PROXY__RECORDER__RETRY_INTERVAL_S="0.2")
            proxy.start()
            try:
                with httpx.Client(timeout=30) as http:
                    spooled_before = _spooled_total(http.get(f"{proxy.url}/metrics").text)

                    async def main() -> None:
                        async def outage() -> None:
                            await asyncio.sleep(0.8)  # streams are in flight
                            await asyncio.to_thread(cluster.stop, mode)
                            await asyncio.sleep(DOWN_S)
                            await asyncio.to_thread(cluster.start)

                        limits = httpx.Limits(max_connections=2 * AGENTS)
                        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
                            await asyncio.gather(outage(), *(_agent(proxy.url, f"o{i}", client, out)
                                                             for i in range(AGENTS)))

                    asyncio.run(main())
                    spooled = _spooled_total(http.get(f"{proxy.url}/metrics").text) - spooled_before
                    ready = http.get(f"{proxy.url}/readyz").json()
                proxy.sigterm()  # a graceful stop: its spool and journal are settled
                assert proxy.wait(30) == 0
            finally:
                proxy.stop()

        engine = create_engine(sync_url(db_url))
        with engine.connect() as conn:
            recorded = conn.execute(text("SELECT call_id FROM calls")).scalars().all()
            statuses = dict(conn.execute(text("SELECT status, count(*) FROM attempts GROUP BY status")).all())
        engine.dispose()

    print(f"\npg outage: {len(out.call_ids)} calls answered 200, {len(recorded)} recorded, {spooled:.0f} spooled "
          f"during the outage, finish answers {dict(out.finish_statuses)}, the slowest 503 in {out.slowest_503_s:.2f} s")
    assert len(out.call_ids) == AGENTS * TURNS
    assert sorted(recorded) == sorted(out.call_ids)  # every 200 recorded, exactly once
    assert not list((tmp_path / "spool" / "dead").glob("*"))
    assert not list((tmp_path / "spool").glob("*.jsonl"))  # the outage spool is written back
    assert 500 not in out.finish_statuses and out.finish_statuses[200] == AGENTS
    # An outage is answered (503 + Retry-After) within `finish_timeout_s` (barrier and write share it)
    # and a margin for a 2-core machine replaying PostgreSQL's WAL: never held until the database returns.
    # The margin was 3 s with a 6 s outage. On a slower machine (2026-12-07) the slowest 503 was 2.3-3.7 s
    # in 15 of 16 runs, this commit's and the one before's alike, 4.2 s once, and 5.2 s in a CI run beside
    # a vLLM test; an 8 s outage (more spooled) made it 3.5-4.3 s. So: a 10 s outage, a 6 s margin.
    assert out.slowest_503_s < 1.0 + 6.0 < DOWN_S, out.slowest_503_s
    assert statuses == {"succeeded": AGENTS}
    assert spooled > 0  # the outage was really hit by records, not dodged
    assert ready["checks"]["dead_letter_records"] == 0
