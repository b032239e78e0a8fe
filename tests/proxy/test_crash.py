"""`kill -9` of the proxy under load, four times: nothing the client saw complete is lost.

The proxy is a real process (`python -m proxy.main`); 64 agents stream through it from
this process, each carrying one attempt across all cycles, against the fault replica's
slow streams (1 s each, so that most calls are surely in flight at the kill). After each
restart, the agents go on with their attempts: a turn taken after the crash must not take
the seq of a call from before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fault_replica import FaultReplica
from tests.support.proxy_process import AgentLog, ProxyProcess, check_attempts, run_agents
from tests.support.servers import free_port, serve_in_thread

AGENTS = 64
CYCLES = 4


@pytest.fixture(scope="module")
def slow_replica() -> Iterator[str]:
    with serve_in_thread(FaultReplica()) as (url, _):
        yield url


def _body(i: int, k: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"agent {i} turn {k}"}], "stream": True,
            "max_tokens": 10, "fault": {"delay_s": 0.1}}


def test_kill9_cycles_lose_no_completed_call(slow_replica: str, db_url: str, tmp_path: Path) -> None:
    proxy = ProxyProcess(tmp_path, db_url, [slow_replica], free_port())
    log = AgentLog()
    try:
        for cycle in range(CYCLES):
            print(f"cycle {cycle}: proxy up in {proxy.start():.1f} s")
            load = asyncio.new_event_loop()
            # Each agent stops at its first call that does not complete: the kill cuts them all.
            future = load.create_task(run_agents(proxy.url, AGENTS, lambda i: (f"crash-{i}", "0"), _body,
                                                 asyncio.Event(), log))
            # Kill once every agent's first call completed and the next ones are mid-stream.
            deadline = time.monotonic() + 60
            while sum(t.is_complete for t in log.turns) < AGENTS * (cycle + 1) and time.monotonic() < deadline:
                load.run_until_complete(asyncio.sleep(0.05))
            load.run_until_complete(asyncio.sleep(0.4))
            proxy.kill9()
            load.run_until_complete(future)
            load.close()
        proxy.start()  # recovers the last cycle's journal before it serves
        counts = check_attempts(proxy.url, log)
        print(counts)
        proxy.sigterm()
        assert proxy.wait(60) == 0, proxy.log_tail()
    finally:
        proxy.stop()
    statuses = {t.http_status for t in log.turns}
    assert statuses <= {200, None}, statuses
    assert counts["attempts"] == AGENTS
    assert counts["complete_seen"] >= AGENTS * CYCLES
    # Calls in flight at each kill came back as interrupted records, not as nothing.
    assert counts["interrupted"] >= CYCLES, counts
    assert counts["incomplete_attempts"] >= 1
    # Recovery wrote everything, then the journals of the dead processes were removed.
    journal = tmp_path / "spool" / "journal"
    assert not [p for p in journal.iterdir() if not p.name.startswith(".")], list(journal.iterdir())
    assert proxy.log_path.read_text().count("journal: recovered") == CYCLES
