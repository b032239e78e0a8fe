"""The proxy's SQL: every statement it runs against the database lives here.

Writes take an `AsyncConnection` inside a transaction opened by the caller (the
recorder's writer); reads take their own connection. Statements are portable between
SQLite and PostgreSQL; the two upsert dialects are chosen in one helper.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import weakref
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from operator import attrgetter, itemgetter
from typing import Any

from sqlalchemy import Connection, Dialect, delete, func, insert, select, text, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.db.models import (
    Attempt,
    Call,
    CallLease,
    ClusterState,
    LoraAdapter,
    PolicyVersion,
    Proxy,
    Replica,
    ReplicaEjection,
    Reward,
    Rollout,
    UndurableCall,
)
from shared.errors import Conflict, NotFound
from shared.types import CallRecord, CallStatus
from shared.verbatim import db_safe, db_safe_text, dumps_exact, dumps_keys, overlay_exact

__all__ = [
    "add_reward",
    "add_undurable_sync",
    "body_text",
    "dumps_json",
    "finish_attempt",
    "interrupted_calls",
    "load_active_policy",
    "load_adapter",
    "read_attempt",
    "register_rollout",
    "remove_undurable_sync",
    "save_adapter",
    "save_base_policy",
    "SeqCounters",
    "set_active_policy",
    "undurable_calls",
    "upsert_replica",
    "write_calls",
    "write_calls_sync",
    # the cluster (`proxy.cluster`): PostgreSQL only
    "add_leases",
    "ack_epoch",
    "bump_epoch",
    "claim_dead_proxies",
    "count_leases",
    "deregister_proxy",
    "ejected_elsewhere",
    "heartbeat",
    "lagging_proxies",
    "read_cluster_state",
    "register_proxy",
    "release_leases_sync",
    "set_ejections",
    "unaccounted_proxies",
]


class Encoded:
    """A JSON column value already encoded (by `_make_storable`): written as it is."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


def dumps_json(value: Any) -> str:
    """JSON columns as the writer encodes them: orjson, several times cheaper than `json.dumps`.

    Request and response bodies were parsed by orjson, so orjson can encode them; anything it
    refuses (a value from elsewhere) falls back to the stdlib, as before.
    """
    if type(value) is Encoded:
        return value.text.decode()
    try:
        return dumps_keys(value).decode()
    except TypeError:
        return json.dumps(value)


def _insert(conn: AsyncConnection | Connection, table: Any) -> postgresql.Insert | sqlite.Insert:
    # Both dialects' inserts have the same on_conflict_* API; SQLAlchemy's generic Insert has none.
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def _ensure_attempts_sync(conn: Connection, keys: dict[tuple[str, str], int | None]) -> None:
    """Create missing rollout and attempt rows (the first call creates them; registration is optional)."""
    if not keys:
        return
    rollouts = sorted({rid for rid, _ in keys})
    conn.execute(
        _insert(conn, Rollout).on_conflict_do_nothing(index_elements=["rollout_id"]),
        [{"rollout_id": rid} for rid in rollouts],
    )
    conn.execute(
        _insert(conn, Attempt).on_conflict_do_nothing(index_elements=["rollout_id", "attempt_id"]),
        [{"rollout_id": rid, "attempt_id": aid, "policy_version": pv} for (rid, aid), pv in sorted(keys.items())],
    )


async def _ensure_attempts(conn: AsyncConnection, keys: dict[tuple[str, str], int | None]) -> None:
    await conn.run_sync(_ensure_attempts_sync, keys)


# The columns a record fills, read straight off the record: a shallow row. (A deep copy through
# `dataclasses.asdict` cost more than the insert itself; the record is not changed after it is
# queued, so no copy is needed.)
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(CallRecord) if f.name != "arrival")
_row_values = attrgetter(*_ROW_FIELDS)


# String columns a client or replica fills, with their lengths (see `shared/db/models.py`).
_TEXT_COLUMNS = {"requested_model": 256, "served_model": 256, "finish_reason": 32, "replica": 512}
_EXACT_FIELDS = ("request", "response", "error")


def _row(record: CallRecord, seq: int | None) -> dict[str, Any]:
    row = dict(zip(_ROW_FIELDS, _row_values(record), strict=True))
    row["seq"] = seq
    _make_storable(row)
    return row


