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
from trainer import algos, credit
from trainer.credit import assign_credit, attempt_return, final_reward
from trainer.drops import record_drops
from trainer.reader import current_policy_version, load_attempt_data, scan_groups
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
    reward: float  # the credit of this triplet's last turn (`turn_rewards` holds every turn's)
    final_reward: float  # the attempt's reward
    task: Any = None
    # This triplet's share of its attempt's advantage (`credit.spread`) on its last turn; None
    # for samples made elsewhere, whose batch then leaves the advantages to the update (verl's
    # estimator by `uid`).
    advantage: float | None = None
    # Per turn (one per call merged into the triplet, `Triplet.turn_ends`): credit and share of
    # the advantage. Credit is given per turn, so `last_only` trains only the last call's
    # tokens of a merged multi-turn row. None: `reward` / `advantage` on every turn.
    turn_rewards: list[float] | None = None
    turn_advantages: list[float] | None = None
    attempt_advantage: float = 0.0  # the attempt's advantage in its group (`algos.attempt_advantages`)
    attempt_return: float = 0.0  # what the group's statistics saw of this attempt (`credit.attempt_return`)
    group_size: int = 0  # attempts in the group's statistics
    group_mean: float = 0.0
    group_std: float = 0.0  # unbiased; 0.0 for a tied group


@dataclass(slots=True)
class DataRead:
    """What one read produced: the groups (all of whose attempts a consumer consumes), samples and drops.

    `skipped` names the groups read and consumed but not trained on, with why: `no_triplets`
    (every call dropped; the drops say why) or `tied` (every attempt scored the same, skipped
    under `dynamic_sampling`). `tied_groups` counts tied groups kept in the batch (their
    advantage is exactly 0).
    """

    groups: list[Group] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    tied_groups: int = 0
    current_version: int = 0

    @property
    def attempt_pks(self) -> list[int]:
        """Every attempt of the groups read, including those that yielded no triplet."""
        return [a.pk for g in self.groups for a in g.attempts]

    @property
    def num_calls(self) -> int:
        return sum(len(a.calls) for g in self.groups for a in g.attempts)

    def drop_counts(self) -> Counter[str]:
        return Counter(str(d.reason) for d in self.drops)

    def skip_counts(self) -> Counter[str]:
        return Counter(self.skipped.values())


def limits_from(settings: TrainerSettings, current_version: int = 0) -> BuildLimits:
    lag = settings.off_policy_max_lag
    return BuildLimits(
        settings.max_prompt_len,
        settings.max_response_len,
        settings.drop_truncated,
        include_hosted=settings.include_hosted,
        unreproducible_sampling=settings.unreproducible_sampling,
        min_policy_version=None if lag is None else current_version - lag,
    )


@dataclass(slots=True)
class _AttemptPart:
    attempt: AttemptRow
    triplets: list[Triplet]
    credits: list[float]  # one per turn, over the triplets' turns in order
    ret: float | None  # None: no reward (never selected by the reader; kept out of the statistics)


def _attempt_part(attempt: AttemptRow, settings: TrainerSettings, limits: BuildLimits,
                  tokenizer: Tokenizer | None) -> tuple[_AttemptPart, list[Drop]]:
    triplets, drops = build_triplets(attempt.calls, limits, tokenizer)
    if not attempt.rewards:  # never selected by the reader; an export of hand-made groups may have one
        return _AttemptPart(attempt, [], [], None), drops
    call_seq = {c.call_id: c.seq for c in attempt.calls}
    # Credit goes to turns (calls), not rows: a merged row holds several turns, each its own share.
    turns = [[seq] for t in triplets for seq in t.seqs]
    credits = assign_credit(settings.credit, turns, attempt.rewards, call_seq, settings.gamma)
    # An attempt counts in its group's statistics with its whole return, also when every call
    # was dropped: its reward is still a sample of what the policy scores on the task.
    return _AttemptPart(attempt, triplets, credits, attempt_return(settings.credit, attempt.rewards, call_seq)), drops


def _is_tied(parts: list[_AttemptPart]) -> bool:
    returns = [p.ret for p in parts if p.ret is not None]
    return len(returns) < 2 or max(returns) - min(returns) <= algos.TIE_TOLERANCE


