"""Trainer fixtures: a migrated database of each kind with a helper that writes test records."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, insert, update

from shared.db.engine import create_sync_db
from shared.db.migrate import upgrade
from shared.db.models import Attempt, Call, PolicyVersion, Reward, Rollout
from shared.settings import DbSettings

# verl's dataset classes go through `datasets`, which must never reach for a hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

_ids = itertools.count()


@dataclass
class Db:
    """A migrated database and a few writers of records as the proxy would leave them."""

    url: str
    engine: Engine

    def rollout(self, rollout_id: str, group_id: str | None = None, task: Any = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(Rollout).values(rollout_id=rollout_id, group_id=group_id, task=task))

    def attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: str = "succeeded",
        reward: float | None = 1.0,
        policy_version: int | None = 0,
        finished_ago_s: float = 0.0,
        calls: list[dict[str, Any]] | None = None,
        group_id: str | None = None,
        create_rollout: bool = True,
    ) -> int:
        """One attempt with its calls (dicts of `calls` columns) and a "final" reward; returns its pk."""
        now = datetime.now(UTC)
        with self.engine.begin() as conn:
            if create_rollout and conn.execute(
                Rollout.__table__.select().where(Rollout.rollout_id == rollout_id)
            ).first() is None:
                conn.execute(insert(Rollout).values(rollout_id=rollout_id, group_id=group_id))
            finished = now - timedelta(seconds=finished_ago_s) if status != "running" else None
            pk = conn.execute(
                insert(Attempt)
                .values(
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    status=status,
                    policy_version=policy_version,
                    finished_at=finished,
                    num_calls=len(calls or []),
                )
                .returning(Attempt.id)
            ).scalar_one()
            for seq, call in enumerate(calls or []):
                row = {
                    "call_id": f"call-{next(_ids)}",
                    "rollout_id": rollout_id,
                    "attempt_id": attempt_id,
                    "seq": seq,
                    "route": "chat/completions",
                    "is_streaming": False,
                    "status": "ok",
                    "http_status": 200,
                    "finish_reason": "stop",
                    "policy_version": policy_version,
                    "started_at": now,
                    "ended_at": now,
                    **call,
                }
                conn.execute(insert(Call).values(**row))
            if reward is not None:
                conn.execute(
                    insert(Reward).values(rollout_id=rollout_id, attempt_id=attempt_id, value=reward, name="final")
                )
        return int(pk)

    def reward(self, rollout_id: str, attempt_id: str, value: float, name: str | None = None, call_id: str | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                insert(Reward).values(
                    rollout_id=rollout_id, attempt_id=attempt_id, value=value, name=name, call_id=call_id
                )
            )

    def policy(self, version: int, *, is_active: bool = True) -> None:
        with self.engine.begin() as conn:
            if is_active:
                conn.execute(update(PolicyVersion).values(is_active=False))
            conn.execute(
                insert(PolicyVersion).values(
                    version=version, served_name=f"policy-v{version}", kind="lora", is_active=is_active
                )
            )

    def call_ids(self, rollout_id: str, attempt_id: str) -> list[str]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    Call.__table__.select()
                    .with_only_columns(Call.call_id)
                    .where(Call.rollout_id == rollout_id, Call.attempt_id == attempt_id)
                    .order_by(Call.seq)
                ).scalars()
            )


def tokens_call(prompt: list[int], completion: list[int], **extra: Any) -> dict[str, Any]:
    """A recorded call with exact token IDs and one logprob per completion token."""
    return {
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [-0.1 * (i + 1) for i in range(len(completion))],
        "request": {"model": "m", "messages": [{"role": "user", "content": "q"}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "a"}}]},
        **extra,
    }


@pytest.fixture
def db(db_url: str) -> Iterator[Db]:
    settings = DbSettings(url=db_url)
    upgrade(settings)
    engine = create_sync_db(settings)
    try:
        yield Db(db_url, engine)
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer alone (no weights: faster than `tiny_model_dir`)."""
    from tools.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
