"""Migrations build exactly the models, both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from shared.db.engine import create_sync_db
from shared.db.migrate import MIGRATIONS_DIR, alembic_config, upgrade
from shared.db.models import Base
from shared.settings import DbSettings


@pytest.fixture
def db(db_url: str) -> Iterator[tuple[DbSettings, Engine]]:
    settings = DbSettings(url=db_url)
    engine = create_sync_db(settings)
    try:
        yield settings, engine
    finally:
        engine.dispose()


def _diff(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        # Stricter than env.py's autogenerate: server defaults are compared too.
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        return list(compare_metadata(context, Base.metadata))


def _current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _head() -> str:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def _downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)


def _user_tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_from_empty_matches_models(db: tuple[DbSettings, Engine]) -> None:
    settings, engine = db
    assert _user_tables(engine) == set()
    upgrade(settings)
    assert _current(engine) == _head()
    assert _user_tables(engine) == set(Base.metadata.tables)
    assert _diff(engine) == []


def test_comparison_can_see_a_drift(db: tuple[DbSettings, Engine]) -> None:
    # The no-difference check above is only worth something if a real drift shows up.
    settings, engine = db
    upgrade(settings)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE stray (id INTEGER PRIMARY KEY)"))
        conn.execute(text("CREATE INDEX ix_stray_id ON stray (id)"))
        conn.execute(text("DROP INDEX ix_calls_started_at"))
    kinds = {d[0] if isinstance(d, tuple) else d[0][0] for d in _diff(engine)}
    assert {"remove_table", "add_index"} <= kinds


def test_downgrade_to_base_and_up_again(db: tuple[DbSettings, Engine]) -> None:
    settings, engine = db
    upgrade(settings)
    _downgrade(engine, "base")
    assert _user_tables(engine) == set()
    assert _current(engine) is None
    upgrade(settings)
    assert _current(engine) == _head()
    assert _diff(engine) == []


def test_upgrade_is_idempotent_and_keeps_data(db: tuple[DbSettings, Engine]) -> None:
    settings, engine = db
    upgrade(settings)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO rollouts (rollout_id) VALUES ('r1')"))
    upgrade(settings)  # what every process start does
    upgrade(settings, "head")
    assert _current(engine) == _head()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT rollout_id FROM rollouts")).scalars().all() == ["r1"]
    assert _diff(engine) == []


def test_upgrade_from_the_first_revision_keeps_calls(db: tuple[DbSettings, Engine]) -> None:
    # An old schema with data in it, brought to head: nothing lost on the way.
    settings, engine = db
    upgrade(settings, "0001")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO rollouts (rollout_id) VALUES ('r1')"))
        conn.execute(text("INSERT INTO attempts (rollout_id, attempt_id) VALUES ('r1', 'a1')"))
        conn.execute(text(
            "INSERT INTO calls (call_id, rollout_id, attempt_id, seq, route, is_streaming, status, started_at, ended_at)"
            " VALUES ('call-1', 'r1', 'a1', 0, 'completions', false, 'ok', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
        ))
    upgrade(settings)
    assert _diff(engine) == []
    with engine.connect() as conn:
        assert conn.execute(text("SELECT call_id, seq FROM calls")).all() == [("call-1", 0)]


def test_upgrade_from_0002_with_data_keeps_calls_and_adds_verbatim_columns(db: tuple[DbSettings, Engine]) -> None:
    # The schema before verbatim recording, with a call (and a trainer drop) in it, brought to head.
    settings, engine = db
    upgrade(settings, "0002")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO rollouts (rollout_id) VALUES ('r1')"))
        conn.execute(text("INSERT INTO attempts (rollout_id, attempt_id, status) VALUES ('r1', 'a1', 'succeeded')"))
        conn.execute(text(
            "INSERT INTO calls (call_id, rollout_id, attempt_id, seq, route, is_streaming, status, request, response,"
            " started_at, ended_at) VALUES ('call-1', 'r1', 'a1', 0, 'chat/completions', false, 'ok',"
            " :request, :response, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
        ), {"request": '{"messages": [{"role": "user", "content": "h\\u00e9"}]}', "response": '{"choices": []}'})
        conn.execute(text("INSERT INTO call_drops (call_id, rollout_id, attempt_id, reason)"
                          " VALUES ('call-1', 'r1', 'a1', 'no_tokens')"))
    upgrade(settings)
    assert _current(engine) == _head()
    assert _diff(engine) == []
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT call_id, seq, request, request_body, response_body, json_exact FROM calls")).one()
        assert conn.execute(text("SELECT reason FROM call_drops")).scalar_one() == "no_tokens"
        assert conn.execute(text("SELECT count(*) FROM undurable_calls")).scalar_one() == 0
    request = row.request if isinstance(row.request, dict) else json.loads(row.request)
    assert (row.call_id, row.seq, request["messages"][0]["content"]) == ("call-1", 0, "hé")
    # Bytes were never kept for old calls: NULL, not made up.
    assert (row.request_body, row.response_body, row.json_exact) == (None, None, None)
    _downgrade(engine, "0002")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT call_id FROM calls")).scalars().all() == ["call-1"]


def test_upgrade_from_0009_adds_lora_adapters_and_downgrade_drops_only_them(db: tuple[DbSettings, Engine]) -> None:
    # The schema before adapters travelled as bytes, with a policy in it, to head and back.
    settings, engine = db
    upgrade(settings, "0009")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO policy_versions (version, served_name, kind, is_active)"
                          " VALUES (1, 'policy-v1', 'lora', true)"))
    assert "lora_adapters" not in _user_tables(engine)
    upgrade(settings)
    assert _diff(engine) == []
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO lora_adapters (name, version, sha256, size_bytes, data)"
                          " VALUES ('policy-v1', 1, :sha, 3, :data)"), {"sha": "0" * 64, "data": b"\x00\xff\x01"})
    with engine.connect() as conn:
        assert conn.execute(text("SELECT data FROM lora_adapters")).scalar_one() == b"\x00\xff\x01"
    _downgrade(engine, "0009")
    assert "lora_adapters" not in _user_tables(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT served_name FROM policy_versions")).scalars().all() == ["policy-v1"]
