"""Credit assignment: how an attempt's rewards become one reward per turn.

Pure functions over plain lists; no database, no torch. The attempt's units of credit
are given in order (oldest first) as the `seq` numbers of the calls each one holds;
`trainer.data` passes one unit per call (a turn), so a row that merges several calls
gets a share per turn. The docstrings below say "triplet" for such a unit.

Advantages are per attempt (`trainer.algos.attempt_advantages`: each attempt counts once
in its group's statistics, whatever its number of triplets); `attempt_return` is the
number those statistics see and `spread` hands the attempt's advantage to its triplets
by the same rule that spread its reward:

- `identical`: the attempt's advantage on every triplet;
- `last_only`: on the last triplet, 0 on the others;
- `discounted`: `A * gamma**k` on the triplet k steps before the last;
- `per_call`: the attempt's return is the sum of its per-call credits, and each triplet
  gets `A * G_t / R`, its reward-to-go `G_t` as a share of the return `R` (all of `A` on
  every triplet when `R` is 0: there is nothing to apportion).

Final reward of an attempt (`final_reward`): the value of the reward named "final"
(what `finish` with a reward stores; the latest one if posted twice, so a correction
wins); without one, the sum of all the attempt's rewards (several posted rewards are
read as parts of one return, e.g. shaping terms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from trainer.records import RewardRow

__all__ = [
    "CreditMode",
    "assign_credit",
    "attempt_return",
    "discounted",
    "final_reward",
    "identical",
    "last_only",
    "per_call",
    "spread",
]

CreditMode = Literal["identical", "last_only", "discounted", "per_call"]
FINAL = "final"


def final_reward(rewards: Sequence[RewardRow]) -> float | None:
    """The attempt's reward: the last one named "final", else the sum of all; None without rewards."""
    finals = [r.value for r in rewards if r.name == FINAL]
    if finals:
        return float(finals[-1])
    if not rewards:
        return None
    return float(sum(r.value for r in rewards))


def identical(final: float, num_triplets: int) -> list[float]:
    """The final reward on every triplet (the default; what single-turn GRPO does per sample)."""
    return [final] * num_triplets


def last_only(final: float, num_triplets: int) -> list[float]:
    """The final reward on the last triplet, 0 on the others."""
    return [0.0] * (num_triplets - 1) + [final] if num_triplets else []


def discounted(final: float, num_triplets: int, gamma: float) -> list[float]:
    """`final * gamma**k` on the triplet k steps before the last (the last gets `final`)."""
    return [final * gamma ** (num_triplets - 1 - i) for i in range(num_triplets)]


def per_call(
    triplet_seqs: Sequence[Sequence[int]],
    rewards: Sequence[RewardRow],
    call_seq: Mapping[str, int],
) -> list[float]:
    """Rewards posted with a `call_id` go to the triplet holding that call (summed).

    A reward aimed at a call that is in no triplet (dropped) goes to the first triplet
    that ends at or after that call, else to the last: the credit is kept, not lost.
    Rewards without a `call_id` are reduced like `final_reward` and go to the last triplet.
    A `call_id` unknown in the attempt is treated as a reward without one.
    """
    n = len(triplet_seqs)
    out = [0.0] * n
    if not n:
        return out
    where = {seq: i for i, seqs in enumerate(triplet_seqs) for seq in seqs}
    ends = [max(seqs) for seqs in triplet_seqs]
    unaimed: list[RewardRow] = []
    for r in rewards:
        seq = call_seq.get(r.call_id) if r.call_id is not None else None
        if seq is None:
            unaimed.append(r)
            continue
        i = where.get(seq)
        if i is None:
            i = next((k for k, end in enumerate(ends) if end >= seq), n - 1)
        out[i] += r.value
    rest = final_reward(unaimed)
    if rest is not None:
        out[-1] += rest
    return out


def assign_credit(
    mode: CreditMode,
    triplet_seqs: Sequence[Sequence[int]],
    rewards: Sequence[RewardRow],
    call_seq: Mapping[str, int] | None = None,
    gamma: float = 1.0,
) -> list[float]:
    """One reward per triplet of one attempt, by `mode`."""
    n = len(triplet_seqs)
    if mode == "per_call":
        return per_call(triplet_seqs, rewards, call_seq or {})
    final = final_reward(rewards)
    if final is None:
        raise ValueError("attempt has no reward: the reader only selects rewarded attempts")
    if mode == "identical":
        return identical(final, n)
    if mode == "last_only":
        return last_only(final, n)
    if mode == "discounted":
        return discounted(final, n, gamma)
    raise ValueError(f"unknown credit mode {mode!r}")


def attempt_return(mode: CreditMode, rewards: Sequence[RewardRow], call_seq: Mapping[str, int] | None = None) -> float:
    """The one number an attempt contributes to its group's statistics.

    The final reward (`final_reward`) in every mode but `per_call`, where it is the sum of
    the per-call credits the attempt would get as a single triplet: every reward aimed at
    a call counts once, plus the unaimed ones reduced like `final_reward`.
    """
    if mode == "per_call":
        seqs = sorted((call_seq or {}).values()) or [0]
        return float(sum(per_call([seqs], rewards, call_seq or {})))
    final = final_reward(rewards)
    if final is None:
        raise ValueError("attempt has no reward: the reader only selects rewarded attempts")
    return final


def spread(mode: CreditMode, advantage: float, credits: Sequence[float], gamma: float = 1.0) -> list[float]:
    """The attempt's `advantage` over its triplets (oldest first) by `mode`; see the module docstring.

    `credits` are the triplets' rewards from `assign_credit` (read by `per_call` only);
    an advantage of exactly 0.0 (a tied group) stays exactly 0.0 on every triplet.
    """
    n = len(credits)
    if mode == "identical":
        return [advantage] * n
    if mode == "last_only":
        return last_only(advantage, n)
    if mode == "discounted":
        return discounted(advantage, n, gamma)
    if mode == "per_call":
        total = float(sum(credits))
        if total == 0.0:
            return [advantage] * n
        to_go = [float(sum(credits[i:])) for i in range(n)]
        return [advantage * g / total for g in to_go]
    raise ValueError(f"unknown credit mode {mode!r}")
