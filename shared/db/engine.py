"""The one place engines are made: URL normalisation, drivers, SQLite pragmas.

Users write plain URLs (`sqlite:///./rolltap.db`, `postgresql://u@h/db`); the async
side gets aiosqlite/asyncpg and the sync side (alembic, scripts) sqlite3/psycopg.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from shared.settings import DbSettings

__all__ = ["SQLITE_PAGE_SIZE", "async_url", "create_async_db", "create_sync_db", "is_sqlite", "redacted_url", "sync_url"]

_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}
_SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}


def _backend(url: URL) -> str:
    backend = url.get_backend_name()
    if backend in ("postgres", "postgresql"):
        return "postgresql"
    if backend == "sqlite":
        return "sqlite"
    raise ValueError(f"unsupported database {url.render_as_string(hide_password=True)!r}: use sqlite or postgresql")


def redacted_url(url: str) -> str:
    """The URL as it may be logged: any password replaced by `***`."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is logged as nothing rather than risk a secret
        return "<unparsable database URL>"


def async_url(url: str) -> URL:
    parsed = make_url(url)
    return parsed.set(drivername=_ASYNC_DRIVERS[_backend(parsed)])


def sync_url(url: str) -> URL:
    parsed = make_url(url)
    return parsed.set(drivername=_SYNC_DRIVERS[_backend(parsed)])


def is_sqlite(url: str) -> bool:
    return _backend(make_url(url)) == "sqlite"


SQLITE_PAGE_SIZE = 16384


def _sqlite_pragmas(settings: DbSettings) -> Any:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        # Before WAL, which fixes it: 16 KiB pages for a database still without tables (an existing
        # one keeps its own). A call's row holds its request twice (as sent and as JSON) and an
        # agent's request its whole context: at 32 KB, 4 KiB pages made each row a chain of
        # overflow pages, and the write cost 8-17% more (bench/record_write.py --prompt-bytes).
        cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
        # WAL lets readers (GET attempt, the trainer) run beside the one writer.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(settings.sqlite_busy_timeout_ms)}")
        cursor.execute(f"PRAGMA synchronous={settings.sqlite_synchronous}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return on_connect


def create_async_db(
    settings: DbSettings, *, pool_size: int | None = None, json_serializer: Callable[[Any], str] | None = None
) -> AsyncEngine:
    """An async engine for `settings.url`. `pool_size` overrides the PostgreSQL pool size;
    `json_serializer` replaces the stdlib `json.dumps` used to write JSON columns."""
    url = async_url(settings.url)
    kwargs: dict[str, Any] = {}
    if json_serializer is not None:
        kwargs["json_serializer"] = json_serializer
    if url.get_backend_name() == "postgresql":
        kwargs.update(pool_size=pool_size or settings.pool_size, pool_pre_ping=True)
    engine = create_async_engine(url, **kwargs)
    if url.get_backend_name() == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas(settings))
    return engine


def create_sync_db(
    settings: DbSettings, *, keep_connection: bool = False, json_serializer: Callable[[Any], str] | None = None
) -> Engine:
    """A sync engine (migrations, CLI reports). Not pooled: these are short-lived.

    `keep_connection`: keep one connection open between uses instead (the proxy's SQLite
    writer thread, which writes a batch every few milliseconds)."""
    url = sync_url(settings.url)
    kwargs: dict[str, Any] = {"poolclass": NullPool}
    if keep_connection:
        kwargs = {"pool_size": 1, "max_overflow": 0}
    if json_serializer is not None:
        kwargs["json_serializer"] = json_serializer
    engine = create_engine(url, **kwargs)
    if url.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas(settings))
    return engine
