"""`proxy/outage.py` on real errors from real databases and drivers: "not now" versus "not this row".

Each error is produced for real (a held SQLite lock, a terminated PostgreSQL session, a refused
connection, a unique violation, U+0000 in JSONB), through the drivers the proxy uses
(sqlite3, asyncpg) and the one the CLI and trainer use (psycopg).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.outage import is_outage, sqlstate
from shared.db.engine import async_url, sync_url
from tests.support.databases import postgres_database
from tests.support.servers import free_port


def _error(run: Callable[[], Any]) -> BaseException:
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the error is what is tested
        return exc
    raise AssertionError("no error raised")


def test_sqlite_lock_is_an_outage_and_a_missing_table_is_not(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (a INTEGER PRIMARY KEY)")
    holder.execute("BEGIN EXCLUSIVE")
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    try:
        def write() -> None:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (1)"))

        assert is_outage(_error(write))  # "database is locked"
        holder.execute("ROLLBACK")

        def missing() -> None:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO nope VALUES (1)"))

        assert not is_outage(_error(missing))
    finally:
        engine.dispose()
        holder.close()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_postgres_errors(driver: str) -> None:
    with postgres_database() as url:
        async def run(statements: list[str], on: str = url) -> None:
            target = async_url(on) if driver == "asyncpg" else sync_url(on).set(drivername="postgresql+psycopg_async")
            engine = create_async_engine(target)
            try:
                async with engine.connect() as conn:
                    for statement in statements:
                        await conn.execute(text(statement))
                    await conn.commit()
            finally:
                await engine.dispose()

        def error(statements: list[str], on: str = url) -> BaseException:
            return _error(lambda: asyncio.run(run(statements, on)))

        # The session is terminated by an administrator: 57P01.
        terminated = error(["SELECT pg_terminate_backend(pg_backend_pid())", "SELECT 1"])
        assert is_outage(terminated)
        # Nothing listens: connection refused.
        refused = url.replace(url.rsplit("@", 1)[1].split("/")[0], f"127.0.0.1:{free_port()}")
        assert is_outage(error(["SELECT 1"], on=refused))
        # Rows no retry can write: a unique violation (23505), U+0000 in JSONB (22P05).
        duplicate = error(["CREATE TABLE u (a int PRIMARY KEY)", "INSERT INTO u VALUES (1), (1)"])
        assert sqlstate(duplicate) == "23505" and not is_outage(duplicate)
        nul = error(["SELECT '\"\\u0000\"'::jsonb"])
        assert sqlstate(nul) == "22P05" and not is_outage(nul)
        # Serialization failures and the like are retried: decided by SQLSTATE, whatever the class.
        serialization = error(["DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$"])
        cannot_connect_now = error(["DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '57P03'; END $$"])
        too_many = error(["DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '53300'; END $$"])
        assert all(is_outage(e) for e in (serialization, cannot_connect_now, too_many))
