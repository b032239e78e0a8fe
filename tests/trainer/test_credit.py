"""Credit assignment on hand-computed cases."""

from __future__ import annotations

import pytest

from trainer.credit import assign_credit, discounted, final_reward, identical, last_only, per_call
from trainer.records import RewardRow as R


def test_final_reward_prefers_the_last_final() -> None:
    assert final_reward([R(0.2, "final"), R(5.0, "shaping"), R(0.7, "final")]) == 0.7
    assert final_reward([R(0.5, "format"), R(0.25), R(-1.0, "length")]) == pytest.approx(-0.25)
    assert final_reward([]) is None


def test_modes_by_hand() -> None:
    assert identical(2.0, 3) == [2.0, 2.0, 2.0]
    assert last_only(2.0, 3) == [0.0, 0.0, 2.0]
    assert last_only(2.0, 0) == []
    assert discounted(2.0, 3, 0.5) == [0.5, 1.0, 2.0]
    assert discounted(1.0, 1, 0.9) == [1.0]


def test_assign_credit_dispatches() -> None:
    seqs = [[0, 1], [2], [3, 4]]
    rewards = [R(1.0, "final")]
    assert assign_credit("identical", seqs, rewards) == [1.0, 1.0, 1.0]
    assert assign_credit("last_only", seqs, rewards) == [0.0, 0.0, 1.0]
    assert assign_credit("discounted", seqs, rewards, gamma=0.9) == pytest.approx([0.81, 0.9, 1.0])
    with pytest.raises(ValueError):
        assign_credit("identical", seqs, [])


def test_per_call_rewards_go_to_the_triplet_holding_the_call() -> None:
    seqs = [[0, 1], [3], [4, 6]]
    call_seq = {"a": 0, "b": 1, "c": 3, "d": 6, "dropped": 2, "late-dropped": 7}
    rewards = [
        R(0.5, "step", "a"),
        R(0.25, "step", "b"),  # same triplet as a: summed
        R(-1.0, "step", "c"),
        R(2.0, "step", "d"),
        R(0.1, "step", "dropped"),  # seq 2 is in no triplet: goes to the first ending at or after it
        R(0.3, "step", "late-dropped"),  # after every triplet: the last one
        R(10.0, "final"),  # not aimed at a call: the last triplet
        R(1.0, "step", "unknown-call"),  # unknown call id: read as unaimed, but "final" wins among unaimed
    ]
    assert per_call(seqs, rewards, call_seq) == pytest.approx([0.75, -0.9, 12.3])
    assert assign_credit("per_call", seqs, rewards, call_seq) == pytest.approx([0.75, -0.9, 12.3])


def test_per_call_without_unaimed_rewards() -> None:
    assert per_call([[0], [1]], [R(1.0, None, "x")], {"x": 0}) == [1.0, 0.0]
    assert per_call([], [R(1.0)], {}) == []
