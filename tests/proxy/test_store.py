"""Sequence numbers handed out in memory (`proxy.store.SeqCounters`), the database as the judge.

Every case ends with the same check: each attempt's numbers are 0..n-1, each call once,
each batch's calls in the order they started, and `attempts.num_calls` is the count.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from sqlalchemy import Engine, create_engine, text

from proxy.store import SeqCounters, dumps_json, write_calls, write_calls_sync
from shared.db.engine import create_async_db, create_sync_db, sync_url
from shared.db.migrate import upgrade
from shared.settings import DbSettings
from shared.types import CallRecord

_clock = itertools.count()
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _records(keys: list[tuple[str, str]], per_attempt: int = 1, *, untracked: int = 0) -> list[CallRecord]:
    """Calls started in this order (their start time), listed in another (the batch's order is not theirs)."""
    out = []
    for _ in range(per_attempt):
        for rid, aid in keys:
            started = T0 + timedelta(microseconds=next(_clock))
            out.append(CallRecord(call_id=uuid.uuid4().hex, rollout_id=rid, attempt_id=aid, route="/v1/chat/completions",
                                  is_streaming=False, status="ok", started_at=started, ended_at=started,
                                  request={"n": 1}, response={"ok": True}))
    for _ in range(untracked):
        started = T0 + timedelta(microseconds=next(_clock))
        out.append(CallRecord(call_id=uuid.uuid4().hex, rollout_id=None, attempt_id=None, route="/v1/completions",
                              is_streaming=False, status="ok", started_at=started, ended_at=started))
    return out[::-1]


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    upgrade(DbSettings(url=db_url))
    sync = create_sync_db(DbSettings(url=db_url), keep_connection=True, json_serializer=dumps_json)
    yield sync
    sync.dispose()


def _write(engine: Engine, records: list[CallRecord], seqs: SeqCounters | None, **kwargs: bool) -> int:
    with engine.begin() as conn:
        inserted = write_calls_sync(conn, records, seqs=seqs, **kwargs)
    if seqs is not None:
        seqs.commit()
    return inserted


def _check(url: str, batches: list[list[CallRecord]]) -> None:
    reader = create_engine(sync_url(url))
    try:
        with reader.connect() as conn:
            rows = conn.execute(text("SELECT call_id, rollout_id, attempt_id, seq FROM calls")).all()
            counts = {(r, a): n for r, a, n in conn.execute(text("SELECT rollout_id, attempt_id, num_calls FROM attempts"))}
    finally:
        reader.dispose()
    seq = {call_id: s for call_id, _, _, s in rows}
    by_attempt: dict[tuple[str, str], list[int]] = {}
    for _, rid, aid, s in rows:
        if rid is not None:
            by_attempt.setdefault((rid, aid), []).append(s)
    assert len(seq) == sum(len(b) for b in batches)
    for key, numbers in by_attempt.items():
        assert sorted(numbers) == list(range(len(numbers))), key
        assert counts[key] == len(numbers), key
    for batch in batches:
        for key in {r.attempt_key for r in batch if r.attempt_key is not None}:
            started = sorted((r for r in batch if r.attempt_key == key), key=lambda r: r.started_at)
            numbers = [seq[r.call_id] for r in started]
            assert numbers == sorted(numbers), key


def test_numbers_follow_other_writers(engine: Engine, db_url: str) -> None:
    """Another writer (a proxy on the same database, the reaper, a spool replay) took numbers this
    process's counters did not see: the skipped calls are renumbered after them, in order."""
    keys = [("r1", "a"), ("r2", "a"), ("r3", "b")]
    mine, other = SeqCounters(), SeqCounters()
    batches = [_records(keys, 2, untracked=1), _records(keys[:2], 3), _records(keys, 2, untracked=2),
               _records(keys[1:], 1), _records(keys, 3)]
    assert _write(engine, batches[0], mine) == 7
    assert _write(engine, batches[1], other) == 6
    assert _write(engine, batches[2], mine) == 8  # its counters say 2; the database is at 5 for r1 and r2
    assert _write(engine, batches[3], None) == 2  # no counters: from the database
    assert _write(engine, batches[4], mine) == 9
    _check(db_url, batches)


def test_a_new_process_and_replays(engine: Engine, db_url: str) -> None:
    """A restarted process knows no counters; a replay skips what is in and numbers the rest after it."""
    keys = [("r", "a"), ("r", "b")]
    first = _records(keys, 3)
    _write(engine, first, SeqCounters())
    restarted = SeqCounters()
    second = _records(keys, 2)
    _write(engine, second, restarted)
    replay = [*first[:2], *_records(keys, 1)]
    assert _write(engine, replay, restarted, skip_existing=True) == 2
    _check(db_url, [first, second, replay[2:]])


def test_counters_of_a_failed_write_are_not_kept(engine: Engine, db_url: str) -> None:
    """Numbers staged by a transaction that rolled back are never used: no gap."""
    seqs = SeqCounters()
    keys = [("r", "a")]
    first = _records(keys, 2)
    _write(engine, first, seqs)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        write_calls_sync(conn, _records(keys, 5), seqs=seqs)
        raise RuntimeError("the commit failed")
    seqs.forget()
    second = _records(keys, 2)
    _write(engine, second, seqs)
    _check(db_url, [first, second])


def test_two_postgresql_writers_race_on_the_same_attempts(db_url: str) -> None:
    """Two recorders (two proxies) write calls of the same attempts at once, in opposite key
    orders, each trusting its own counters: no duplicate, no gap, no deadlock."""
    if not db_url.startswith("postgresql"):
        pytest.skip("one writer per SQLite database")
    upgrade(DbSettings(url=db_url))
    keys = [(f"r{i}", "a") for i in range(8)]
    batches: list[list[CallRecord]] = []

    async def writer(order: list[tuple[str, str]]) -> None:
        engine = create_async_db(DbSettings(url=db_url), pool_size=1, json_serializer=dumps_json)
        seqs = SeqCounters()
        try:
            for _ in range(25):
                batch = _records(order, 2)
                batches.append(batch)
                async with engine.begin() as conn:
                    await write_calls(conn, batch, seqs=seqs)
                seqs.commit()
        finally:
            await engine.dispose()

    async def main() -> None:
        await asyncio.gather(writer(keys), writer(keys[::-1]), writer(keys[2:6]))

    asyncio.run(main())
    _check(db_url, batches)


def test_times_are_stored_as_core_would_store_them(engine: Engine, db_url: str) -> None:
    """The writer makes SQLite's DATETIME text itself (`isoformat`, not Core's %-formatting): the text
    must be Core's to the character (readers compare and sort it), and every time reads back as written."""
    from sqlalchemy.dialects import sqlite

    times = [datetime(2026, 12, 8, 1, 2, 3, tzinfo=UTC), datetime(5, 1, 1, tzinfo=UTC),
             datetime(2026, 1, 1, 23, 59, 59, 999_999, tzinfo=UTC), datetime(2026, 6, 30, 12, 0, 0, 1, tzinfo=UTC)]
    records = _records([("times", str(i)) for i in range(len(times))])
    for record, at in zip(records, times, strict=True):
        record.started_at = record.ended_at = at
        record.first_byte_at = at if at.microsecond else None
    _write(engine, records, SeqCounters())
    reader = create_engine(sync_url(db_url))
    try:
        with reader.connect() as conn:
            stored = {row[0]: row[1:] for row in conn.execute(
                text("SELECT call_id, started_at, ended_at, first_byte_at FROM calls"))}
    finally:
        reader.dispose()
    core = sqlite.DATETIME().bind_processor(sqlite.dialect())
    for record in records:
        started, ended, first = stored[record.call_id]
        if db_url.startswith("sqlite"):
            assert (started, ended, first) == (core(record.started_at), core(record.ended_at), core(record.first_byte_at))
        else:
            assert started.replace(tzinfo=UTC) == record.started_at and ended.replace(tzinfo=UTC) == record.ended_at
            assert (first is None) == (record.first_byte_at is None)


def test_a_json_value_with_keys_that_are_not_text_is_stored(engine: Engine, db_url: str) -> None:
    """Parsed JSON has only string keys, so the writer encodes without orjson's option for others; a value
    made elsewhere with an int key must still be stored, the key as text."""
    records = _records([("keys", "0")])
    records[0].error = {1: "one", "message": "x"}
    _write(engine, records, SeqCounters())
    reader = create_engine(sync_url(db_url))
    try:
        with reader.connect() as conn:
            error = conn.execute(text("SELECT error FROM calls")).scalar_one()
    finally:
        reader.dispose()
    assert (orjson.loads(error) if isinstance(error, str) else error) == {"1": "one", "message": "x"}
