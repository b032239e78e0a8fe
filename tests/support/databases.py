"""Fresh, migrated databases for tests: a SQLite file or a new PostgreSQL database."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

PG_ADMIN_DSN = os.environ.get("ROLLTAP_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_base() -> str:
    # postgresql://user@host:port/db -> postgresql://user@host:port
    return PG_ADMIN_DSN.rsplit("/", 1)[0]


@contextmanager
def postgres_database() -> Iterator[str]:
    name = "rolltap_t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{_pg_base()}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def sqlite_database(directory: Path) -> Iterator[str]:
    yield f"sqlite:///{directory / 'rolltap.db'}"


@contextmanager
def database(kind: str, directory: Path) -> Iterator[str]:
    if kind == "postgresql":
        with postgres_database() as url:
            yield url
    else:
        with sqlite_database(directory) as url:
            yield url
