"""A database that goes away and comes back, for real, on either backend (the `outage` fixture).

PostgreSQL goes down for real: the proxy reaches it through a TCP tap that the test cuts
(connections refused and reset) and restores. SQLite has no server to lose, and as root a
read-only file or directory does not stop writes. Its real failure mode is another process
holding the write lock (a long transaction, a backup): the writer waits
`sqlite_busy_timeout_ms`, then gets "database is locked". `cut` holds `BEGIN EXCLUSIVE`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from tests.support.databases import postgres_database
from tests.support.tcp_tap import TcpTap


@dataclass
class Outage:
    proxy_url: str  # the database URL the proxy is given (through the fault)
    read_url: str  # the same database, around the fault, for the test's own reads
    cut: Callable[[], None]
    restore: Callable[[], None]


class SqliteWriteLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None

    def cut(self) -> None:
        self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=10, check_same_thread=False)
        self.conn.execute("BEGIN EXCLUSIVE")

    def restore(self) -> None:
        if self.conn is not None:
            self.conn.execute("ROLLBACK")
            self.conn.close()
            self.conn = None


@contextmanager
def database_outage(kind: str, tmp_path: Path) -> Iterator[Outage]:
    """A fresh database of `kind` (migrated by whoever starts on it) that the test can cut and restore."""
    if kind == "sqlite":
        lock = SqliteWriteLock(tmp_path / "rolltap.db")
        url = f"sqlite:///{lock.path}"
        try:
            yield Outage(url, url, lock.cut, lock.restore)
        finally:
            lock.restore()
        return
    with postgres_database() as url:
        parsed = make_url(url)
        with TcpTap(parsed.host or "127.0.0.1", parsed.port or 5432) as tap:
            tapped = parsed.set(host="127.0.0.1", port=tap.port).render_as_string(hide_password=False)
            yield Outage(tapped, url, tap.cut, tap.restore)


def wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


