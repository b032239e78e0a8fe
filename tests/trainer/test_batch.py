"""Batches in verl's layout, fed to verl's own GRPO advantage and PPO policy loss on CPU."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from shared.settings import TrainerSettings
from trainer.batch import build_batch, round_rows
from trainer.data import build_samples
from trainer.records import AttemptRow, CallRow, Group, RewardRow


def attempt(pk: int, rollout: str, reward: float, turns: int, base: int) -> AttemptRow:
    """A multi-turn attempt whose calls extend each other (one merged triplet) except every third."""
    calls, acc = [], [base, base + 1]
    for seq in range(turns):
        prompt = [*acc, 7, 8] if seq % 3 else [base + 100 + seq]  # a rewritten context every 3rd call
        completion = [base + 10 + seq] * (1 + (pk + seq) % 4)
        calls.append(
            CallRow(
                call_id=f"{rollout}-{pk}-{seq}", seq=seq, route="chat/completions", status="ok",
                prompt_token_ids=prompt, completion_token_ids=completion,
                completion_logprobs=[-0.3 - 0.1 * seq] * len(completion), policy_version=1,
                rollout_id=rollout, attempt_id=str(pk),
            )
        )
        acc = [*prompt, *completion]
    return AttemptRow(pk, rollout, str(pk), rollout, "succeeded", 1, datetime.now(UTC), rewards=[RewardRow(reward, "final")], calls=calls)


def groups() -> list[Group]:
    return [
        Group("task-a", [attempt(1, "task-a", 1.0, 2, 10), attempt(2, "task-a", 0.0, 4, 20), attempt(3, "task-a", 1.0, 1, 30)], True),
        Group("task-b", [attempt(4, "task-b", 0.5, 3, 40), attempt(5, "task-b", -0.5, 2, 50)], True),
    ]


def test_layout_shapes_and_masks() -> None:
    data = build_samples(groups(), TrainerSettings())
    b = build_batch(data.samples, mini_batch_size=4, pad_token_id=0)
    n = len(data.samples)
    rows = round_rows(n, 4, "pad")
    assert len(b) == rows and rows % 4 == 0 and rows >= n
    P = max(len(s.triplet.prompt_ids) for s in data.samples)
    R = max(len(s.triplet.response_ids) for s in data.samples)
    t = b.tensors
    assert t["prompts"].shape == (rows, P) and t["responses"].shape == (rows, R)
    assert t["input_ids"].shape == t["attention_mask"].shape == t["position_ids"].shape == (rows, P + R)
    for key in ("response_mask", "token_level_scores", "token_level_rewards", "rollout_log_probs"):
        assert t[key].shape == (rows, R), key
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    for i, s in enumerate(data.samples):
        tr = s.triplet
        n_p, n_r = len(tr.prompt_ids), len(tr.response_ids)
        assert t["prompts"][i, P - n_p :].tolist() == tr.prompt_ids  # left-padded
        assert t["attention_mask"][i, : P - n_p].sum() == 0
        assert t["responses"][i, :n_r].tolist() == tr.response_ids  # right-padded
        assert t["attention_mask"][i, P : P + n_r].sum() == n_r and t["attention_mask"][i, P + n_r :].sum() == 0
        assert t["response_mask"][i, :n_r].tolist() == tr.response_mask and t["response_mask"][i, n_r:].sum() == 0
        assert t["position_ids"][i, P - n_p : P + n_r].tolist() == list(range(n_p + n_r))
        scores = t["token_level_scores"][i]
        assert scores[n_r - 1] == pytest.approx(s.reward) and scores.abs().sum() == pytest.approx(abs(s.reward))
        assert t["rollout_log_probs"][i, :n_r].tolist() == pytest.approx(tr.response_logprobs)
    assert b.non_tensors["uid"].dtype == object
    assert list(b.non_tensors["uid"][:n]) == [s.group_id for s in data.samples]
    pad = t["is_pad"]
    assert pad.sum() == rows - n and t["response_mask"][pad].sum() == 0
    assert len(set(b.non_tensors["uid"][n:])) == rows - n  # every padding row is its own group


def test_drop_rounding() -> None:
    data = build_samples(groups(), TrainerSettings())
    n = len(data.samples)
    b = build_batch(data.samples, mini_batch_size=4, batch_round="drop")
    assert len(b) == n // 4 * 4 and not b.tensors["is_pad"].any()
    with pytest.raises(ValueError):
        build_batch(data.samples[:3], mini_batch_size=4, batch_round="drop")


def test_verl_grpo_advantage_and_ppo_loss_on_the_batch() -> None:
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    data = build_samples(groups(), TrainerSettings())
    n = len(data.samples)
    proto = build_batch(data.samples, mini_batch_size=4).to_dataproto()
    assert isinstance(proto, DataProto)
    proto.check_consistency()

    mask = proto.batch["response_mask"]
    adv, returns = compute_grpo_outcome_advantage(
        token_level_rewards=proto.batch["token_level_rewards"],
        response_mask=mask,
        index=proto.non_tensor_batch["uid"],
    )
    assert adv.shape == mask.shape and torch.isfinite(adv).all()
    assert (adv[mask == 0] == 0).all()
    # by hand: every triplet of a group is one GRPO sample with its attempt's (identical) reward
    uid = proto.non_tensor_batch["uid"]
    for i in range(n):
        group = [j for j in range(n) if uid[j] == uid[i]]
        scores = torch.tensor([data.samples[j].reward for j in group])
        expected = (data.samples[i].reward - scores.mean()) / (scores.std() + 1e-6)
        row = adv[i][mask[i].bool()]
        assert torch.allclose(row, torch.full_like(row, float(expected)), atol=1e-5)
    assert (adv[n:] == 0).all()  # padding rows carry no advantage

    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, use_torch_compile=False)
    old = proto.batch["rollout_log_probs"]
    log_prob = (old + 0.05 * torch.randn_like(old)).requires_grad_(True)
    loss, metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=config
    )
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(np.isfinite(v) for v in metrics.values())
    loss.backward()
    assert log_prob.grad is not None
    assert (log_prob.grad[mask == 0] == 0).all()  # masked turns and padding never reach the gradient
    assert (log_prob.grad[mask == 1] != 0).any()


def test_plain_dict_without_verl() -> None:
    data = build_samples(groups(), TrainerSettings())
    b = build_batch(data.samples)
    plain = {**b.tensors, **b.non_tensors}
    assert set(plain) >= {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "uid"}
