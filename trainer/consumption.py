"""At-most-once consumption of attempts: the rows that say a training step or an export used them.

This module owns the write side of "exactly once". The reader skips attempts that have a
row in `training_step_attempts` or `export_attempts`; these functions write those rows
inside the caller's transaction, so the step (and the policy version it produced, which
the caller inserts in the same transaction) commits together with its consumption, or
not at all. A crash before commit leaves the attempts unconsumed: they are read again.

Two consumers racing for the same attempt (two trainers, a trainer and an export) are
serialised by first taking a write lock on the attempt rows (a no-op UPDATE: a row lock
on PostgreSQL, the database write lock on SQLite), then checking both tables; the loser
gets `AlreadyConsumed` and must roll back. The primary keys on `attempt_pk` are the
last line of defence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.orm import Session

from shared.db.models import Attempt, Export, ExportAttempt, TrainingStep, TrainingStepAttempt

__all__ = ["AlreadyConsumed", "lock_unconsumed", "record_export", "record_training_step"]

# Bound parameters per statement; well under SQLite's and PostgreSQL's limits.
CHUNK = 500

Conn = Connection | Session


class AlreadyConsumed(RuntimeError):
    """Some of the attempts were consumed by another step or export; roll back and read again."""

    def __init__(self, attempt_pks: Sequence[int]) -> None:
        super().__init__(f"{len(attempt_pks)} attempt(s) already consumed, e.g. attempt pk {attempt_pks[0]}")
        self.attempt_pks = list(attempt_pks)


def chunks(items: Sequence[int], size: int = CHUNK) -> Iterator[list[int]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def lock_unconsumed(conn: Conn, attempt_pks: Sequence[int]) -> None:
    """Lock the attempt rows for this transaction and raise `AlreadyConsumed` if any was consumed."""
    pks = sorted(set(attempt_pks))  # one lock order for every consumer: no deadlocks between them
    for part in chunks(pks):
        # Writing the row (to itself) is the one lock both backends honour.
        conn.execute(update(Attempt).where(Attempt.id.in_(part)).values(num_calls=Attempt.num_calls))
    taken: list[int] = []
    for part in chunks(pks):
        for table in (TrainingStepAttempt, ExportAttempt):
            taken += conn.execute(select(table.attempt_pk).where(table.attempt_pk.in_(part))).scalars().all()
    if taken:
        raise AlreadyConsumed(sorted(taken))


def record_training_step(
    conn: Conn,
    *,
    step: int,
    attempt_pks: Sequence[int],
    policy_version: int | None = None,
    metrics: dict[str, Any] | None = None,
) -> None:
    """Insert the `TrainingStep` and one `TrainingStepAttempt` per consumed attempt.

    Runs in the caller's transaction; the caller commits it together with the
    `PolicyVersion` the step produced. Raises `AlreadyConsumed` (roll back) on a race.
    """
    lock_unconsumed(conn, attempt_pks)
    conn.execute(insert(TrainingStep).values(step=step, policy_version=policy_version, metrics=metrics))
    for part in chunks(sorted(set(attempt_pks))):
        conn.execute(insert(TrainingStepAttempt), [{"attempt_pk": pk, "step": step} for pk in part])


def record_export(
    conn: Conn, *, format: str, path: str, attempt_pks: Sequence[int], num_triplets: int
) -> int:
    """Insert an `Export` and its `ExportAttempt` rows in the caller's transaction; returns the export id."""
    pks = sorted(set(attempt_pks))
    lock_unconsumed(conn, pks)
    export_id = conn.execute(
        insert(Export)
        .values(format=format, path=path, num_attempts=len(pks), num_triplets=num_triplets)
        .returning(Export.id)
    ).scalar_one()
    for part in chunks(pks):
        conn.execute(insert(ExportAttempt), [{"attempt_pk": pk, "export_id": export_id} for pk in part])
    return int(export_id)