def _make_storable(row: dict[str, Any]) -> None:
    """Make the queryable copies storable on both databases, keeping exact values beside them.

    The exact bytes are in `request_body`/`response_body`; this keeps the parsed JSON exact
    too (`json_exact`) whenever JSONB or a driver could not take it as it is.
    """
    safe = {name: db_safe(row[name]) for name in _EXACT_FIELDS}
    is_exact = not any(changed for _, changed, _ in safe.values())
    # ASCII or UTF-8 JSON text: storable in a TEXT column on both databases.
    row["json_exact"] = None if is_exact else dumps_exact({name: row[name] for name in _EXACT_FIELDS}).decode()
    for name, (value, _, encoded) in safe.items():
        row[name] = Encoded(encoded) if encoded is not None else value
    row["usage"] = db_safe(row["usage"])[0]  # token ids and logprobs are numbers: storable as they are
    for name, max_len in _TEXT_COLUMNS.items():
        row[name] = db_safe_text(row[name], max_len)  # exact in the request or response


class SeqCounters:
    """The next sequence number of each attempt this process has written calls of.

    Handing numbers out here saves a database round trip per attempt per batch. The
    database stays the judge: the unique index on (rollout_id, attempt_id, seq) refuses a
    number another writer took (another proxy on the same database, the cluster's reaper,
    `rolltap-proxy spool replay`), and `write_calls_sync` then renumbers from the database.
    A counter is only ever behind the database, never ahead (which would leave a gap):
    `write_calls_sync` stages what it took, and the caller commits the staged counters only
    once its transaction committed, or forgets them all when anything failed.

    An attempt present here also has its rollout and attempt rows: they were committed
    with its first calls, so no batch asks again.
    """

    # Forgetting an attempt costs one query when it writes again; this bounds the memory.
    MAX_ATTEMPTS = 1 << 16

    def __init__(self) -> None:
        self._next: dict[tuple[str, str], int] = {}
        self._staged: dict[tuple[str, str], int] = {}

    def get(self, key: tuple[str, str]) -> int | None:
        return self._next.get(key)

    def stage(self, taken: dict[tuple[str, str], int]) -> None:
        self._staged = taken

    def commit(self) -> None:
        """The staged counters' transaction committed: they are now known."""
        for key, value in self._staged.items():
            self._next.pop(key, None)  # to the end: the least recently written go first
            self._next[key] = value
        self._staged = {}
        while len(self._next) > self.MAX_ATTEMPTS:
            del self._next[next(iter(self._next))]

    def forget(self) -> None:
        """A write failed: what it staged, and anything it might have shown wrong, is dropped."""
        self._next.clear()
        self._staged = {}


# The columns a batch insert fills, in order: the record's, its number, and the exact JSON.
_INSERT_COLUMNS = (*_ROW_FIELDS, "seq", "json_exact")
_SEQ_INDEX = ("rollout_id", "attempt_id", "seq")  # the unique index that guards the numbers
# Under the attempts' row locks one renumbering finds every number taken; a few more tries
# only cover a writer that numbers without them (none does), rather than loop forever.
_RENUMBER_TRIES = 8


class _Statements:
    """A dialect's batch statements, rendered once, and its columns' bind processors.

    The rows go to the driver as prebuilt tuples in one `executemany` (SQLite) or as one
    array per column in a single statement (PostgreSQL), below the ORM and Core: building
    and processing a parameter dict per row through Core cost more than the database's
    own work. The values are encoded by the very bind processors Core would apply (JSON by
    the engine's serializer, `dumps_json`; datetimes as SQLite stores them), so what is
    stored is unchanged.
    """

    def __init__(self, dialect: Dialect) -> None:
        columns = Call.__table__.c
        processors = (_fast_processor(columns[name].type.dialect_impl(dialect), dialect) for name in _INSERT_COLUMNS)
        self.processors = tuple((index, process) for index, process in enumerate(processors) if process is not None)
        quote = dialect.identifier_preparer.quote
        calls, attempts = quote(Call.__tablename__), quote(Attempt.__tablename__)
        names = ", ".join(quote(name) for name in _INSERT_COLUMNS)
        target = ", ".join(quote(name) for name in _SEQ_INDEX)
        self.is_postgresql = dialect.name == "postgresql"
        if self.is_postgresql:
            # One statement whatever the batch size (one prepared statement), and RETURNING
            # says which rows went in: asyncpg's executemany reports no row count.
            arrays = ", ".join(f"{_placeholder(dialect, i)}::{columns[name].type.compile(dialect=dialect)}[]"
                               for i, name in enumerate(_INSERT_COLUMNS))
            self.insert = (f"INSERT INTO {calls} ({names}) SELECT * FROM unnest({arrays}) "
                           f"ON CONFLICT ({target}) DO NOTHING RETURNING call_id")
        else:
            values = ", ".join(_placeholder(dialect, i) for i in range(len(_INSERT_COLUMNS)))
            self.insert = f"INSERT INTO {calls} ({names}) VALUES ({values}) ON CONFLICT ({target}) DO NOTHING"
        self.count = (f"UPDATE {attempts} SET num_calls = num_calls + {_placeholder(dialect, 0)} "
                      f"WHERE rollout_id = {_placeholder(dialect, 1)} AND attempt_id = {_placeholder(dialect, 2)}")


