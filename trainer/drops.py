"""Storing why calls were left out of every triplet (`call_drops`), and counting them.

The trajectory builder decides; this module only writes its verdicts. Building is
repeatable (an export without `--mark-consumed`, a retried step), so writes are
upserts keyed by call: one row per call, the latest reason wins (settings such as
`max_prompt_len` may have changed between two builds).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from shared.db.models import CallDrop
from trainer.trajectory import Drop

__all__ = ["drop_counts", "record_drops"]

CHUNK = 500


def record_drops(conn: Connection | Session, drops: Sequence[Drop]) -> None:
    """Upsert one `call_drops` row per dropped call, in the caller's transaction."""
    if not drops:
        return
    dialect = conn.get_bind().dialect.name if isinstance(conn, Session) else conn.dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # Last verdict per call wins, also within one batch (PostgreSQL refuses to upsert a key twice).
    rows = list(
        {
            d.call_id: {
                "call_id": d.call_id,
                "rollout_id": d.rollout_id,
                "attempt_id": d.attempt_id,
                "reason": str(d.reason),
                "detail": d.detail,
            }
            for d in drops
        }.values()
    )
    for i in range(0, len(rows), CHUNK):
        stmt = insert(CallDrop).values(rows[i : i + CHUNK])
        stmt = stmt.on_conflict_do_update(
            index_elements=[CallDrop.call_id],
            set_={"reason": stmt.excluded.reason, "detail": stmt.excluded.detail},
        )
        conn.execute(stmt)


def drop_counts(conn: Connection | Session) -> dict[str, int]:
    """Stored drops by reason, most frequent first."""
    rows = conn.execute(
        select(CallDrop.reason, func.count()).group_by(CallDrop.reason).order_by(func.count().desc())
    ).all()
    return {str(reason): int(n) for reason, n in rows}
