"""Alembic environment: runs migrations on the connection `shared.db.migrate` hands in.

Offline (SQL script) mode is not used; migrations always run against a live database.
"""

from __future__ import annotations

from alembic import context

from shared.db.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through shared.db.migrate (it supplies the connection)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    compare_type=True,
    # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
