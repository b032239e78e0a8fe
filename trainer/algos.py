"""The RL maths of an update, as pure functions over tensors; the formulas are verl's `core_algos`.

Nothing here owns a model or touches a device: every function maps tensors to tensors (and
scalar metrics), so each is tested on tiny hand-computed inputs. Where verl has the
algorithm (`verl.trainer.ppo.core_algos`, `verl.trainer.ppo.rollout_corr_helper`) these
functions call it; what they add is rolltap's conventions: a replica logprob of 0.0 at
masked tokens, rows without replica logprobs (`has_rollout_log_probs`), and padding rows.

Shapes: B rows, R response tokens (the layout of `trainer/batch.py`).

    token_level_rewards, response_mask, values   (B, R)
    index (the GRPO group, `uid`)                 (B,) numpy object array
    old_log_prob, log_prob, ref_log_prob          (B, R) float, 0 where not a response token
    rollout_log_prob                              (B, R) float, the replica's logprobs
    advantages, returns, rollout_is_weights       (B, R)

`policy_loss_config(...)` builds the verl `ActorConfig` that both `policy_loss` here and the
engine's loss (`verl.workers.utils.losses.ppo_loss`, run by `trainer/update.py`) read, so
the loss a test checks by hand is the loss the engine backpropagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from verl.workers.config import ActorConfig

__all__ = [
    "ADV_ESTIMATORS",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "TIE_TOLERANCE",
    "AttemptAdvantages",
    "attempt_advantages",
    "compute_advantages",
    "kl_penalty",
    "logprob_mismatch",
    "masked_mean",
    "policy_loss",
    "policy_loss_config",
    "rollout_is_weights",
]

ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
KL_TYPES: tuple[str, ...] = ("low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2", "low_var_kl+", "k3+")
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is set (0 when nothing is): a scalar tensor."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def compute_advantages(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, R) and zero outside `response_mask`, by verl's estimator.

    - `grpo`: the row's total reward minus its group's mean, over the group's std
      (Dr. GRPO without the division when `norm_adv_by_std_in_grpo` is false); a group of
      one gets its reward as advantage (mean 0, std 1 by verl's convention).
    - `rloo`: reward minus the mean of the *other* members of its group.
    - `reinforce_plus_plus`: discounted return-to-go (`gamma`), whitened over the batch.
    - `reinforce_plus_plus_baseline`: reward minus group mean, whitened over the batch.
    - `gae`: needs a critic's `values` (B, R); `gamma`, `lam`; advantages whitened.
    """
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADV_ESTIMATORS}")
    # float64 stays float64 (`attempt_advantages`): float32 would tie large rewards a little apart.
    rewards = token_level_rewards if token_level_rewards.dtype == torch.float64 else token_level_rewards.float()
    mask = response_mask.to(rewards.dtype)
    if estimator == "gae":
        if values is None:
            raise ValueError("advantage estimator 'gae' needs a critic's value tensor (values=...)")
        if values.shape != rewards.shape:
            raise ValueError(f"values {tuple(values.shape)} must match rewards {tuple(rewards.shape)}")
        adv, ret = core_algos.compute_gae_advantage_return(
            token_level_rewards=rewards, values=values.float(), response_mask=mask, gamma=gamma, lam=lam
        )
        return adv * mask, ret * mask
    fn = core_algos.get_adv_estimator_fn(estimator)  # type: ignore[no-untyped-call]
    config = AlgoConfig(gamma=gamma, lam=lam, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "config": config}
    if estimator != "reinforce_plus_plus":
        kwargs.update(index=index, epsilon=epsilon)
    if estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    adv, ret = fn(**kwargs)
    return adv * mask, ret * mask


# Returns closer than this tie: verl divides by (std + 1e-6), so a smaller spread is float noise scaled up.
TIE_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class AttemptAdvantages:
    """Per attempt (N,): its advantage and whether its group tied; per group: size, mean, std of its returns."""

    advantages: list[float]
    is_tied: list[bool]
    group_stats: dict[str, tuple[int, float, float]]  # group -> (size, mean, unbiased std; 0 for one member)

    @property
    def tied_groups(self) -> int:
        return sum(1 for n, _, std in self.group_stats.values() if n < 2 or std == 0.0)


