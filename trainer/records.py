"""Plain, typed records the trainer's data path passes between its stages.

This module owns the shapes only: what the reader loads from the database and what the
trajectory builder and credit assignment consume. No SQL, no torch, no behaviour, so the
pure stages (`trajectory`, `credit`) can be tested on hand-made values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["AttemptRow", "CallRow", "Group", "RewardRow"]


@dataclass(frozen=True, slots=True)
class CallRow:
    """The columns of one `calls` row that building a trajectory needs."""

    call_id: str
    seq: int
    route: str
    status: str
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float | None] | None
    finish_reason: str | None = None
    policy_version: int | None = None
    request: Any = None
    response: Any = None
    replica: str | None = None  # "litellm:<model>" for a hosted model
    response_truncated: bool = False  # the stored response was cut at `proxy.recorder.max_body_bytes`
    rollout_id: str = ""
    attempt_id: str = ""


@dataclass(frozen=True, slots=True)
class RewardRow:
    """One posted reward; `call_id` set when it was aimed at one call. Kept in posting order."""

    value: float
    name: str | None = None
    call_id: str | None = None


@dataclass(slots=True)
class AttemptRow:
    """A finished, rewarded attempt the reader selected, with its rewards and (once loaded) its calls."""

    pk: int
    rollout_id: str
    attempt_id: str
    group_id: str
    status: str
    policy_version: int
    finished_at: datetime
    task: Any = None  # the rollout's registered task, if any
    rewards: list[RewardRow] = field(default_factory=list)
    calls: list[CallRow] = field(default_factory=list)


@dataclass(slots=True)
class Group:
    """Attempts compared with each other by GRPO: one rollout's attempts, or all rollouts of a `group_id`.

    `is_full` is False when the group was released by `group_timeout_s` short of `group_size`.
    """

    group_id: str
    attempts: list[AttemptRow]
    is_full: bool
