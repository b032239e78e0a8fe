"""`shared/db/engine.py` on SQLite: new databases get large pages, existing ones keep theirs and still work."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import text

from shared.db.engine import SQLITE_PAGE_SIZE, create_sync_db
from shared.db.migrate import upgrade
from shared.settings import DbSettings


def _pragmas(path: Path) -> tuple[int, str]:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA page_size").fetchone()[0], conn.execute("PRAGMA journal_mode").fetchone()[0]


def test_a_new_database_gets_the_large_pages_and_wal(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    upgrade(DbSettings(url=f"sqlite:///{path}"))
    assert _pragmas(path) == (SQLITE_PAGE_SIZE, "wal") and SQLITE_PAGE_SIZE != 4096


def test_an_existing_database_keeps_its_pages_and_takes_writes(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # as an earlier version left it: 4 KiB pages, WAL
        conn.execute("PRAGMA page_size=4096")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE earlier (x INTEGER)")
    settings = DbSettings(url=f"sqlite:///{path}")
    upgrade(settings)
    engine = create_sync_db(settings)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO rollouts (rollout_id) VALUES ('r')"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM rollouts")).scalar() == 1
    finally:
        engine.dispose()
    assert _pragmas(path) == (4096, "wal")
