"""The data path from database to samples: ready groups -> triplets -> credited rewards.

This module owns the order of the phases and what they hand each other; each phase
lives in its own module (`reader`, `trajectory`, `credit`, `drops`). It does not
consume anything: the step (or export) that uses the samples records that, in its
own transaction, with `trainer.consumption`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine

from shared.settings import TrainerSettings
from trainer.credit import assign_credit, final_reward
from trainer.drops import record_drops
from trainer.reader import find_ready_groups
from trainer.records import AttemptRow, Group
from trainer.trajectory import BuildLimits, Drop, Tokenizer, Triplet, build_triplets

__all__ = ["DataRead", "Sample", "build_samples", "limits_from", "read_samples"]


@dataclass(slots=True)
class Sample:
    """One triplet with everything a batch row or an export row needs."""

    triplet: Triplet
    group_id: str
    rollout_id: str
    attempt_id: str
    attempt_pk: int
    index: int  # position of the triplet in its attempt
    reward: float  # this triplet's credit
    final_reward: float  # the attempt's reward
    task: Any = None


@dataclass(slots=True)
class DataRead:
    """What one read produced: the groups (all of whose attempts a consumer consumes), samples and drops."""

    groups: list[Group] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)

    @property
    def attempt_pks(self) -> list[int]:
        """Every attempt of the groups read, including those that yielded no triplet."""
        return [a.pk for g in self.groups for a in g.attempts]

    @property
    def num_calls(self) -> int:
        return sum(len(a.calls) for g in self.groups for a in g.attempts)

    def drop_counts(self) -> Counter[str]:
        return Counter(str(d.reason) for d in self.drops)


def limits_from(settings: TrainerSettings) -> BuildLimits:
    return BuildLimits(settings.max_prompt_len, settings.max_response_len, settings.drop_truncated)


def _attempt_samples(
    group: Group, attempt: AttemptRow, settings: TrainerSettings, tokenizer: Tokenizer | None
) -> tuple[list[Sample], list[Drop]]:
    triplets, drops = build_triplets(attempt.calls, limits_from(settings), tokenizer)
    final = final_reward(attempt.rewards)
    if not triplets or final is None:
        return [], drops
    rewards = assign_credit(
        settings.credit,
        [t.seqs for t in triplets],
        attempt.rewards,
        {c.call_id: c.seq for c in attempt.calls},
        settings.gamma,
    )
    samples = [
        Sample(t, group.group_id, attempt.rollout_id, attempt.attempt_id, attempt.pk, i, r, final, attempt.task)
        for i, (t, r) in enumerate(zip(triplets, rewards, strict=True))
    ]
    return samples, drops


def build_samples(groups: list[Group], settings: TrainerSettings, tokenizer: Tokenizer | None = None) -> DataRead:
    """Triplets and credit for loaded groups (pure: no database)."""
    out = DataRead(groups=groups)
    for group in groups:
        for attempt in group.attempts:
            samples, drops = _attempt_samples(group, attempt, settings, tokenizer)
            out.samples += samples
            out.drops += drops
    return out


def read_samples(
    engine: Engine,
    settings: TrainerSettings,
    *,
    tokenizer: Tokenizer | None = None,
    now: datetime | None = None,
    max_groups: int | None = None,
    store_drops: bool = True,
) -> DataRead:
    """Read ready groups, build their samples, and store the drop reasons found (own short transaction)."""
    with engine.connect() as conn:
        groups = find_ready_groups(conn, settings, now=now, max_groups=max_groups)
    out = build_samples(groups, settings, tokenizer)
    if store_drops and out.drops:
        with engine.begin() as conn:
            record_drops(conn, out.drops)
    return out