# SQLite's DATETIME text as SQLAlchemy writes it by default (`sqlite.DATETIME._storage_format`).
_SQLITE_DATETIME_FORMAT = "%(year)04d-%(month)02d-%(day)02d %(hour)02d:%(minute)02d:%(second)02d.%(microsecond)06d"


def _sqlite_datetime(value: datetime | None) -> str | None:
    """SQLAlchemy's SQLite DATETIME text, made in C (`isoformat`) rather than by %-formatting seven
    fields: over half of the bind processors' cost per record (three columns). Its time zone is dropped, as there."""
    return None if value is None else value.isoformat(" ", "microseconds")[:26]


def _fast_processor(impl: Any, dialect: Dialect) -> Any:
    """A column's bind processor: Core's own, or the same text made faster (`_sqlite_datetime`)."""
    if isinstance(impl, sqlite.DATETIME) and impl._storage_format == _SQLITE_DATETIME_FORMAT:
        return _sqlite_datetime
    return impl.bind_processor(dialect)


def _placeholder(dialect: Dialect, index: int) -> str:
    if dialect.paramstyle == "qmark":
        return "?"
    if dialect.paramstyle == "numeric_dollar":
        return f"${index + 1}"
    if dialect.paramstyle in ("format", "pyformat"):
        return "%s"
    raise NotImplementedError(f"parameter style {dialect.paramstyle!r}")


# Per dialect instance: the bind processors hold the engine's JSON serializer.
_STATEMENTS: weakref.WeakKeyDictionary[Dialect, _Statements] = weakref.WeakKeyDictionary()


def _statements(conn: Connection) -> _Statements:
    found = _STATEMENTS.get(conn.dialect)
    if found is None:
        found = _STATEMENTS[conn.dialect] = _Statements(conn.dialect)
    return found


_insert_values = itemgetter(*_INSERT_COLUMNS)


def _encoded(stmts: _Statements, record: CallRecord, seq: int | None) -> tuple[Any, ...]:
    values = list(_insert_values(_row(record, seq)))
    for index, process in stmts.processors:
        values[index] = process(values[index])
    return tuple(values)  # the driver-level executemany takes tuples


def _insert_rows(conn: Connection, stmts: _Statements, rows: list[tuple[Any, ...]]) -> set[str] | None:
    """Insert `rows`, skipping any whose number is taken; the call ids that went in (None: all did)."""
    if stmts.is_postgresql:
        columns = [list(column) for column in zip(*rows, strict=True)]
        return {row[0] for row in conn.exec_driver_sql(stmts.insert, tuple(columns))}
    if conn.exec_driver_sql(stmts.insert, rows).rowcount == len(rows):
        return None
    # sqlite3 counts the rows its executemany inserted; which ones, only the table says. A call id
    # in the table is one of these rows: an existing one would have failed the insert.
    call_id = _INSERT_COLUMNS.index("call_id")
    return set(conn.execute(select(Call.call_id).where(Call.call_id.in_([row[call_id] for row in rows]))).scalars())


