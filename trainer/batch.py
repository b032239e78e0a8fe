"""Samples to a training batch in verl's layout (the keys `verl.trainer.ppo` reads).

This module owns padding and the batch's shape; it computes no advantages or losses
(those are verl's `core_algos`). Shapes, with B rows, P the longest prompt, R the
longest response in the batch:

    prompts            (B, P)    int64  left-padded with `pad_token_id`
    responses          (B, R)    int64  right-padded
    input_ids          (B, P+R)  int64  prompts ++ responses
    attention_mask     (B, P+R)  int64  1 on every real token (masked turns included)
    position_ids       (B, P+R)  int64  0.. over real tokens (cumsum of attention_mask - 1)
    response_mask      (B, R)    int64  1 on generated tokens only: what the loss sees
    token_level_scores (B, R)    float32  the row's reward (`Sample.reward`) on its last response token
    token_level_rewards(B, R)    float32  same (a KL-in-reward step would subtract from it)
    advantages         (B, R)    float32  each turn's advantage (`Sample.turn_advantages`) on its generated tokens;
                                          absent when any sample has none (the update then computes them)
    temperature        (B,)      float32  the sampling temperature of the row (the update rescales logits by it)
    rollout_log_probs  (B, R)    float32  the replica's logprobs; 0 where masked or unknown
    has_rollout_log_probs (B,)   bool   False for re-tokenised triplets and padding rows
    is_pad             (B,)      bool   rows added to round the batch
  non-tensor (numpy object arrays): uid (= group id), rollout_id, attempt_id, policy_version

Rounding to a multiple of `mini_batch_size`: `pad` (default) appends copies of real
rows with an all-zero `response_mask` and zero reward, each with its own uid, so they
add nothing to the loss nor to any group's GRPO statistics while keeping realistic
lengths for micro-batching; `drop` removes the last rows instead (their attempts stay
consumed by the step: use it only when losing a few rows is acceptable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from trainer.data import Sample

if TYPE_CHECKING:
    from verl import DataProto

__all__ = ["Batch", "build_batch", "round_rows"]

PAD_UID = "__pad__"


@dataclass(slots=True)
class Batch:
    """A batch as plain tensors (usable without verl) and, on demand, as a `verl.DataProto`."""

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tensors["responses"].shape[0])

    def to_dataproto(self) -> DataProto:
        """The same data as a `verl.DataProto` (raises ImportError without verl)."""
        from verl import DataProto

        proto: DataProto = DataProto.from_dict(
            tensors=dict(self.tensors), non_tensors=dict(self.non_tensors), meta_info=dict(self.meta_info)
        )
        return proto


def round_rows(num_rows: int, mini_batch_size: int, mode: Literal["pad", "drop"]) -> int:
    """How many rows a batch of `num_rows` has after rounding to a multiple of `mini_batch_size`."""
    if mode == "pad":
        return -(-num_rows // mini_batch_size) * mini_batch_size
    rows = num_rows // mini_batch_size * mini_batch_size
    if rows == 0:
        raise ValueError(f"batch_round=drop: {num_rows} rows is fewer than one mini-batch ({mini_batch_size})")
    return rows


def build_batch(
    samples: Sequence[Sample],
    *,
    mini_batch_size: int = 1,
    batch_round: Literal["pad", "drop"] = "pad",
    pad_token_id: int = 0,
) -> Batch:
    """Pad `samples` into verl's layout; see the module docstring for shapes and rounding."""
    if not samples:
        raise ValueError("no samples to batch")
    rows = round_rows(len(samples), mini_batch_size, batch_round)
    real = list(samples[:rows])
    # Padding rows repeat real rows cyclically (realistic lengths), flagged and neutralised below.
    chosen = real + [real[i % len(real)] for i in range(rows - len(real))]

    p_len = max(len(s.triplet.prompt_ids) for s in chosen)
    r_len = max(len(s.triplet.response_ids) for s in chosen)
    # Filled as numpy arrays (slice assignment from lists is ~10x faster than torch.tensor(list)),
    # handed to torch without a copy.
    prompts = np.full((rows, p_len), pad_token_id, dtype=np.int64)
    responses = np.full((rows, r_len), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((rows, p_len + r_len), dtype=np.int64)
    response_mask = np.zeros((rows, r_len), dtype=np.int64)
    scores = np.zeros((rows, r_len), dtype=np.float32)
    advantages = np.zeros((rows, r_len), dtype=np.float32)
    temperature = np.ones(rows, dtype=np.float32)
    logprobs = np.zeros((rows, r_len), dtype=np.float32)
    has_logprobs = np.zeros(rows, dtype=np.bool_)
    pad_flags = [i >= len(real) for i in range(rows)]

    for i, s in enumerate(chosen):
        t = s.triplet
        n_p, n_r = len(t.prompt_ids), len(t.response_ids)
        prompts[i, p_len - n_p :] = t.prompt_ids
        responses[i, :n_r] = t.response_ids
        attention_mask[i, p_len - n_p : p_len + n_r] = 1
        temperature[i] = t.temperature
        if pad_flags[i]:
            continue  # no loss, no reward, no logprobs
        response_mask[i, :n_r] = t.response_mask
        # The row's reward on its last token (always generated: a triplet ends with a completion):
        # verl's outcome estimators and GAE sum a row's token rewards, so per-turn credit lives in
        # the advantages below, each turn's share on its own generated tokens (glue has mask 0).
        scores[i, n_r - 1] = s.reward
        starts, ends = [0, *t.turn_ends[:-1]], t.turn_ends or [n_r]
        if s.advantage is not None:
            shares = s.turn_advantages or [s.advantage] * len(ends)
            mask_i = np.asarray(t.response_mask, dtype=np.float32)
            for a, b, share in zip(starts, ends, shares, strict=True):
                advantages[i, a:b] = mask_i[a:b] * np.float32(share)
        if t.response_logprobs is not None:
            logprobs[i, :n_r] = t.response_logprobs
            has_logprobs[i] = True

    attention = torch.from_numpy(attention_mask)
    prompts_t, responses_t = torch.from_numpy(prompts), torch.from_numpy(responses)
    scores_t = torch.from_numpy(scores)
    tensors = {
        "prompts": prompts_t,
        "responses": responses_t,
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": torch.from_numpy(response_mask),
        "token_level_scores": scores_t,
        "token_level_rewards": scores_t.clone(),
        "temperature": torch.from_numpy(temperature),
        "rollout_log_probs": torch.from_numpy(logprobs),
        "has_rollout_log_probs": torch.from_numpy(has_logprobs),
        "is_pad": torch.tensor(pad_flags, dtype=torch.bool),
    }

    def objects(values: list[Any]) -> np.ndarray:
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr

    if all(s.advantage is not None for s in real):
        tensors["advantages"] = torch.from_numpy(advantages)

    uids = [f"{PAD_UID}{i}" if pad_flags[i] else s.group_id for i, s in enumerate(chosen)]
    non_tensors = {
        "uid": objects(uids),
        "rollout_id": objects([s.rollout_id for s in chosen]),
        "attempt_id": objects([s.attempt_id for s in chosen]),
        "policy_version": objects([s.triplet.policy_version for s in chosen]),
    }
    meta = {"num_real_rows": len(real), "num_samples": len(samples)}
    return Batch(tensors, non_tensors, meta)
