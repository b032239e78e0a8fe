"""The update's maths (`trainer/algos.py`, verl's `core_algos` underneath) on hand-computed tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer import algos

SQRT_HALF = 1 / math.sqrt(2)


def uids(*names: str) -> np.ndarray:
    arr = np.empty(len(names), dtype=object)
    arr[:] = names
    return arr


def outcome(rewards: list[float], lengths: list[int], width: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rewards (the reward on each row's last token) and the response mask."""
    r, m = torch.zeros(len(rewards), width), torch.zeros(len(rewards), width, dtype=torch.long)
    for i, (reward, n) in enumerate(zip(rewards, lengths, strict=True)):
        m[i, :n] = 1
        if n:
            r[i, n - 1] = reward
    return r, m


def test_grpo_normalises_within_each_group() -> None:
    r, m = outcome([1.0, 0.0, 3.0, 5.0, 0.0], [3, 2, 1, 2, 0])
    index = uids("a", "a", "b", "b", "pad")
    adv, ret = algos.compute_advantages("grpo", token_level_rewards=r, response_mask=m, index=index)
    # group a: mean 0.5, std (unbiased) 1/sqrt(2) -> +-1/sqrt(2); group b: mean 4, std sqrt(2) -> -+1/sqrt(2)
    expected = torch.tensor([
        [SQRT_HALF, SQRT_HALF, SQRT_HALF],
        [-SQRT_HALF, -SQRT_HALF, 0.0],
        [-SQRT_HALF, 0.0, 0.0],
        [SQRT_HALF, SQRT_HALF, 0.0],
        [0.0, 0.0, 0.0],  # a padding row: no tokens, its own group
    ])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=0)
    dr, _ = algos.compute_advantages(
        "grpo", token_level_rewards=r, response_mask=m, index=index, norm_adv_by_std_in_grpo=False
    )
    assert dr[:4, 0].tolist() == pytest.approx([0.5, -0.5, -1.0, 1.0])


def test_grpo_group_of_one_keeps_its_reward() -> None:
    r, m = outcome([2.0], [2])
    adv, _ = algos.compute_advantages("grpo", token_level_rewards=r, response_mask=m, index=uids("solo"))
    assert adv[0].tolist() == pytest.approx([2.0, 2.0, 0.0], abs=1e-5)  # (2 - 0) / (1 + eps)


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    r, m = outcome([1.0, 0.0, 2.0], [1, 1, 1])
    adv, _ = algos.compute_advantages("rloo", token_level_rewards=r, response_mask=m, index=uids("g", "g", "g"))
    assert adv[:, 0].tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5])


def test_reinforce_plus_plus_carries_returns_over_masked_turns() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0]])
    m = torch.tensor([[1, 0, 1]])  # a tool result between two generated tokens
    adv, ret = algos.compute_advantages(
        "reinforce_plus_plus", token_level_rewards=r, response_mask=m, index=uids("g"), gamma=0.5
    )
    assert ret[0].tolist() == pytest.approx([0.5, 0.0, 1.0])  # the masked token neither counts nor discounts
    # whitened over the two generated tokens: returns 0.5 and 1.0, mean 0.75, unbiased std sqrt(0.125)
    assert adv[0].tolist() == pytest.approx([-SQRT_HALF, 0.0, SQRT_HALF], abs=1e-4)


def test_reinforce_plus_plus_baseline_whitens_group_centred_rewards() -> None:
    r, m = outcome([1.0, 0.0, 3.0, 5.0], [1, 1, 1, 1], width=1)
    adv, _ = algos.compute_advantages(
        "reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m, index=uids("a", "a", "b", "b")
    )
    centred = torch.tensor([0.5, -0.5, -1.0, 1.0])
    assert adv[:, 0].tolist() == pytest.approx((centred / centred.std()).tolist(), abs=1e-4)


def test_gae_with_critic_values() -> None:
    r = torch.tensor([[0.0, 1.0]])
    m = torch.tensor([[1, 1]])
    values = torch.tensor([[0.5, 0.5]])
    adv, ret = algos.compute_advantages(
        "gae", token_level_rewards=r, response_mask=m, index=uids("g"), values=values, gamma=1.0, lam=0.5
    )
    # deltas: t1 = 1 - 0.5 = 0.5, t0 = 0 + 0.5 - 0.5 = 0; gae: t1 = 0.5, t0 = 0 + 0.5 * 0.5 = 0.25
    assert ret[0].tolist() == pytest.approx([0.75, 1.0])
    assert adv[0].tolist() == pytest.approx([-SQRT_HALF, SQRT_HALF], abs=1e-4)  # whitened
    with pytest.raises(ValueError, match="values"):
        algos.compute_advantages("gae", token_level_rewards=r, response_mask=m, index=uids("g"))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        algos.compute_advantages("ppo", token_level_rewards=r, response_mask=m, index=uids("g"))


