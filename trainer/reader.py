"""Which attempts the trainer may use now: complete groups of finished, rewarded, fresh, unconsumed attempts.

This module owns selection and loading; it never writes (consumption is
`trainer.consumption`, drop reasons `trainer.drops`).

An attempt is *eligible* when:
- its status is `succeeded` (also `failed` with `include_failed`; `cancelled` and
  `running` never): a failed attempt is most often a broken harness, and a wrong
  answer is expected to finish `succeeded` with a low reward;
- it has at least one reward;
- its policy version (NULL read as 0, the base model) is at least
  `current - max_staleness`, where current is the highest active version in
  `policy_versions`, or 0 when there is none (any version with `staleness_gate` off);
- no training step and no export has consumed it.

Eligible attempts are grouped by the rollout's `group_id` when it was registered with
one, else by `rollout_id` (the two share one namespace). A group is *ready* when it has
`group_size` members (all eligible members are used, even if more), or when its oldest
member finished `group_timeout_s` ago and it has at least `min_group_size` members. A
timed-out group below that keeps waiting: a late member can still complete it, and once
its attempts fall behind `max_staleness` they are never used (`stats` shows them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from sqlalchemy import Connection, Select, Text, and_, cast, exists, func, select, true
from sqlalchemy.orm import Session

from shared.db.models import (
    Attempt,
    Call,
    ExportAttempt,
    PolicyVersion,
    Reward,
    Rollout,
    TrainingStepAttempt,
    UndurableCall,
)
from shared.settings import TrainerSettings
from shared.verbatim import overlay_exact
from trainer.consumption import chunks
from trainer.records import AttemptRow, CallRow, Group, RewardRow

__all__ = [
    "GroupState",
    "current_policy_version",
    "eligible_statuses",
    "find_ready_groups",
    "load_attempt_data",
    "scan_groups",
]

Conn = Connection | Session
GroupReadiness = Literal["full", "timed_out", "waiting", "stalled"]


def utc(dt: datetime) -> datetime:
    """SQLite returns naive timestamps; every timestamp Rolltap writes is UTC."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def current_policy_version(conn: Conn) -> int:
    """The highest active policy version, or 0 (the base model) when none is recorded."""
    version = conn.execute(select(func.max(PolicyVersion.version)).where(PolicyVersion.is_active == true())).scalar()
    return int(version) if version is not None else 0


def eligible_statuses(settings: TrainerSettings) -> tuple[str, ...]:
    return ("succeeded", "failed") if settings.include_failed else ("succeeded",)


def eligible_attempts(settings: TrainerSettings, current_version: int) -> Select[int, str, str, str, int, datetime]:
    """Eligible attempts as (pk, rollout_id, attempt_id, group_key, policy_version, finished_at)."""
    version = func.coalesce(Attempt.policy_version, 0)
    same_attempt = and_(Reward.rollout_id == Attempt.rollout_id, Reward.attempt_id == Attempt.attempt_id)
    # With the gate off every version is eligible; `off_policy_max_lag` then bounds it per call.
    fresh = version >= current_version - settings.max_staleness if settings.staleness_gate else true()
    return (
        select(
            Attempt.id,
            Attempt.rollout_id,
            Attempt.attempt_id,
            func.coalesce(Rollout.group_id, Attempt.rollout_id).label("group_key"),
            version.label("version"),
            func.coalesce(Attempt.finished_at, Attempt.created_at).label("finished"),
        )
        .join(Rollout, Rollout.rollout_id == Attempt.rollout_id)
        .where(
            Attempt.status.in_(eligible_statuses(settings)),
            fresh,
            exists().where(same_attempt),
            ~exists().where(TrainingStepAttempt.attempt_pk == Attempt.id),
            ~exists().where(ExportAttempt.attempt_pk == Attempt.id),
            # A call record the database refused waits in the proxy's dead-letter spool: the
            # trajectory is incomplete until `rolltap-proxy spool replay` writes it.
            ~exists().where(UndurableCall.rollout_id == Attempt.rollout_id,
                            UndurableCall.attempt_id == Attempt.attempt_id),
        )
        .order_by(Attempt.id)
    )


@dataclass(slots=True)
class GroupState:
    """A group of eligible attempts and whether it may be used now."""

    group_id: str
    members: list[AttemptRow]
    oldest_finished_at: datetime
    readiness: GroupReadiness

    @property
    def is_ready(self) -> bool:
        return self.readiness in ("full", "timed_out")


