"""Revision 0002 (trainer tables) upgrades, matches the models, and downgrades, on both backends."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from shared.db.engine import create_sync_db
from shared.db.migrate import alembic_config, upgrade
from shared.db.models import Base
from shared.settings import DbSettings

TRAINER_TABLES = {"call_drops", "exports", "export_attempts"}


def test_0002_from_0001_to_head_and_back(db_url: str) -> None:
    settings = DbSettings(url=db_url)
    upgrade(settings, "0001")
    engine = create_sync_db(settings)
    try:
        with engine.connect() as conn:
            assert not TRAINER_TABLES & set(inspect(conn).get_table_names())
        upgrade(settings)
        with engine.connect() as conn:
            assert TRAINER_TABLES <= set(inspect(conn).get_table_names())
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
            assert diff == []
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "0001")
        with engine.connect() as conn:
            assert not TRAINER_TABLES & set(inspect(conn).get_table_names())
        upgrade(settings)
    finally:
        engine.dispose()
