"""The dashboard's attempt list pages through every attempt once, newest first, filters included (keyset)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from html import unescape
from typing import Any

import httpx
from sqlalchemy import insert

from shared.db.engine import create_sync_db
from shared.db.models import Attempt, Reward, Rollout
from shared.settings import DbSettings
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

N = 130  # three pages of 50


def _pages(proxy_url: str, path: str) -> list[list[str]]:
    pages = []
    while path:
        html = httpx.get(proxy_url + path, headers={"authorization": "Bearer t"}, timeout=60).text
        pages.append(re.findall(r'<a href="/ui/attempt/([^"]+)">', html))
        older = re.search(r'<a class="older" href="([^"]+)"', html)
        path = unescape(older.group(1)) if older else ""
    return pages


def test_pages_cover_every_attempt_once(proxy_for: ProxyFactory, db_url: str) -> None:
    t0 = datetime.now(UTC) - timedelta(hours=1)
    with serve_in_thread(FaultReplica()) as (replica, _), proxy_for([replica]) as proxy:
        engine = create_sync_db(DbSettings(url=db_url))
        try:
            with engine.begin() as conn:
                conn.execute(insert(Rollout), [{"rollout_id": f"t{i}", "group_id": "even" if i % 2 == 0 else None}
                                               for i in range(N)])
                rows: list[dict[str, Any]] = [{"rollout_id": f"t{i}", "attempt_id": "a", "status": "succeeded",
                                               "policy_version": i % 3, "created_at": t0 + timedelta(seconds=i)}
                                              for i in range(N)]
                conn.execute(insert(Attempt), rows)
                conn.execute(insert(Reward), [{"rollout_id": f"t{i}", "attempt_id": "a", "value": i / N}
                                              for i in range(N)])
        finally:
            engine.dispose()
        everything = _pages(proxy.url, "/ui")
        version_1 = _pages(proxy.url, "/ui?version=1")
        even_high = _pages(proxy.url, "/ui?group=even&reward_min=0.5")
        recent = _pages(proxy.url, "/ui?since=" + (t0 + timedelta(seconds=100)).strftime("%Y-%m-%dT%H:%M:%S"))
        lone = _pages(proxy.url, "/ui?group=t1")  # an unregistered group: the rollout itself
    assert [len(p) for p in everything] == [50, 50, 30]
    assert [a for p in everything for a in p] == [f"t{i}/a" for i in reversed(range(N))]  # newest first, once each
    assert [a for p in version_1 for a in p] == [f"t{i}/a" for i in reversed(range(N)) if i % 3 == 1]
    assert [a for p in even_high for a in p] == [f"t{i}/a" for i in reversed(range(N)) if i % 2 == 0 and i / N >= 0.5]
    assert [a for p in recent for a in p] == [f"t{i}/a" for i in reversed(range(100, N))]
    assert lone == [["t1/a"]]
