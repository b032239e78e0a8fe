"""A small hand-made training batch for the update tests, and logprobs computed by plain transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.batch import Batch, build_batch
from trainer.data import Sample
from trainer.trajectory import Triplet

# (group, reward, prompt, response, response_mask, replica logprobs recorded?)
ROWS: list[tuple[str, float, list[int], list[int], list[int], bool]] = [
    ("g1", 1.0, [5, 6, 7], [10, 11, 12], [1, 1, 1], True),
    ("g1", 0.0, [5, 6, 7], [20, 21, 30, 22, 23], [1, 1, 0, 1, 1], True),  # token 30: a tool result
    ("g2", 0.5, [8, 9], [30, 31], [1, 1], False),  # re-tokenised: no replica logprobs
    ("g2", -0.5, [8, 9, 9, 9], [40], [1], True),
]
# GRPO's sign of each row's advantage (reward above or below its group's mean).
ADVANTAGE_SIGNS = [1, -1, 1, -1]


def hf_log_probs(model: Any, batch: Batch) -> torch.Tensor:
    """(B, R) logprobs of the batch's response tokens by a transformers/PEFT model, 0 past each response."""
    t = batch.tensors
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                       position_ids=t["position_ids"]).logits
    width = t["prompts"].shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1)
    return logp.gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1) * t["attention_mask"][:, width:]


def base_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def policy_batch(model_dir: Path, *, copies: int = 1, mini_batch_size: int = 4) -> Batch:
    """`ROWS` (repeated `copies` times, each copy its own groups) as a batch whose replica logprobs
    are the base model's own (0 at masked tokens), as a replica serving the base model records them."""
    samples: list[Sample] = []
    for c in range(copies):
        for i, (group, reward, prompt, response, mask, has_lp) in enumerate(ROWS):
            triplet = Triplet(prompt_ids=prompt, response_ids=response, response_mask=mask,
                              response_logprobs=[0.0] * len(response) if has_lp else None)
            samples.append(Sample(triplet=triplet, group_id=f"{group}-{c}", rollout_id=f"{group}-{c}",
                                  attempt_id=str(i), attempt_pk=c * len(ROWS) + i, index=0,
                                  reward=reward, final_reward=reward))
    batch = build_batch(samples, mini_batch_size=mini_batch_size)
    replica = hf_log_probs(base_model(model_dir), batch) * batch.tensors["response_mask"]
    batch.tensors["rollout_log_probs"] = replica * batch.tensors["has_rollout_log_probs"].unsqueeze(-1)
    return batch
