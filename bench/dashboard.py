"""The dashboard's attempt list on a large database: how long `GET /ui` takes through a running proxy.

Fills a fresh database with N attempts (default 100,000) by bulk SQL: rollouts in groups
of 4 attempts, a reward per attempt, statuses and policy versions spread over the rows.
Then starts a proxy on it (no replica needed for `/ui`) and times the list page over HTTP,
unfiltered, filtered (status, policy version, group, reward) and deep in the keyset
pagination, each `--repeat` times; prints the median and p95 per page as JSON.

    python -m bench.dashboard [--db sqlite|postgresql] [--attempts 100000] [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from pydantic import SecretStr
from sqlalchemy import insert, text

from shared.db.engine import create_sync_db
from shared.db.migrate import upgrade
from shared.db.models import Attempt, Reward, Rollout
from shared.settings import DbSettings, ProxySettings, RecorderSettings, Settings
from tests.support.databases import database
from tests.support.servers import run_proxy

STATUSES = ("succeeded", "succeeded", "succeeded", "failed", "cancelled", "running")
CHUNK = 10_000


def fill(url: str, attempts: int) -> float:
    """Insert `attempts` attempts (groups of 4) with a reward each; returns the seconds it took."""
    settings = DbSettings(url=url)
    upgrade(settings)
    engine = create_sync_db(settings)
    started = time.perf_counter()
    t0 = datetime.now(UTC) - timedelta(days=7)
    try:
        with engine.begin() as conn:
            for lo in range(0, attempts // 4, CHUNK):
                conn.execute(insert(Rollout), [{"rollout_id": f"task-{i}", "group_id": f"g-{i // 8}"}
                                               for i in range(lo, min(lo + CHUNK, attempts // 4))])
            for lo in range(0, attempts, CHUNK):
                rows = range(lo, min(lo + CHUNK, attempts))
                conn.execute(insert(Attempt), [
                    {"rollout_id": f"task-{i // 4}", "attempt_id": f"a{i % 4}", "status": STATUSES[i % len(STATUSES)],
                     "num_calls": 3, "policy_version": i * 50 // attempts,
                     "created_at": t0 + timedelta(seconds=6 * i)} for i in rows])
                conn.execute(insert(Reward), [{"rollout_id": f"task-{i // 4}", "attempt_id": f"a{i % 4}",
                                               "value": float(i % 4 == 0)} for i in rows])
        with engine.begin() as conn:
            conn.execute(text("ANALYZE"))  # planner statistics, as a database in use has them
    finally:
        engine.dispose()
    return time.perf_counter() - started


def time_pages(base: str, token: str, repeat: int, attempts: int) -> dict[str, dict[str, float]]:
    deep_cursor = attempts // 2  # keyset: half-way down the list costs the same as the first page
    pages = {
        "first page": "/ui",
        "status=failed": "/ui?status=failed",
        "policy version 25": "/ui?version=25",
        "group g-100": "/ui?group=g-100",
        "reward >= 0.5": "/ui?reward_min=0.5",
        "deep page (keyset)": f"/ui?before={deep_cursor}",
        "last 24 h": "/ui?since=" + (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M"),
    }
    out = {}
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {token}"}, timeout=30) as client:
        for name, path in pages.items():
            client.get(path).raise_for_status()  # warm: caches, the connection pool
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                response = client.get(path)
                times.append((time.perf_counter() - t) * 1000)
                response.raise_for_status()
                assert "<table class=\"attempts\">" in response.text
            times.sort()
            out[name] = {"median_ms": round(statistics.median(times), 1),
                         "p95_ms": round(times[int(0.95 * (len(times) - 1))], 1),
                         "rows": response.text.count("<tr class=")}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--attempts", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, database(args.db, Path(tmp)) as url:
        fill_s = fill(url, args.attempts)
        proxy_settings = ProxySettings(replicas=[], port=0, admin_token=SecretStr("bench"),
                                       recorder=RecorderSettings(spool_dir=Path(tmp) / "spool"))
        settings = Settings(db=DbSettings(url=url), proxy=proxy_settings)
        with run_proxy(settings) as proxy:
            pages = time_pages(proxy.url, "bench", args.repeat, args.attempts)
    print(json.dumps({"db": args.db, "attempts": args.attempts, "fill_s": round(fill_s, 1), "pages": pages},
                     indent=2))


if __name__ == "__main__":
    main()
