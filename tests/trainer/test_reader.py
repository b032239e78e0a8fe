"""The reader and consumption on SQLite and PostgreSQL: groups, staleness, timeout, exactly-once."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.exc import OperationalError

from shared.db.models import CallDrop, PolicyVersion, TrainingStep, TrainingStepAttempt, UndurableCall
from shared.settings import TrainerSettings
from shared.verbatim import dumps_exact
from tests.trainer.conftest import Db, tokens_call
from trainer.consumption import AlreadyConsumed, record_export, record_training_step
from trainer.data import read_samples
from trainer.reader import current_policy_version, find_ready_groups, scan_groups


def ready(db: Db, settings: TrainerSettings, **kw: object) -> dict[str, list[str]]:
    with db.engine.connect() as conn:
        groups = find_ready_groups(conn, settings, **kw)  # type: ignore[arg-type]
    return {g.group_id: sorted(a.attempt_id for a in g.attempts) for g in groups}


def test_group_waits_for_group_size_of_eligible_attempts(db: Db) -> None:
    s = TrainerSettings(group_size=3)
    db.attempt("task-1", "0")
    db.attempt("task-1", "1")
    db.attempt("task-1", "running", status="running", reward=None)
    db.attempt("task-1", "unrewarded", reward=None)
    db.attempt("task-1", "cancelled", status="cancelled")
    db.attempt("task-1", "failed", status="failed", reward=0.0)
    assert ready(db, s) == {}
    with db.engine.connect() as conn:
        (state,) = scan_groups(conn, s)
    assert state.readiness == "waiting" and len(state.members) == 2

    # failed attempts with a reward count only when asked for
    assert ready(db, TrainerSettings(group_size=3, include_failed=True)) == {"task-1": ["0", "1", "failed"]}

    db.attempt("task-1", "2")
    groups = ready(db, s)
    assert groups == {"task-1": ["0", "1", "2"]}
    # a reward posted later makes an attempt eligible; a full group takes every eligible member
    db.reward("task-1", "unrewarded", 0.5)
    assert ready(db, s) == {"task-1": ["0", "1", "2", "unrewarded"]}


def test_registered_group_id_spans_rollouts(db: Db) -> None:
    s = TrainerSettings(group_size=4)
    for rid in ("r-a", "r-b"):
        db.rollout(rid, group_id="g-1", task={"question": "7 + 5"})
    db.attempt("r-a", "0")
    db.attempt("r-a", "1")
    db.attempt("r-b", "0")
    db.attempt("lonely", "0")
    assert ready(db, s) == {}
    db.attempt("r-b", "1")
    with db.engine.connect() as conn:
        (group,) = find_ready_groups(conn, s)
    assert group.group_id == "g-1" and group.is_full
    assert sorted((a.rollout_id, a.attempt_id) for a in group.attempts) == [
        ("r-a", "0"), ("r-a", "1"), ("r-b", "0"), ("r-b", "1"),
    ]
    assert all(a.task == {"question": "7 + 5"} for a in group.attempts)


def test_staleness_against_the_active_policy(db: Db) -> None:
    s = TrainerSettings(group_size=2, max_staleness=1)
    with db.engine.connect() as conn:
        assert current_policy_version(conn) == 0
    for version in (None, 1, 2, 3):
        db.attempt(f"v{version}", "0", policy_version=version)
        db.attempt(f"v{version}", "1", policy_version=version)
    assert set(ready(db, s)) == {"vNone", "v1", "v2", "v3"}  # current 0: nothing is behind it
    db.policy(2)
    db.policy(3)
    db.policy(4, is_active=False)  # pushed but not active yet: not current
    with db.engine.connect() as conn:
        assert current_policy_version(conn) == 3
    assert set(ready(db, s)) == {"v2", "v3"}
    assert set(ready(db, TrainerSettings(group_size=2, max_staleness=0))) == {"v3"}
    assert set(ready(db, TrainerSettings(group_size=2, max_staleness=3))) == {"vNone", "v1", "v2", "v3"}


def test_group_timeout(db: Db) -> None:
    s = TrainerSettings(group_size=8, group_timeout_s=600, min_group_size=2)
    db.attempt("old-pair", "0", finished_ago_s=700)
    db.attempt("old-pair", "1", finished_ago_s=10)
    db.attempt("old-single", "0", finished_ago_s=900)
    db.attempt("new-pair", "0", finished_ago_s=30)
    db.attempt("new-pair", "1", finished_ago_s=20)
    with db.engine.connect() as conn:
        states = {g.group_id: g.readiness for g in scan_groups(conn, s)}
        groups = find_ready_groups(conn, s)
    assert states == {"old-pair": "timed_out", "old-single": "stalled", "new-pair": "waiting"}
    assert [(g.group_id, g.is_full) for g in groups] == [("old-pair", False)]
    # the clock moves on: the recent pair times out too; the single one never reaches min_group_size
    later = datetime.now(UTC) + timedelta(seconds=600)
    assert set(ready(db, s, now=later)) == {"old-pair", "new-pair"}
    assert set(ready(db, TrainerSettings(group_size=8, group_timeout_s=600, min_group_size=1), now=later)) == {
        "old-pair", "new-pair", "old-single",
    }


def consumed(db: Db) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(TrainingStepAttempt)).scalar_one())


def test_consumption_is_exactly_once(db: Db) -> None:
    s = TrainerSettings(group_size=2)
    db.attempt("t", "0")
    db.attempt("t", "1")
    db.attempt("u", "0")
    db.attempt("u", "1")
    with db.engine.connect() as conn:
        groups = find_ready_groups(conn, s, max_groups=1)
    pks = [a.pk for g in groups for a in g.attempts]
    assert [g.group_id for g in groups] == ["t"]

    # a step that fails before commit consumes nothing, nor does its policy version survive
    with pytest.raises(RuntimeError, match="update blew up"):
        with db.engine.begin() as conn:
            record_training_step(conn, step=1, attempt_pks=pks, policy_version=1)
            conn.execute(insert(PolicyVersion).values(version=1, served_name="policy-v1", kind="lora"))
            raise RuntimeError("update blew up")
    assert consumed(db) == 0
    assert set(ready(db, s)) == {"t", "u"}

    # the step, its consumption and its policy version commit together
    with db.engine.begin() as conn:
        record_training_step(conn, step=1, attempt_pks=pks, policy_version=1, metrics={"loss": 0.5})
        conn.execute(insert(PolicyVersion).values(version=1, served_name="policy-v1", kind="lora"))
    assert consumed(db) == 2
    assert set(ready(db, s)) == {"u"}

    # consuming the same attempts again is refused and writes nothing
    with pytest.raises(AlreadyConsumed) as err:
        with db.engine.begin() as conn:
            record_training_step(conn, step=2, attempt_pks=pks)
    assert sorted(err.value.attempt_pks) == sorted(pks)
    with db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(TrainingStep)).scalar_one() == 1

    # an export consumes too, and then a step cannot take its attempts
    with db.engine.connect() as conn:
        (u,) = find_ready_groups(conn, s)
    u_pks = [a.pk for a in u.attempts]
    with db.engine.begin() as conn:
        record_export(conn, format="jsonl", path="/tmp/x.jsonl", attempt_pks=u_pks, num_triplets=0)
    assert ready(db, s) == {}
    with pytest.raises(AlreadyConsumed):
        with db.engine.begin() as conn:
            record_training_step(conn, step=2, attempt_pks=u_pks)


def test_racing_consumers_one_wins(db: Db) -> None:
    db.attempt("t", "0")
    db.attempt("t", "1")
    with db.engine.connect() as conn:
        (group,) = find_ready_groups(conn, TrainerSettings(group_size=2))
    pks = [a.pk for a in group.attempts]
    holding = threading.Event()
    results: dict[str, BaseException | None] = {}

    def first() -> None:
        with db.engine.begin() as conn:
            record_training_step(conn, step=1, attempt_pks=pks)
            holding.set()
            threading.Event().wait(0.5)  # hold the lock while the second consumer arrives

    def second() -> None:
        holding.wait(10)
        try:
            with db.engine.begin() as conn:
                record_export(conn, format="jsonl", path="/tmp/y", attempt_pks=pks, num_triplets=0)
            results["second"] = None
        except (AlreadyConsumed, OperationalError) as exc:
            results["second"] = exc

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # It waited on the lock (row locks on PostgreSQL, the write lock on SQLite), then saw the step.
    assert isinstance(results["second"], AlreadyConsumed)
    assert consumed(db) == 2


def test_read_samples_stores_drop_reasons(db: Db) -> None:
    s = TrainerSettings(group_size=2, max_prompt_len=5)
    db.attempt("t", "0", calls=[tokens_call([1, 2], [3]), {"status": "upstream_error", "http_status": 500}])
    db.attempt("t", "1", calls=[tokens_call([1, 2, 3, 4, 5, 6], [7])])
    data = read_samples(db.engine, s)
    assert len(data.samples) == 1 and data.num_calls == 3
    assert data.drop_counts() == {"not_ok": 1, "prompt_too_long": 1}
    # reading again (nothing consumed) upserts the same rows; a changed limit changes the verdict
    read_samples(db.engine, s)
    read_samples(db.engine, TrainerSettings(group_size=2, max_prompt_len=4, max_response_len=1))
    with db.engine.connect() as conn:
        rows = conn.execute(select(CallDrop.attempt_id, CallDrop.reason).order_by(CallDrop.attempt_id)).all()
    assert sorted(map(tuple, rows)) == [("0", "not_ok"), ("1", "prompt_too_long")]
    # both attempts of the group are consumed by whoever uses the read, even the one with no triplet
    assert sorted(data.attempt_pks) == sorted(a.pk for g in data.groups for a in g.attempts)
    assert len(data.attempt_pks) == 2


def test_exact_json_is_read_and_undurable_attempts_wait(db: Db) -> None:
    # As the proxy's writer stores a prompt with U+0000: a storable copy, the exact value beside it.
    exact = {"messages": [{"role": "user", "content": "a\x00b\ud800"}]}
    db.attempt("t-exact", "0", calls=[{
        "request": {"messages": [{"role": "user", "content": "a\ufffdb\ufffd"}]},
        "json_exact": dumps_exact({"request": exact, "response": None, "error": None}).decode(),
    }])
    db.attempt("t-exact", "1", calls=[{"call_id": "call-refused-sibling"}])
    with db.engine.begin() as conn:
        # A call of attempt 1 was refused by the database: it waits in the proxy's dead-letter spool.
        conn.execute(insert(UndurableCall).values(call_id="call-lost", rollout_id="t-exact", attempt_id="1",
                                                  reason="IntegrityError: refused"))
    s = TrainerSettings(group_size=1)
    with db.engine.connect() as conn:
        [group] = find_ready_groups(conn, s)
    [attempt] = group.attempts
    assert attempt.attempt_id == "0"  # attempt 1 is incomplete until the record is replayed
    assert attempt.calls[0].request == exact
