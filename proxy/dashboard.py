"""What the web dashboard (`/ui`) reads: attempt pages, one attempt's drops, per-version training curves.

Read-only queries on the reader engine. The attempt list is keyset-paginated on
`attempts.id`, newest first: a page costs one index range scan of `limit + 1` rows
whatever the depth (no OFFSET), and each filter has an index that keeps that order
(`ix_attempts_status_id`, `ix_attempts_policy_version_id`, `ix_attempts_created_at`,
`rollouts.group_id`; migration 0005). An attempt's reward is the sum of its posted rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.db.models import Attempt, CallDrop, Reward, Rollout, TrainingStep

__all__ = ["AttemptFilter", "AttemptPage", "attempt_page", "call_drops", "version_curves"]

PAGE_SIZE = 50


@dataclass(frozen=True, slots=True)
class AttemptFilter:
    """The list's filters; None leaves a filter off. `before` is the keyset cursor (an `attempts.id`)."""

    status: str | None = None
    group: str | None = None
    version: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    since: datetime | None = None
    until: datetime | None = None
    before: int | None = None


@dataclass(frozen=True, slots=True)
class AttemptPage:
    rows: list[dict[str, Any]]
    next_before: int | None  # the cursor of the next (older) page; None on the last


async def attempt_page(conn: AsyncConnection, f: AttemptFilter, limit: int = PAGE_SIZE) -> AttemptPage:
    reward = (select(func.sum(Reward.value))
              .where(Reward.rollout_id == Attempt.rollout_id, Reward.attempt_id == Attempt.attempt_id)
              .correlate(Attempt).scalar_subquery())
    query = (select(Attempt.id, Attempt.rollout_id, Attempt.attempt_id, Attempt.status, Attempt.policy_version,
                    Attempt.num_calls, Attempt.created_at, Attempt.finished_at,
                    func.coalesce(Rollout.group_id, Attempt.rollout_id).label("group_id"), reward.label("reward"))
             .join(Rollout, Rollout.rollout_id == Attempt.rollout_id))
    conditions = []
    if f.status:
        conditions.append(Attempt.status == f.status)
    if f.group:
        # A rollout registered with a group id is in that group; any other rollout is its own group.
        conditions.append(or_(Rollout.group_id == f.group, and_(Rollout.group_id.is_(None), Attempt.rollout_id == f.group)))
    if f.version is not None:
        conditions.append(Attempt.policy_version == f.version)
    if f.reward_min is not None:
        conditions.append(reward >= f.reward_min)
    if f.reward_max is not None:
        conditions.append(reward <= f.reward_max)
    if f.since is not None:
        conditions.append(Attempt.created_at >= f.since)
    if f.until is not None:
        conditions.append(Attempt.created_at < f.until)
    if f.before is not None:
        conditions.append(Attempt.id < f.before)
    rows = [dict(r) for r in (await conn.execute(
        query.where(*conditions).order_by(Attempt.id.desc()).limit(limit + 1))).mappings()]
    more = len(rows) > limit
    rows = rows[:limit]
    return AttemptPage(rows, rows[-1]["id"] if more and rows else None)


async def call_drops(conn: AsyncConnection, rollout_id: str, attempt_id: str) -> dict[str, tuple[str, str | None]]:
    """call_id -> (reason, detail) for the attempt's calls the trainer left out."""
    rows = await conn.execute(select(CallDrop.call_id, CallDrop.reason, CallDrop.detail)
                              .where(CallDrop.rollout_id == rollout_id, CallDrop.attempt_id == attempt_id))
    return {r.call_id: (r.reason, r.detail) for r in rows}


async def version_curves(conn: AsyncConnection) -> dict[str, list[tuple[int, float]]]:
    """Per policy version, the mean over its training steps of reward, entropy and staleness.

    Keys: `reward_mean`, `entropy`, `staleness_max`; points are (policy version, value), in order.
    """
    rows = await conn.execute(select(TrainingStep.policy_version, TrainingStep.metrics).order_by(TrainingStep.step))
    sums: dict[str, dict[int, list[float]]] = {"reward_mean": {}, "entropy": {}, "staleness_max": {}}
    for version, metrics in rows:
        if version is None or not isinstance(metrics, dict):
            continue
        for key, by_version in sums.items():
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                by_version.setdefault(int(version), []).append(float(value))
    return {key: [(v, sum(xs) / len(xs)) for v, xs in sorted(by_version.items())]
            for key, by_version in sums.items()}
