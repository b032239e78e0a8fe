"""Per-attempt group statistics (verl's estimators over attempts) spread over triplets by the credit rule.

Hand-computed values; the acceptance group: attempt "win" (three calls that do not extend
each other, so three triplets) scored 1.0, attempt "lose" (one call) scored 0.0.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from shared.settings import LimitSettings, TrainerSettings
from trainer import algos
from trainer.batch import build_batch
from trainer.credit import final_reward, spread
from trainer.data import build_samples
from trainer.records import AttemptRow, CallRow, Group, RewardRow

EPS = 1e-6
GRPO_2 = 0.5 / (math.sqrt(0.5) + EPS)  # rewards {1, 0}: mean 0.5, unbiased std sqrt(0.5): 0.70710...


def call(rollout: str, attempt: str, seq: int, first_token: int) -> CallRow:
    # Each call's prompt is new (it does not extend the previous call): one triplet per call.
    return CallRow(
        call_id=f"{rollout}-{attempt}-{seq}", seq=seq, route="chat/completions", status="ok",
        prompt_token_ids=[first_token, first_token + 1], completion_token_ids=[first_token + 2, first_token + 3],
        completion_logprobs=[-0.5, -0.7], policy_version=0, rollout_id=rollout, attempt_id=attempt,
    )


def attempt(pk: int, rollout: str, name: str, reward: float, calls: int) -> AttemptRow:
    return AttemptRow(
        pk, rollout, name, rollout, "succeeded", 0, datetime.now(UTC), rewards=[RewardRow(reward, "final")],
        calls=[call(rollout, name, seq, 10 * pk + 3 * seq) for seq in range(calls)],
    )


def acceptance_group(rollout: str = "task", win: float = 1.0, lose: float = 0.0) -> Group:
    return Group(rollout, [attempt(1, rollout, "win", win, 3), attempt(2, rollout, "lose", lose, 1)], True)


def by_attempt(samples: list, key: str = "advantage") -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in samples:
        out.setdefault(s.attempt_id, []).append(getattr(s, key))
    return out


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", GRPO_2),
        ("rloo", 1.0),  # 1 - mean of the others (0), and 0 - 1
        ("reinforce_plus_plus_baseline", 1 / math.sqrt(2)),  # +-0.5, whitened with the unbiased std
        ("reinforce_plus_plus", 1 / math.sqrt(2)),  # 1 and 0, whitened
    ],
)
def test_attempt_advantages_of_two_attempts(estimator: str, expected: float) -> None:
    adv = algos.attempt_advantages(estimator, [1.0, 0.0], ["g", "g"])
    assert adv.advantages == pytest.approx([expected, -expected], abs=1e-5)
    assert adv.group_stats["g"] == (2, 0.5, pytest.approx(math.sqrt(0.5)))


def test_attempt_advantages_by_hand_three_members_and_two_groups() -> None:
    returns, groups = [1.0, 0.5, 0.0, 2.0, 4.0], ["a", "a", "a", "b", "b"]
    grpo = algos.attempt_advantages("grpo", returns, groups)
    # a: mean 0.5, std 0.5 -> +-1, 0; b: mean 3, std sqrt(2)
    assert grpo.advantages == pytest.approx([0.5 / (0.5 + EPS), 0.0, -0.5 / (0.5 + EPS),
                                             -1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)], abs=1e-6)
    rloo = algos.attempt_advantages("rloo", returns, groups)
    assert rloo.advantages == pytest.approx([1 - 0.25, 0.5 - 0.5, 0 - 0.75, 2 - 4, 4 - 2], abs=1e-6)
    dr_grpo = algos.attempt_advantages("grpo", returns, groups, norm_adv_by_std_in_grpo=False)
    assert dr_grpo.advantages == pytest.approx([0.5, 0.0, -0.5, -1.0, 1.0], abs=1e-6)


def test_tied_groups_get_exactly_zero_not_float_noise() -> None:
    # 0.1 + 0.2 != 0.3 in floating point; float32 rounding made verl's GRPO give such a
    # group +-0.03 and more (its std is ~0 and it divides by std + 1e-6).
    returns = [0.1 + 0.2, 0.3, 0.3, 1.0, 0.0]
    groups = ["tie", "tie", "tie", "one", "two"]
    raw, _ = algos.compute_advantages(
        "grpo", token_level_rewards=torch.tensor(returns[:3]).unsqueeze(-1), response_mask=torch.ones(3, 1),
        index=np.array(groups[:3], dtype=object),
    )
    adv = algos.attempt_advantages("grpo", returns, groups)
    assert adv.advantages == [0.0] * 5  # singletons ("one", "two") tie too: nothing to compare with
    assert all(a == 0.0 and math.copysign(1, a) == 1 for a in adv.advantages[:3])
    assert adv.is_tied == [True] * 5 and adv.tied_groups == 3
    assert raw.abs().sum() >= 0.0  # verl's own answer is whatever the rounding makes it; ours is exact


@pytest.mark.parametrize(
    ("mode", "win"),
    [
        ("identical", [GRPO_2] * 3),
        ("last_only", [0.0, 0.0, GRPO_2]),
        ("discounted", [GRPO_2 * 0.81, GRPO_2 * 0.9, GRPO_2]),
        ("per_call", [GRPO_2] * 3),  # the finish reward sits on the last triplet: reward-to-go 1.0 everywhere
    ],
)
def test_acceptance_group_in_every_credit_mode(mode: str, win: list[float]) -> None:
    data = build_samples([acceptance_group()], TrainerSettings(credit=mode, gamma=0.9))  # type: ignore[arg-type]
    adv = by_attempt(data.samples)
    assert adv["win"] == pytest.approx(win, abs=1e-6)
    assert adv["lose"] == pytest.approx([-GRPO_2], abs=1e-6)
    per_attempt = {k: v[0] for k, v in by_attempt(data.samples, "attempt_advantage").items()}
    assert per_attempt["win"] == pytest.approx(0.7071, abs=1e-4) and per_attempt["win"] == -per_attempt["lose"]
    s = data.samples[0]
    assert (s.group_size, s.group_mean, s.group_std) == (2, 0.5, pytest.approx(math.sqrt(0.5)))


@pytest.mark.parametrize("mode", ["identical", "last_only", "discounted", "per_call"])
def test_tied_group_is_exactly_zero_in_every_credit_mode(mode: str) -> None:
    data = build_samples([acceptance_group(win=0.5, lose=0.5)], TrainerSettings(credit=mode))  # type: ignore[arg-type]
    assert [s.advantage for s in data.samples] == [0.0] * 4
    assert data.tied_groups == 1 and data.samples[0].group_std == 0.0
    batch = build_batch(data.samples)
    assert torch.equal(batch.tensors["advantages"], torch.zeros_like(batch.tensors["advantages"]))


def test_triplet_level_statistics_would_count_the_three_call_attempt_three_times() -> None:
    """verl's GRPO over the batch's rows (uid = group) is what the trainer did before: it fails here."""
    data = build_samples([acceptance_group()], TrainerSettings())
    batch = build_batch(data.samples)
    per_row, _ = algos.compute_advantages(
        "grpo", token_level_rewards=batch.tensors["token_level_rewards"],
        response_mask=batch.tensors["response_mask"], index=batch.non_tensors["uid"],
    )
    row_adv = per_row.max(dim=1).values.where(per_row.sum(1) > 0, per_row.min(dim=1).values)
    # rows: three of 1.0 and one of 0.0 -> mean 0.75, std 0.5: +0.5 and -1.5, not +-0.7071
    assert row_adv.tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=1e-4)
    ours = batch.tensors["advantages"]
    assert ours[:, 0].tolist() == pytest.approx([GRPO_2, GRPO_2, GRPO_2, -GRPO_2], abs=1e-6)


def test_spread_per_call_by_reward_to_go() -> None:
    # credits 0.2, 0.0, 0.8 (return 1.0): reward-to-go 1.0, 0.8, 0.8
    assert spread("per_call", 2.0, [0.2, 0.0, 0.8]) == pytest.approx([2.0, 1.6, 1.6])
    assert spread("per_call", 2.0, [0.5, -0.5]) == [2.0, 2.0]  # nothing to apportion
    assert spread("last_only", 0.0, [1.0, 1.0]) == [0.0, 0.0]


def test_per_call_rewards_form_the_attempt_return() -> None:
    g = acceptance_group()
    win = g.attempts[0]
    win.rewards = [RewardRow(0.25, None, win.calls[0].call_id), RewardRow(0.75, None, win.calls[2].call_id)]
    data = build_samples([g], TrainerSettings(credit="per_call"))
    samples = [s for s in data.samples if s.attempt_id == "win"]
    assert [s.reward for s in samples] == [0.25, 0.0, 0.75]
    assert samples[0].attempt_return == 1.0
    assert [s.advantage for s in samples] == pytest.approx([GRPO_2, GRPO_2 * 0.75, GRPO_2 * 0.75], abs=1e-6)


@pytest.mark.parametrize("limit", [LimitSettings().max_abs_reward, 1e15])  # the default, the largest allowed
def test_rewards_at_the_proxy_limit_give_finite_exact_advantages(limit: float) -> None:
    """Rewards as large as the proxy accepts (`proxy.limits.max_abs_reward`, default and largest
    allowed): returns summed from several rewards, group statistics and every estimator stay finite,
    and a spread of 2 at that magnitude is still a signal (float32 would tie it)."""
    posted = [RewardRow(limit, None, None), RewardRow(-limit, None, None), RewardRow(limit, None, None)]
    returns = [final_reward(posted), final_reward([RewardRow(limit - 2, None, None)]), limit, -limit, -limit]
    assert returns[:2] == [limit, limit - 2]
    groups = ["near", "near", "far", "far", "far"]
    for estimator in ("grpo", "rloo", "reinforce_plus_plus"):
        for norm in (True, False):
            adv = algos.attempt_advantages(estimator, returns, groups, norm_adv_by_std_in_grpo=norm)
            assert all(math.isfinite(a) for a in adv.advantages), (estimator, adv.advantages)
            assert all(math.isfinite(v) for stats in adv.group_stats.values() for v in stats)
    grpo = algos.attempt_advantages("grpo", returns, groups)
    # near: mean limit - 1, unbiased std sqrt(2); far: mean -limit / 3, unbiased std 2 * limit / sqrt(3)
    assert grpo.advantages[:2] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)
    assert grpo.advantages[2:] == pytest.approx([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-6)
    with pytest.raises(ValueError):
        LimitSettings(max_abs_reward=1e16)  # beyond it, float32 loss terms could overflow