def test_policy_loss_clips_and_dual_clips_by_hand() -> None:
    config = algos.policy_loss_config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 5.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = algos.policy_loss(old, new, adv, mask, config)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped);
    # token 2: max(5, 1.2) = 5, capped by the dual clip at 3 * 1 = 3
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 3)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert metrics["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 3)
    loss.backward()
    assert new.grad is not None and new.grad.abs().sum().item() == 0.0  # every token is clipped: no gradient


def test_policy_loss_inside_the_clip_range_is_the_plain_surrogate() -> None:
    config = algos.policy_loss_config()
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.1, 0.9]])).requires_grad_()
    adv = torch.tensor([[2.0, -1.0]])
    loss, metrics = algos.policy_loss(old, new, adv, torch.ones(1, 2), config)
    assert loss.item() == pytest.approx((-2.0 * 1.1 + 1.0 * 0.9) / 2)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([-2.0 * 1.1 / 2, 1.0 * 0.9 / 2])  # d(-A r)/d log r = -A r

    weighted, _ = algos.policy_loss(old, new.detach(), adv, torch.ones(1, 2), config, torch.tensor([[2.0, 0.5]]))
    assert weighted.item() == pytest.approx((-2.0 * 1.1 * 2.0 + 1.0 * 0.9 * 0.5) / 2)


def test_policy_loss_ignores_masked_tokens_and_aggregates_by_mode() -> None:
    old = torch.zeros(2, 2)
    new = torch.zeros(2, 2)  # ratio 1 everywhere: the loss is -A
    adv = torch.tensor([[1.0, 3.0], [2.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    token_mean, _ = algos.policy_loss(old, new, adv, mask, algos.policy_loss_config())
    assert token_mean.item() == pytest.approx(-(1 + 3 + 2) / 3)
    seq_mean, _ = algos.policy_loss(old, new, adv, mask, algos.policy_loss_config(loss_agg_mode="seq-mean-token-mean"))
    assert seq_mean.item() == pytest.approx(-((1 + 3) / 2 + 2) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        algos.policy_loss_config(loss_agg_mode="mean")


def test_kl_penalty_estimators() -> None:
    lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert algos.kl_penalty(lp, ref, "kl").item() == pytest.approx(math.log(2))
    assert algos.kl_penalty(lp, ref, "mse").item() == pytest.approx(0.5 * math.log(2) ** 2)
    # k3: exp(ref - lp) - (ref - lp) - 1 = 0.5 + log 2 - 1
    assert algos.kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert algos.kl_penalty(lp, lp, "low_var_kl").item() == 0.0
    with pytest.raises(ValueError, match="kl_type"):
        algos.kl_penalty(lp, ref, "js")


def test_kl_loss_config_switches_verl_kl_loss() -> None:
    assert not algos.policy_loss_config().use_kl_loss
    config = algos.policy_loss_config(kl_coef=0.05, kl_type="k3")
    assert config.use_kl_loss and config.kl_loss_coef == 0.05 and config.kl_loss_type == "k3"


def test_truncated_importance_weights_per_token() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.5, 0.5, 0.5]]))
    replica = torch.log(torch.tensor([[0.25, 0.5, 0.3], [0.1, 0.1, 0.1]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    has = torch.tensor([True, False])  # the second row was re-tokenised: no replica logprobs
    w, metrics = algos.rollout_is_weights(old, replica, mask, has, level="token", threshold=2.0)
    # row 0: ratios 2, 1, 3 -> 3 truncated to 2; row 1: weight 1 on its two tokens, 0 past them
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 2.0], [1.0, 1.0, 0.0]]))
    assert metrics["is_clip_frac"] == pytest.approx(1 / 3)  # of the 3 tokens that had replica logprobs
    assert metrics["is_weight_mean"] == pytest.approx((2 + 1 + 2 + 1 + 1) / 5)


def test_truncated_importance_weights_per_sequence() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    replica = torch.log(torch.tensor([[0.5, 0.25], [1.0, 1.0]]))
    mask = torch.ones(2, 2)
    w, _ = algos.rollout_is_weights(old, replica, mask, level="sequence", threshold=2.0)
    # row 0: 1 * 2 = 2; row 1: 0.5 * 0.5 = 0.25
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.25, 0.25]]))


def test_logprob_mismatch_compares_only_replica_tokens() -> None:
    old = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    replica = torch.tensor([[-1.5, -1.0, 0.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    has = torch.tensor([True, False])
    m = algos.logprob_mismatch(old, replica, mask, has)
    # compared tokens: row 0, first two: old - replica = 0.5, -1.0
    assert m["tokens"] == 2
    assert m["abs_diff_mean"] == pytest.approx(0.75)
    assert m["abs_diff_max"] == pytest.approx(1.0)
    assert m["kl"] == pytest.approx((-0.5 + 1.0) / 2)
    assert m["k3_kl"] == pytest.approx(((math.exp(0.5) - 0.5 - 1) + (math.exp(-1.0) + 1.0 - 1)) / 2)
    assert algos.logprob_mismatch(old, replica, mask, torch.tensor([False, False])) == {}