def build_samples(groups: list[Group], settings: TrainerSettings, tokenizer: Tokenizer | None = None,
                  *, current_version: int = 0, max_groups: int | None = None) -> DataRead:
    """Triplets, credit and per-attempt advantages for loaded groups (pure: no database).

    Groups are taken in order until `max_groups` of them are trained on; a group with no
    triplet (and, under `dynamic_sampling`, a tied group) is skipped, recorded in
    `skipped` and read past, so such groups never hold up the ones behind them.
    """
    out = DataRead(current_version=current_version)
    limits = limits_from(settings, current_version)
    kept: list[tuple[Group, list[_AttemptPart]]] = []
    for group in groups:
        if max_groups is not None and len(kept) >= max_groups:
            break
        out.groups.append(group)
        parts = []
        for attempt in group.attempts:
            part, drops = _attempt_part(attempt, settings, limits, tokenizer)
            parts.append(part)
            out.drops += drops
        if not any(p.triplets for p in parts):
            out.skipped[group.group_id] = "no_triplets"
        elif _is_tied(parts) and settings.dynamic_sampling:
            out.skipped[group.group_id] = "tied"
        else:
            out.tied_groups += _is_tied(parts)
            kept.append((group, parts))
    _add_samples(out, kept, settings)
    return out


def _add_samples(out: DataRead, kept: list[tuple[Group, list[_AttemptPart]]], settings: TrainerSettings) -> None:
    scored = [(g, p) for g, parts in kept for p in parts if p.ret is not None]
    if settings.adv_estimator == "gae":
        # A critic's per-token values, not group statistics: the update computes these advantages.
        adv = algos.AttemptAdvantages([0.0] * len(scored), [False] * len(scored), {})
    else:
        adv = algos.attempt_advantages(
            settings.adv_estimator,
            [p.ret or 0.0 for _, p in scored],  # `scored` holds rewarded attempts only
            [g.group_id for g, _ in scored],
            norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo,
        )
    for (group, part), a_adv in zip(scored, adv.advantages, strict=True):
        if not part.triplets:
            continue
        size, mean, std = adv.group_stats.get(group.group_id, (0, 0.0, 0.0))
        final = final_reward(part.attempt.rewards)
        shares: list[float] | None = (
            None if settings.adv_estimator == "gae"  # per token, by the critic: the update's
            else list(credit.spread(settings.credit, a_adv, part.credits, settings.gamma))
        )
        start = 0
        for i, t in enumerate(part.triplets):
            end = start + len(t.seqs)
            rewards = part.credits[start:end]
            turn_shares = None if shares is None else shares[start:end]
            out.samples.append(Sample(
                t, group.group_id, part.attempt.rollout_id, part.attempt.attempt_id, part.attempt.pk, i,
                rewards[-1], final if final is not None else float(part.ret or 0.0), part.attempt.task,
                advantage=None if turn_shares is None else turn_shares[-1], attempt_advantage=a_adv,
                attempt_return=float(part.ret or 0.0), group_size=size, group_mean=mean, group_std=std,
                turn_rewards=rewards, turn_advantages=turn_shares,
            ))
            start = end


def read_samples(
    engine: Engine,
    settings: TrainerSettings,
    *,
    tokenizer: Tokenizer | None = None,
    now: datetime | None = None,
    max_groups: int | None = None,
    store_drops: bool = True,
) -> DataRead:
    """Read ready groups, oldest first, until `max_groups` are trainable; store the drop reasons found.

    Groups are loaded a few at a time, so skipped groups at the head of the queue cost one
    more read, never a stall.
    """
    with engine.connect() as conn:
        current = current_policy_version(conn)
        ready = [s for s in scan_groups(conn, settings, now=now) if s.is_ready]
        groups: list[Group] = []
        out = DataRead(current_version=current)
        chunk = max_groups or len(ready) or 1
        pos = 0
        while pos < len(ready):
            part = [Group(s.group_id, s.members, s.readiness == "full") for s in ready[pos : pos + chunk]]
            pos += len(part)
            load_attempt_data(conn, [a for g in part for a in g.attempts])
            groups += part
            out = build_samples(groups, settings, tokenizer, current_version=current, max_groups=max_groups)
            if max_groups is None or len(out.groups) - len(out.skipped) >= max_groups:
                break
    if store_drops and out.drops:
        with engine.begin() as conn:
            record_drops(conn, out.drops)
    return out
