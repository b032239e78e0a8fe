"""Schema migrations, run programmatically: `upgrade(settings)` brings a database to head.

Alembic is driven from code (no alembic.ini on the user's side), so the installed
package migrates wherever it runs. `python -m shared.db.migrate revision -m MSG`
autogenerates a new revision for developers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection

from shared.db.engine import create_sync_db
from shared.settings import DbSettings, Settings

__all__ = ["alembic_config", "upgrade"]

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(settings: DbSettings, revision: str = "head") -> None:
    """Apply migrations up to `revision`. Safe to call on every start: a no-op at head."""
    engine = create_sync_db(settings)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), revision)
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description="Rolltap schema migrations")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upgrade", help="migrate the database in ROLLTAP_DB__URL to head")
    up.add_argument("revision", nargs="?", default="head")
    rev = sub.add_parser("revision", help="autogenerate a revision from the models")
    rev.add_argument("-m", "--message", required=True)
    args = parser.parse_args()
    settings = Settings()
    if args.cmd == "upgrade":
        upgrade(settings.db, args.revision)
        return
    engine = create_sync_db(settings.db)
    with engine.begin() as conn:
        command.revision(alembic_config(conn), message=args.message, autogenerate=True)


if __name__ == "__main__":
    main()
