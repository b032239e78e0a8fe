"""A temperature-0.7 agent: the trainer's recomputed logprobs match the real CPU replica's recorded ones.

The replica runs with `--logprobs-mode processed_logprobs` (as `tools.replica` starts it), so
the logprobs it returns are those of the distribution it sampled from. The trainer recomputes
each row at the temperature in the call's recorded request; recomputing at 1.0 (what it did
before) is far off.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shared.settings import TrainerSettings
from trainer import algos
from trainer.batch import build_batch
from trainer.data import build_samples
from trainer.records import AttemptRow, CallRow, Group, RewardRow
from trainer.update import PolicyUpdater

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning"),
    pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning"),
]

TEMPERATURE = 0.7
PROMPTS = ["Write about the sea.", "Say something about trees.", "Tell me about cheese.", "The weekend is"]


def sampled_call(http: httpx.Client, url: str, model: str, i: int) -> CallRow:
    request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i]}],
                               "max_tokens": 16, "temperature": TEMPERATURE, "logprobs": True,
                               "return_token_ids": True, "seed": i}
    body = http.post(f"{url}/v1/chat/completions", json=request).raise_for_status().json()
    choice = body["choices"][0]
    return CallRow(
        call_id=f"c{i}", seq=0, route="chat/completions", status="ok", prompt_token_ids=body["prompt_token_ids"],
        completion_token_ids=choice["token_ids"],
        completion_logprobs=[t["logprob"] for t in choice["logprobs"]["content"]], policy_version=0,
        request=request, rollout_id="t", attempt_id=str(i),
    )


def test_recomputed_logprobs_at_the_sampling_temperature_match_the_replica(
        vllm_replica: Any, tiny_model_dir: Path) -> None:
    with httpx.Client(timeout=120) as http:
        calls = [sampled_call(http, vllm_replica.url, vllm_replica.served_model_name, i) for i in range(4)]
    attempts = [AttemptRow(i, "t", str(i), "t", "succeeded", 0, datetime.now(UTC), rewards=[RewardRow(float(i), "final")], calls=[c]) for i, c in enumerate(calls)]
    data = build_samples([Group("t", attempts, True)], TrainerSettings())
    batch = build_batch(data.samples, mini_batch_size=4)
    assert batch.tensors["temperature"].tolist() == pytest.approx([TEMPERATURE] * 4)
    updater = PolicyUpdater(tiny_model_dir, TrainerSettings(mini_batch_size=4, micro_batch_size=2, lora_rank=8))
    try:
        ours = updater.log_probs(batch)
        batch.tensors["temperature"] = torch.ones(4)  # the old behaviour: every row at 1.0
        at_one = updater.log_probs(batch)
    finally:
        updater.close()
    t = batch.tensors
    good = algos.logprob_mismatch(ours, t["rollout_log_probs"], t["response_mask"], t["has_rollout_log_probs"])
    bug = algos.logprob_mismatch(at_one, t["rollout_log_probs"], t["response_mask"], t["has_rollout_log_probs"])
    print(f"\nmean |trainer - replica| logprob at T={TEMPERATURE}: {good['abs_diff_mean']:.6f} "
          f"(max {good['abs_diff_max']:.6f}); recomputed at 1.0: {bug['abs_diff_mean']:.6f} over "
          f"{good['tokens']:.0f} tokens")
    assert good["abs_diff_mean"] < 1e-3
    assert bug["abs_diff_mean"] > 20 * good["abs_diff_mean"]