def _next_seqs(conn: Connection, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The next free number of each attempt, from its calls in the database."""
    keys = sorted(keys)
    found = dict.fromkeys(keys, 0)
    for rid, aid, top in conn.execute(
            select(Call.rollout_id, Call.attempt_id, func.max(Call.seq))
            .where(tuple_(Call.rollout_id, Call.attempt_id).in_(keys))
            .group_by(Call.rollout_id, Call.attempt_id)):
        if top is not None:
            found[(str(rid), str(aid))] = top + 1
    return found


def write_calls_sync(conn: Connection, records: list[CallRecord], *, skip_existing: bool = False,
                     release_leases: bool = False, seqs: SeqCounters | None = None) -> int:
    """Insert a batch of call records; returns how many were inserted.

    Sequence numbers come from `seqs` (the recording process's counters; without it, or for
    an attempt it does not know, from the database), and the insert skips any number the
    unique (rollout_id, attempt_id, seq) index already holds: the calls of an attempt with
    one skipped are taken out again and renumbered after the database's highest, so they
    stay dense and in order. Within a batch, calls are numbered in the order they started.

    Each attempt's `num_calls` grows by its calls, in one statement for the batch, before
    the insert, in key order: on PostgreSQL that row-locks the attempts, so of several
    proxies sharing a database one at a time inserts an attempt's calls (a renumbering
    finds the other's committed), and they take their locks in the same order. An attempt
    the counters do not know gets its rollout and attempt rows first (the first call
    creates them), then its next number from the database.

    `skip_existing` makes a replay of spooled batches idempotent. `release_leases` deletes
    the calls' leases (`proxy.cluster`) in the same transaction, so another proxy sees a
    call either in flight or recorded, never neither. The numbers taken are staged in
    `seqs`; the caller commits them once its transaction committed (`SeqCounters`).

    Synchronous so that SQLite's writer can run a whole batch in its own thread with one
    hop (`Recorder`); `write_calls` runs it on an async connection (PostgreSQL).
    """
    if release_leases and records:
        release_leases_sync(conn, [r.call_id for r in records])
    if skip_existing and records:
        existing: dict[str, str] = {call_id: status for call_id, status in conn.execute(
            select(Call.call_id, Call.status).where(Call.call_id.in_([r.call_id for r in records])))}
        _upgrade_interrupted_sync(conn, [r for r in records if existing.get(r.call_id) == CallStatus.INTERRUPTED
                                         and r.status != CallStatus.INTERRUPTED])
        records = [r for r in records if r.call_id not in existing]
    if not records:
        return 0
    by_attempt: dict[tuple[str, str], list[CallRecord]] = defaultdict(list)
    untracked: list[CallRecord] = []
    for record in records:
        key = record.attempt_key
        if key is not None:
            by_attempt[key].append(record)
        else:
            untracked.append(record)
    groups = dict(sorted(by_attempt.items()))
    for recs in groups.values():
        recs.sort(key=lambda r: (r.started_at, r.arrival))
    known = {key: n for key in groups if (n := seqs.get(key) if seqs is not None else None) is not None}
    unknown = [key for key in groups if key not in known]
    if unknown:
        _ensure_attempts_sync(conn, {key: groups[key][0].policy_version for key in unknown})
    stmts = _statements(conn)
    if groups:
        conn.exec_driver_sql(stmts.count, [(len(recs), *key) for key, recs in groups.items()])
    if unknown:
        known.update(_next_seqs(conn, unknown))
    rows = [_encoded(stmts, r, known[key] + i) for key, recs in groups.items() for i, r in enumerate(recs)]
    rows.extend(_encoded(stmts, r, None) for r in untracked)
    pending = groups
    for _ in range(_RENUMBER_TRIES):
        inserted = _insert_rows(conn, stmts, rows) if rows else None
        if inserted is None:
            break
        pending = {key: recs for key, recs in pending.items() if any(r.call_id not in inserted for r in recs)}
        if not pending:
            break
        # Another writer took some of these numbers: take this batch's calls of those attempts out
        # again (their order must hold) and number them after the database's highest.
        ours = [r.call_id for recs in pending.values() for r in recs if r.call_id in inserted]
        if ours:
            conn.execute(delete(Call).where(Call.call_id.in_(ours)))
        known.update(_next_seqs(conn, pending))
        rows = [_encoded(stmts, r, known[key] + i) for key, recs in pending.items() for i, r in enumerate(recs)]
    else:
        raise RuntimeError(f"no free sequence numbers for {len(pending)} attempt(s) after {_RENUMBER_TRIES} tries")
    if seqs is not None:
        seqs.stage({key: known[key] + len(recs) for key, recs in groups.items()})
    return len(records)


_UPGRADE_COLUMNS = tuple(name for name in (*_ROW_FIELDS, "json_exact")
                         if name not in ("call_id", "rollout_id", "attempt_id"))


def _upgrade_interrupted_sync(conn: Connection, records: list[CallRecord]) -> None:
    """Replace `interrupted` rows with the complete records of the same calls, keeping their seq.

    A live proxy records the calls of one it took for dead as `interrupted` (`proxy.cluster`); when
    the dead one comes back (its journal, or its spool after it was cut off), its complete records
    win. Only that way: a complete record is never touched.
    """
    for record in records:
        row = _row(record, None)
        values = {name: row[name] for name in _UPGRADE_COLUMNS}
        conn.execute(update(Call).where(Call.call_id == record.call_id, Call.status == CallStatus.INTERRUPTED)
                     .values(**values))


async def write_calls(conn: AsyncConnection, records: list[CallRecord], *, skip_existing: bool = False,
                      release_leases: bool = False, seqs: SeqCounters | None = None) -> int:
    """`write_calls_sync` on an async connection."""
    inserted: int = await conn.run_sync(write_calls_sync, records, skip_existing=skip_existing,
                                        release_leases=release_leases, seqs=seqs)
    return inserted


async def register_rollout(
    conn: AsyncConnection, rollout_id: str, group_id: str | None, task: Any, metadata: dict[str, Any] | None
) -> None:
    # As for calls (`_make_storable`): storable queryable copies, and the exact values beside
    # them when a copy had to change (U+0000, lone surrogates, numbers beyond float64).
    exact = {"task": task, "metadata": metadata}
    safe = {name: db_safe(value) for name, value in exact.items()}
    # A float task alone is kept exactly too: SQLite's JSON column has NUMERIC affinity, so `2.0`
    # would come back as the integer 2.
    is_exact = not any(changed for _, changed, _ in safe.values()) and not isinstance(task, float)
    values = {"rollout_id": rollout_id, "group_id": group_id, "task": safe["task"][0], "metadata": safe["metadata"][0],
              "json_exact": None if is_exact else dumps_exact(exact).decode()}
    stmt = _insert(conn, Rollout).values(values)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["rollout_id"],
            set_={"group_id": stmt.excluded.group_id, "task": stmt.excluded.task, "metadata": stmt.excluded.metadata,
                  "json_exact": stmt.excluded.json_exact},
        )
    )


async def add_reward(
    conn: AsyncConnection, rollout_id: str, attempt_id: str, value: float, name: str | None, call_id: str | None
) -> int:
    await _ensure_attempts(conn, {(rollout_id, attempt_id): None})
    if call_id is not None:
        owner = (
            await conn.execute(
                select(Call.id).where(
                    Call.call_id == call_id, Call.rollout_id == rollout_id, Call.attempt_id == attempt_id
                )
            )
        ).first()
        if owner is None:
            raise NotFound(f"call {call_id!r} is not a call of attempt {rollout_id}/{attempt_id}", param="call_id")
    result = await conn.execute(
        _insert(conn, Reward)
        .values(rollout_id=rollout_id, attempt_id=attempt_id, value=value, name=name, call_id=call_id)
        .returning(Reward.id)
    )
    return int(result.scalar_one())


async def finish_attempt(
    conn: AsyncConnection, rollout_id: str, attempt_id: str, status: str, reward: float | None
) -> None:
    await _ensure_attempts(conn, {(rollout_id, attempt_id): None})
    current = (
        await conn.execute(
            select(Attempt.status).where(Attempt.rollout_id == rollout_id, Attempt.attempt_id == attempt_id)
        )
    ).scalar_one()
    if current != "running":
        if current == status and reward is None:
            return  # a retried finish: already done
        raise Conflict(f"attempt {rollout_id}/{attempt_id} already finished as {current!r}", code="already_finished")
    await conn.execute(
        update(Attempt)
        .where(Attempt.rollout_id == rollout_id, Attempt.attempt_id == attempt_id)
        .values(status=status, finished_at=datetime.now(UTC))
    )
    if reward is not None:
        await conn.execute(
            _insert(conn, Reward).values(rollout_id=rollout_id, attempt_id=attempt_id, value=reward, name="final")
        )


async def undurable_calls(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> list[dict[str, Any]]:
    """Calls of the attempt whose record the database refused, and why (oldest first)."""
    rows = await conn.execute(
        select(UndurableCall.call_id, UndurableCall.reason)
        .where(UndurableCall.rollout_id == rollout_id, UndurableCall.attempt_id == attempt_id)
        .order_by(UndurableCall.created_at, UndurableCall.call_id)
    )
    return [dict(r) for r in rows.mappings()]


def add_undurable_sync(conn: Connection, records: list[CallRecord], reason: str) -> None:
    """Note records the database refused (their bodies wait in the dead-letter spool)."""
    conn.execute(
        _insert(conn, UndurableCall).on_conflict_do_nothing(index_elements=["call_id"]),
        [{"call_id": r.call_id, "rollout_id": r.rollout_id, "attempt_id": r.attempt_id,
          "reason": db_safe_text(reason)} for r in records],
    )


def remove_undurable_sync(conn: Connection, call_ids: list[str]) -> None:
    conn.execute(delete(UndurableCall).where(UndurableCall.call_id.in_(call_ids)))


async def interrupted_calls(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> int:
    """Calls of the attempt cut by a proxy crash or shutdown: such an attempt is not complete."""
    return int((await conn.execute(
        select(func.count()).select_from(Call).where(
            Call.rollout_id == rollout_id, Call.attempt_id == attempt_id, Call.status == CallStatus.INTERRUPTED)
    )).scalar_one())


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    # SQLite hands back naive datetimes; everything is written in UTC.
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()


_CALL_FIELDS = (
    "call_id", "seq", "route", "is_streaming", "status", "http_status", "error", "request", "response",
    "response_truncated", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "finish_reason",
    "usage", "replica", "policy_version", "requested_model", "served_model",
)


async def read_attempt(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> dict[str, Any]:
    attempt = (
        await conn.execute(
            select(Attempt.status, Attempt.policy_version, Attempt.created_at, Attempt.finished_at, Rollout.group_id,
                   Rollout.task, Rollout.meta, Rollout.json_exact)
            .join(Rollout, Rollout.rollout_id == Attempt.rollout_id)
            .where(Attempt.rollout_id == rollout_id, Attempt.attempt_id == attempt_id)
        )
    ).mappings().first()
    if attempt is None:
        raise NotFound(f"no attempt {rollout_id}/{attempt_id}", code="unknown_attempt")
    calls = (
        await conn.execute(
            select(Call.__table__).where(Call.rollout_id == rollout_id, Call.attempt_id == attempt_id).order_by(Call.seq)
        )
    ).mappings()
    undurable = (
        await conn.execute(
            select(UndurableCall.call_id, UndurableCall.reason, UndurableCall.created_at)
            .where(UndurableCall.rollout_id == rollout_id, UndurableCall.attempt_id == attempt_id)
            .order_by(UndurableCall.created_at, UndurableCall.call_id)
        )
    ).mappings().all()
    rewards = (
        await conn.execute(
            select(Reward.value, Reward.name, Reward.call_id, Reward.created_at)
            .where(Reward.rollout_id == rollout_id, Reward.attempt_id == attempt_id)
            .order_by(Reward.id)
        )
    ).mappings()
    call_list = [_call_out(c) for c in calls]
    interrupted = sum(1 for c in call_list if c["status"] == CallStatus.INTERRUPTED)
    registered = overlay_exact(attempt["json_exact"], {"task": attempt["task"], "metadata": attempt["metadata"]})
    return {
        "object": "rolltap.attempt",
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "group_id": attempt["group_id"] or rollout_id,
        "task": registered["task"],  # as registered (`POST /rollouts`), exactly
        "metadata": registered["metadata"],
        "status": attempt["status"],
        # False when a call was cut by a proxy crash or shutdown, or its record waits in the
        # dead-letter spool: the trajectory has a hole.
        "is_complete": interrupted == 0 and not undurable,
        "interrupted_calls": interrupted,
        "policy_version": attempt["policy_version"],
        "created_at": _iso(attempt["created_at"]),
        "finished_at": _iso(attempt["finished_at"]),
        "rewards": [{**r, "created_at": _iso(r["created_at"])} for r in rewards],
        "calls": call_list,
        # Calls this attempt made whose record the database refused (see `rolltap-proxy spool`).
        "is_durable": not undurable,
        "undurable_calls": [{**u, "created_at": _iso(u["created_at"])} for u in undurable],
    }


def _call_out(call: Any) -> dict[str, Any]:
    out = overlay_exact(call["json_exact"], {name: call[name] for name in _CALL_FIELDS})
    out["started_at"] = _iso(call["started_at"])
    out["first_byte_at"] = _iso(call["first_byte_at"])
    out["ended_at"] = _iso(call["ended_at"])
    for name in ("request_body", "response_body"):
        out[name], out[f"{name}_encoding"] = body_text(call[name])
    return out


def body_text(raw: bytes | None) -> tuple[str | None, str | None]:
    """Bytes as JSON can carry them exactly: the text when it is UTF-8, else base64."""
    if raw is None:
        return None, None
    raw = bytes(raw)  # PostgreSQL drivers may hand back a memoryview
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"


async def upsert_replica(conn: AsyncConnection, url: str, weight_mode: str, state: str) -> None:
    stmt = _insert(conn, Replica).values(url=url, weight_mode=weight_mode, state=state)
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=["url"], set_={"weight_mode": stmt.excluded.weight_mode, "state": stmt.excluded.state,
                                      "updated_at": func.now()}))


async def set_active_policy(conn: AsyncConnection, version: int, served_name: str, kind: str,
                            base_model: str | None, path: str | None) -> None:
    """Make `version` the one active policy (recording it if new)."""
    await conn.execute(update(PolicyVersion).where(PolicyVersion.version != version).values(is_active=False))
    stmt = _insert(conn, PolicyVersion).values(version=version, served_name=served_name, kind=kind,
                                               base_model=base_model, path=path, is_active=True)
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=["version"], set_={"served_name": stmt.excluded.served_name, "kind": stmt.excluded.kind,
                                          "base_model": stmt.excluded.base_model, "path": stmt.excluded.path,
                                          "is_active": True}))


async def load_active_policy(conn: AsyncConnection) -> tuple[int, str] | None:
    row = (
        await conn.execute(
            select(PolicyVersion.version, PolicyVersion.served_name)
            .where(PolicyVersion.is_active.is_(True))
            .order_by(PolicyVersion.version.desc())
        )
    ).first()
    return (int(row[0]), str(row[1])) if row is not None else None


async def save_base_policy(conn: AsyncConnection, served_name: str) -> None:
    """Record version 0 (the replicas' base model) as active, unless a policy exists already."""
    await conn.execute(
        _insert(conn, PolicyVersion)
        .values(version=0, served_name=served_name, base_model=served_name, kind="base", is_active=True)
        .on_conflict_do_nothing(index_elements=["version"])
    )


# -- LoRA adapters pushed as bytes (`trainer.lora_transport = "bytes"`) ----------------------

async def save_adapter(conn: AsyncConnection, name: str, version: int, sha256: str, data: bytes,
                       keep: int | None, protected: str | None) -> list[str]:
    """Store an adapter (replacing one of that name); with `keep`, drop those more than `keep` versions
    older, except `protected` (the active policy's). Returns the digests still stored."""
    await conn.execute(delete(LoraAdapter).where(LoraAdapter.name == name))
    await conn.execute(insert(LoraAdapter).values(name=name, version=version, sha256=sha256, size_bytes=len(data),
                                                  data=data))
    if keep is not None:
        stale = delete(LoraAdapter).where(LoraAdapter.version <= version - keep)
        if protected is not None:
            stale = stale.where(LoraAdapter.name != protected)
        await conn.execute(stale)
    return list((await conn.execute(select(LoraAdapter.sha256).order_by(LoraAdapter.version))).scalars())


async def load_adapter(conn: AsyncConnection, name: str) -> tuple[str, bytes, list[str]] | None:
    """An adapter's digest and bytes, with the digests of every adapter stored; None when unknown."""
    row = (await conn.execute(select(LoraAdapter.sha256, LoraAdapter.data).where(LoraAdapter.name == name))).first()
    if row is None:
        return None
    stored = list((await conn.execute(select(LoraAdapter.sha256).order_by(LoraAdapter.version))).scalars())
    return str(row[0]), bytes(row[1]), stored


# -- the cluster: several proxies on one PostgreSQL database (`proxy.cluster`) --------------

def _expired(dead_after_s: float) -> Any:
    """Heartbeats older than this are dead proxies' (the database's clock: no skew between hosts)."""
    return func.now() - timedelta(seconds=dead_after_s)


async def register_proxy(conn: AsyncConnection, proxy_id: str, host: str, pid: int) -> None:
    await conn.execute(_insert(conn, Proxy).values(proxy_id=proxy_id, host=host[:256], pid=pid))


async def deregister_proxy(conn: AsyncConnection, proxy_id: str) -> None:
    await conn.execute(delete(ReplicaEjection).where(ReplicaEjection.proxy_id == proxy_id))
    await conn.execute(delete(Proxy).where(Proxy.proxy_id == proxy_id))


async def heartbeat(conn: AsyncConnection, proxy_id: str, in_flight: int, unleased: int) -> bool:
    """Refresh this proxy's row; False when it is gone (another proxy took it for dead)."""
    result = await conn.execute(
        update(Proxy).where(Proxy.proxy_id == proxy_id)
        .values(heartbeat_at=func.now(), in_flight=in_flight, unleased_calls=unleased)
    )
    return bool(result.rowcount)


async def unaccounted_proxies(conn: AsyncConnection, proxy_id: str, dead_after_s: float, stale_s: float) -> list[str]:
    """Live proxies (other than `proxy_id`) that may hold calls no lease row shows: silent for over
    `stale_s` (cut off from the database, so possibly serving unleased calls), or reporting some."""
    rows = await conn.execute(
        select(Proxy.proxy_id).where(
            Proxy.proxy_id != proxy_id, Proxy.heartbeat_at > _expired(dead_after_s),
            (Proxy.heartbeat_at <= _expired(stale_s)) | (Proxy.unleased_calls > 0))
    )
    return [str(r[0]) for r in rows]


async def read_cluster_state(conn: AsyncConnection) -> tuple[int, bool]:
    row = (await conn.execute(select(ClusterState.epoch, ClusterState.paused).where(ClusterState.id == 1))).one()
    return int(row[0]), bool(row[1])


async def bump_epoch(conn: AsyncConnection, channel: str, paused: bool | None = None) -> int:
    """Move the shared state to a new epoch (setting `paused` when given) and tell every listener on commit."""
    values: dict[str, Any] = {"epoch": ClusterState.epoch + 1}
    if paused is not None:
        values["paused"] = paused
    epoch = int((await conn.execute(
        update(ClusterState).where(ClusterState.id == 1).values(**values).returning(ClusterState.epoch)
    )).scalar_one())
    await conn.execute(select(func.pg_notify(channel, str(epoch))))
    return epoch


async def ack_epoch(conn: AsyncConnection, proxy_id: str, *, seen: int | None = None,
                    drained: int | None = None) -> None:
    values: dict[str, Any] = {}
    if seen is not None:
        values["seen_epoch"] = func.greatest(Proxy.seen_epoch, seen)
    if drained is not None:
        values["drained_epoch"] = func.greatest(Proxy.drained_epoch, drained)
    await conn.execute(update(Proxy).where(Proxy.proxy_id == proxy_id).values(**values))


async def lagging_proxies(conn: AsyncConnection, epoch: int, dead_after_s: float, *, drained: bool) -> list[str]:
    """Live proxies that have not yet applied (or, with `drained`, drained for) `epoch`."""
    column = Proxy.drained_epoch if drained else Proxy.seen_epoch
    rows = await conn.execute(
        select(Proxy.proxy_id).where(Proxy.heartbeat_at > _expired(dead_after_s), column < epoch)
    )
    return [str(r[0]) for r in rows]


async def add_leases(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    # No wait for the WAL flush: a lease matters only while PostgreSQL runs (after a database
    # crash, what it guarded is settled by journals and the reaper), and a flush per batch of
    # leases would put a disk sync into every call's latency.
    await conn.execute(text("SET LOCAL synchronous_commit TO OFF"))
    await conn.execute(_insert(conn, CallLease), rows)


def release_leases_sync(conn: Connection, call_ids: list[str]) -> None:
    conn.execute(delete(CallLease).where(CallLease.call_id.in_(call_ids)))


async def count_leases(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> int:
    return int((await conn.execute(
        select(func.count()).select_from(CallLease)
        .where(CallLease.rollout_id == rollout_id, CallLease.attempt_id == attempt_id)
    )).scalar_one())


async def claim_dead_proxies(conn: AsyncConnection, dead_after_s: float) -> list[dict[str, Any]]:
    """Remove the rows of proxies silent for `dead_after_s` and take their leases (call it in a
    transaction: one claimer wins; the others find nothing). Returns the leases."""
    await conn.execute(delete(Proxy).where(Proxy.heartbeat_at <= _expired(dead_after_s)))
    await conn.execute(delete(ReplicaEjection).where(ReplicaEjection.proxy_id.not_in(select(Proxy.proxy_id))))
    # Leases of any proxy without a row: the ones just removed, and any left by an earlier claimer's crash.
    orphans = (await conn.execute(
        select(CallLease.__table__).where(CallLease.proxy_id.not_in(select(Proxy.proxy_id)))
        .with_for_update(skip_locked=True)
    )).mappings().all()
    return [dict(r) for r in orphans]


async def set_ejections(conn: AsyncConnection, proxy_id: str, ejected: dict[str, str], channel: str) -> bool:
    """Make this proxy's ejection rows exactly `ejected` (url -> reason); notify every listener on
    commit when that changed anything. Returns whether it did."""
    held = set((await conn.execute(
        select(ReplicaEjection.url).where(ReplicaEjection.proxy_id == proxy_id))).scalars())
    gone, new = held - ejected.keys(), ejected.keys() - held
    if gone:
        await conn.execute(delete(ReplicaEjection).where(ReplicaEjection.proxy_id == proxy_id,
                                                         ReplicaEjection.url.in_(gone)))
    if new:
        await conn.execute(_insert(conn, ReplicaEjection).on_conflict_do_nothing(),
                           [{"url": url, "proxy_id": proxy_id, "reason": ejected[url][:512]} for url in new])
    if gone or new:
        await conn.execute(select(func.pg_notify(channel, proxy_id)))
    return bool(gone or new)


async def ejected_elsewhere(conn: AsyncConnection, proxy_id: str, dead_after_s: float) -> set[str]:
    """Replicas that another live proxy holds ejected."""
    rows = await conn.execute(
        select(ReplicaEjection.url).distinct().join(Proxy, Proxy.proxy_id == ReplicaEjection.proxy_id)
        .where(ReplicaEjection.proxy_id != proxy_id, Proxy.heartbeat_at > _expired(dead_after_s)))
    return {str(r[0]) for r in rows}