def scan_groups(conn: Conn, settings: TrainerSettings, *, now: datetime | None = None) -> list[GroupState]:
    """Every group with eligible attempts, oldest first, with its readiness. Rewards and calls not loaded."""
    now = utc(now) if now is not None else datetime.now(UTC)
    current = current_policy_version(conn)
    by_group: dict[str, list[AttemptRow]] = defaultdict(list)
    for pk, rollout_id, attempt_id, group_key, version, finished in conn.execute(eligible_attempts(settings, current)):
        by_group[group_key].append(
            AttemptRow(pk, rollout_id, attempt_id, group_key, "", int(version), utc(finished))
        )
    states = []
    for group_id, members in by_group.items():
        oldest = min(m.finished_at for m in members)
        timed_out = (now - oldest).total_seconds() >= settings.group_timeout_s
        readiness: GroupReadiness
        if len(members) >= settings.group_size:
            readiness = "full"
        elif timed_out:
            readiness = "timed_out" if len(members) >= settings.min_group_size else "stalled"
        else:
            readiness = "waiting"
        states.append(GroupState(group_id, members, oldest, readiness))
    states.sort(key=lambda s: (s.oldest_finished_at, s.group_id))
    return states


def load_attempt_data(conn: Conn, attempts: Sequence[AttemptRow], *, with_calls: bool = True) -> None:
    """Fill in each attempt's status, task, rewards (posting order) and calls (`seq` order)."""
    by_pk = {a.pk: a for a in attempts}
    pks = sorted(by_pk)
    same_attempt = and_(Attempt.rollout_id == Reward.rollout_id, Attempt.attempt_id == Reward.attempt_id)
    for part in chunks(pks):
        for pk, status, task, json_exact in conn.execute(
            select(Attempt.id, Attempt.status, Rollout.task, Rollout.json_exact)
            .join(Rollout, Rollout.rollout_id == Attempt.rollout_id)
            .where(Attempt.id.in_(part))
        ):
            by_pk[pk].status = status
            by_pk[pk].task = overlay_exact(json_exact, {"task": task})["task"]
        for pk, value, name, call_id in conn.execute(
            select(Attempt.id, Reward.value, Reward.name, Reward.call_id)
            .join(Attempt, same_attempt)
            .where(Attempt.id.in_(part))
            .order_by(Reward.id)
        ):
            by_pk[pk].rewards.append(RewardRow(float(value), name, call_id))
        if with_calls:
            _load_calls(conn, part, by_pk)


def _json(text: str | None) -> Any:
    # SQL NULL and a stored JSON null both mean "absent" here.
    return None if text is None else orjson.loads(text)


def _load_calls(conn: Conn, pks: list[int], by_pk: dict[int, AttemptRow]) -> None:
    stmt = (
        select(
            Attempt.id,
            Call.call_id,
            Call.seq,
            Call.route,
            Call.status,
            # Token lists are most of the bytes read: fetched as text and parsed with orjson,
            # ~4x faster than the stdlib json the drivers and SQLAlchemy would use.
            cast(Call.prompt_token_ids, Text).label("prompt_token_ids"),
            cast(Call.completion_token_ids, Text).label("completion_token_ids"),
            cast(Call.completion_logprobs, Text).label("completion_logprobs"),
            Call.finish_reason,
            Call.policy_version,
            cast(Call.request, Text).label("request"),
            cast(Call.response, Text).label("response"),
            Call.json_exact,
            Call.replica,
            Call.response_truncated,
        )
        .join(Attempt, and_(Attempt.rollout_id == Call.rollout_id, Attempt.attempt_id == Call.attempt_id))
        .where(Attempt.id.in_(pks))
        .order_by(Attempt.id, Call.seq)
    )
    for row in conn.execute(stmt):
        attempt = by_pk[row[0]]
        # The exact request/response when the stored copies had to change (U+0000 and the like).
        exact = overlay_exact(row.json_exact, {"request": _json(row.request), "response": _json(row.response)})
        attempt.calls.append(
            CallRow(
                call_id=row.call_id,
                seq=int(row.seq),
                route=row.route,
                status=row.status,
                prompt_token_ids=_json(row.prompt_token_ids),
                completion_token_ids=_json(row.completion_token_ids),
                completion_logprobs=_json(row.completion_logprobs),
                finish_reason=row.finish_reason,
                policy_version=row.policy_version,
                request=exact["request"],
                response=exact["response"],
                replica=row.replica,
                response_truncated=bool(row.response_truncated),
                rollout_id=attempt.rollout_id,
                attempt_id=attempt.attempt_id,
            )
        )


def find_ready_groups(
    conn: Conn,
    settings: TrainerSettings,
    *,
    now: datetime | None = None,
    max_groups: int | None = None,
    with_calls: bool = True,
) -> list[Group]:
    """Ready groups, oldest first (at most `max_groups`), with rewards and calls loaded."""
    ready = [s for s in scan_groups(conn, settings, now=now) if s.is_ready]
    if max_groups is not None:
        ready = ready[:max_groups]
    groups = [Group(s.group_id, s.members, s.readiness == "full") for s in ready]
    load_attempt_data(conn, [a for g in groups for a in g.attempts], with_calls=with_calls)
    return groups