def attempt_advantages(
    estimator: str,
    returns: Sequence[float],
    groups: Sequence[str],
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AttemptAdvantages:
    """One advantage per *attempt*: verl's estimator over the attempts' returns, each attempt once.

    `returns` (N,) holds one number per attempt and `groups` (N,) its group. verl's
    estimator runs on a (N, 1) reward tensor with `index = groups`, so an attempt counts
    once in its group's mean and std however many triplets it has (the credit rule then
    spreads the attempt's advantage over its triplets, `trainer.credit.spread`). A *tied*
    group (returns within `TIE_TOLERANCE` of each other, or a single member) gets exactly
    0.0: its std is ~0, and (R - mean) / (std + eps) would turn float rounding into a signal. `gae` has no
    per-attempt form (it needs per-token values) and is refused here.
    """
    if estimator == "gae":
        raise ValueError("advantage estimator 'gae' is per token (a critic's values), not per attempt")
    if len(returns) != len(groups):
        raise ValueError(f"{len(returns)} returns for {len(groups)} group ids")
    if not returns:
        return AttemptAdvantages([], [], {})
    by_group: dict[str, list[float]] = {}
    for r, g in zip(returns, groups, strict=True):
        by_group.setdefault(g, []).append(float(r))
    stats: dict[str, tuple[int, float, float]] = {}
    for g, values in by_group.items():
        n, mean = len(values), float(np.mean(values))
        tied = n < 2 or max(values) - min(values) <= TIE_TOLERANCE
        stats[g] = (n, mean, 0.0 if tied else float(np.std(values, ddof=1)))
    index = np.empty(len(groups), dtype=object)
    index[:] = list(groups)
    # float64: large rewards (up to `proxy.limits.max_abs_reward`) a little apart are a tie in
    # float32, and their squares overflow it sooner; N numbers, so the cost is nil.
    rewards = torch.tensor([[float(r)] for r in returns], dtype=torch.float64)
    adv, _ = compute_advantages(
        estimator,
        token_level_rewards=rewards,
        response_mask=torch.ones_like(rewards),
        index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )
    is_tied = [stats[g][0] < 2 or stats[g][2] == 0.0 for g in groups]
    values = [0.0 if tied else float(a) for a, tied in zip(adv[:, 0].tolist(), is_tied, strict=True)]
    return AttemptAdvantages(values, is_tied, stats)


def policy_loss_config(
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
    mini_batch_size: int = 1,
    micro_batch_size: int = 1,
) -> ActorConfig:
    """The verl `ActorConfig` holding the loss knobs (`kl_coef > 0` turns the KL loss on)."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; expected one of {KL_TYPES}")
    return ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=mini_batch_size,
        ppo_micro_batch_size_per_gpu=micro_batch_size,
        clip_ratio=clip_ratio_low,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        use_kl_loss=kl_coef > 0,
        kl_loss_coef=kl_coef,
        kl_loss_type=kl_type,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (dual-clip for negative advantages), aggregated by `config.loss_agg_mode`.

    Per token, with r = exp(log_prob - old_log_prob) and A the advantage:
    `max(-A r, -A clip(r, 1 - low, 1 + high))`, capped at `-A clip_ratio_c` when A < 0,
    times the truncated IS weight when given. Returns (loss, metrics): `pg_clipfrac`
    (tokens where the clip is active), `pg_clipfrac_lower` (where the dual clip is),
    `ppo_kl` (the approximate KL mean(old_log_prob - log_prob)).
    """
    from verl.trainer.ppo import core_algos

    config.global_batch_info.clear()  # local aggregation: this batch is the whole batch
    loss, metrics = core_algos.get_policy_loss_fn("vanilla")(  # type: ignore[no-untyped-call]
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask.bool(),
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    return loss, {k.removeprefix("actor/"): float(v) for k, v in metrics.items()}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (B, R).

    `kl`/`k1`: log_prob - ref; `mse`/`k2`: (log_prob - ref)^2 / 2; `low_var_kl`/`k3`:
    exp(ref - log_prob) - (ref - log_prob) - 1, clamped to [-10, 10]; a trailing `+`
    keeps that value but takes k2's gradient (unbiased).
    """
    from verl.trainer.ppo import core_algos

    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; expected one of {KL_TYPES}")
    out: torch.Tensor = core_algos.kl_penalty(
        cast(torch.FloatTensor, log_prob), cast(torch.FloatTensor, ref_log_prob), kl_type
    )
    return out


def _usable(response_mask: torch.Tensor, has_rollout_log_probs: torch.Tensor | None) -> torch.Tensor:
    """(B, R) bool: response tokens of rows that carry replica logprobs."""
    mask = response_mask.bool()
    if has_rollout_log_probs is not None:
        mask = mask & has_rollout_log_probs.bool().unsqueeze(-1)
    return mask


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    has_rollout_log_probs: torch.Tensor | None = None,
    *,
    level: Literal["token", "sequence"] = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights pi_train / pi_replica (B, R), verl's TIS.

    `token`: per token exp(old - rollout) clamped to at most `threshold`; `sequence`: one
    weight per row, exp(sum of the row's log ratios), clamped. Rows without replica
    logprobs get weight 1 (nothing to correct with); masked tokens get 0. Metrics:
    `is_weight_mean` (over weighted tokens), `is_clip_frac` (tokens whose raw weight
    exceeded the threshold).
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    usable = _usable(response_mask, has_rollout_log_probs)
    mask = response_mask.to(old_log_prob.dtype)
    # Where the replica gave nothing, pretend it agreed with the trainer: log ratio 0, weight 1.
    log_ratio = torch.where(usable, old_log_prob - rollout_log_prob, torch.zeros_like(old_log_prob))
    weights, _ = compute_rollout_correction_weights(
        log_ratio=log_ratio, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold
    )
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
    else:
        raw = torch.exp((log_ratio * mask).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(log_ratio)
    metrics = {
        "is_weight_mean": float(masked_mean(weights, mask)),
        "is_clip_frac": float(masked_mean((raw > threshold).to(mask.dtype), usable)),
    }
    return weights * mask, metrics


def logprob_mismatch(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    has_rollout_log_probs: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the trainer's logprobs are from the replica's on the same tokens.

    Over response tokens of rows with replica logprobs: `abs_diff_mean`, `abs_diff_max`,
    `kl` (mean(rollout - old), an estimate of KL(replica || trainer)), `k3_kl` (verl's
    low-variance estimate), `tokens` (how many tokens were compared). Empty when no row
    carries replica logprobs.
    """
    usable = _usable(response_mask, has_rollout_log_probs)
    n = int(usable.sum())
    if n == 0:
        return {}
    diff = (old_log_prob - rollout_log_prob)[usable]
    return {
        "abs_diff_mean": float(diff.abs().mean()),
        "abs_diff_max": float(diff.abs().max()),
        "kl": float((-diff).mean()),
        "k3_kl": float((torch.exp(diff.clamp(-20.0, 20.0)) - diff - 1).mean()),
        "tokens": float(n),
    }
