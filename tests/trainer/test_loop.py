"""The training loop: exactly-once consumption across kills, and a first update on proxy-recorded data."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shared.db.engine import sync_url
from shared.db.models import Attempt, TrainingStep, TrainingStepAttempt
from tests.conftest import ProxyFactory
from tests.trainer.wandb_files import read_wandb_history

pytestmark = [
    pytest.mark.vllm,
    # verl's engine package warns at import that optional backends (megatron, ...) are absent.
    pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning"),
    # verl 0.9.1 imports ray.experimental.state, which Ray 2.60 deprecates.
    pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning"),
]

GROUPS, GROUP_SIZE = 6, 4
TRAINER = str(Path(sys.executable).parent / "rolltap-trainer")


def _record_attempts(proxy_url: str) -> None:
    """GROUPS tasks x GROUP_SIZE attempts through the proxy from the real vLLM replica, rewarded."""
    def attempt(job: tuple[int, int]) -> None:
        g, k = job
        with httpx.Client(timeout=120) as http:
            base = f"{proxy_url}/rollout/task-{g}/attempt/{k}/v1"
            r = http.post(f"{base}/chat/completions", json={
                "model": "x", "messages": [{"role": "user", "content": f"task {g}: say e"}], "max_tokens": 8})
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"]
            http.post(f"{proxy_url}/rollout/task-{g}/attempt/{k}/finish",
                      json={"status": "succeeded", "reward": text.count("e") / max(1, len(text))}).raise_for_status()

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(attempt, [(g, k) for g in range(GROUPS) for k in range(GROUP_SIZE)]))


def _trainer(config: Path, crash_at: str | None, extra_env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLTAP_CONFIG": str(config), **(extra_env or {})}
    env.pop("ROLLTAP_TRAINER_CRASH_AT", None)
    if crash_at:
        env["ROLLTAP_TRAINER_CRASH_AT"] = crash_at
    return subprocess.run([TRAINER, "--log-level", "info", "run", "--no-push"], env=env, capture_output=True,
                          text=True, timeout=600)


def _consumption(db_url: str) -> tuple[list[int], dict[int, int], set[int]]:
    engine = create_engine(sync_url(db_url))
    with engine.connect() as conn:
        steps = list(conn.execute(select(TrainingStep.step).order_by(TrainingStep.step)).scalars())
        consumed = dict(conn.execute(select(TrainingStepAttempt.attempt_pk, TrainingStepAttempt.step)).all())
        attempts = set(conn.execute(select(Attempt.id)).scalars())
    engine.dispose()
    return steps, consumed, attempts


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_killed_trainer_resumes_without_repeating_or_skipping(vllm_replica: Any, proxy_for: ProxyFactory,
                                                              db_url: str, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        _record_attempts(proxy.url)
    config = tmp_path / "trainer.toml"
    config.write_text(
        f'[db]\nurl = "{db_url}"\n\n[trainer]\nmodel = "{tiny_model_dir}"\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n'
        f"max_steps = 3\ngroup_size = {GROUP_SIZE}\ngroups_per_step = 2\nmini_batch_size = 8\n"
        "micro_batch_size = 4\nlr = 0.001\n"
    )
    # 1. Killed after step 2's checkpoint was written but before it committed.
    first = _trainer(config, "before_commit:2")
    assert first.returncode == 137, first.stderr[-3000:]
    steps, consumed, attempts = _consumption(db_url)
    assert steps == [1] and len(consumed) == 2 * GROUP_SIZE
    assert (tmp_path / "ckpt" / "step_00000002").is_dir()  # the uncommitted checkpoint exists ...

    # 2. Restarted: resumes from step 1 (not the newer, uncommitted checkpoint); killed right after committing 2.
    second = _trainer(config, "after_commit:2")
    assert second.returncode == 137, second.stderr[-3000:]
    assert "resumed at committed step 1" in second.stderr
    steps, consumed, _ = _consumption(db_url)
    assert steps == [1, 2] and len(consumed) == 4 * GROUP_SIZE

    # 3. Restarted again: resumes at 2, trains step 3 and stops at max_steps; TensorBoard and W&B (offline) on.
    trackers = {"ROLLTAP_TRAINER__TENSORBOARD_DIR": str(tmp_path / "tb"), "ROLLTAP_TRAINER__WANDB_PROJECT": "rolltap",
                "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    third = _trainer(config, None, trackers)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed at committed step 2" in third.stderr
    assert "step 3/3" in third.stdout
    steps, consumed, attempts = _consumption(db_url)
    assert steps == [1, 2, 3]
    assert set(consumed) == attempts  # every attempt consumed (none skipped) ...
    assert sorted(list(consumed.values()).count(s) for s in (1, 2, 3)) == [8, 8, 8]  # ... by exactly one step

    # The step's row holds its metrics, completed after the commit (step_time_s is known only then), and
    # both trackers got the same numbers for step 3.
    engine = create_engine(sync_url(db_url))
    with engine.connect() as conn:
        metrics = conn.execute(select(TrainingStep.metrics).where(TrainingStep.step == 3)).scalar_one()
    engine.dispose()
    assert metrics["step_time_s"] > 0 and math.isfinite(metrics["loss"])
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    (event,) = accumulator.Scalars("rolltap/loss")
    assert event.step == 3 and event.value == pytest.approx(metrics["loss"], rel=1e-6)
    (history,) = read_wandb_history(tmp_path / "wandb")
    assert history["_step"] == 3 and history["rolltap/loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    assert history["rolltap/step_time_s"] == pytest.approx(metrics["step_time_s"])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("lora_rank", [8, 0], ids=["lora", "full"])
def test_one_update_on_recorded_attempts(vllm_replica: Any, proxy_for: ProxyFactory, db_url: str,
                                         tiny_model_dir: Path, lora_rank: int) -> None:
    """Attempts recorded through the proxy from a real replica -> batch -> one verl update."""
    import torch

    from shared.db.engine import create_sync_db
    from shared.settings import DbSettings, TrainerSettings
    from trainer.batch import build_batch
    from trainer.data import read_samples
    from trainer.update import PolicyUpdater

    with proxy_for([vllm_replica.url]) as proxy:
        _record_attempts(proxy.url)
    settings = TrainerSettings(model=str(tiny_model_dir), group_size=GROUP_SIZE, mini_batch_size=8,
                               micro_batch_size=4, lr=2e-3 if lora_rank else 1e-4, lora_rank=lora_rank)
    engine = create_sync_db(DbSettings(url=db_url))
    data = read_samples(engine, settings, max_groups=2)
    engine.dispose()
    assert len(data.samples) == 8 and not data.drops
    batch = build_batch(data.samples, mini_batch_size=8)
    # The replica's own logprobs came along for off-policy correction.
    assert bool(batch.tensors["has_rollout_log_probs"].all())
    rewards = torch.tensor([s.final_reward for s in data.samples])
    groups = [s.group_id for s in data.samples]
    mean = {g: rewards[[i for i, x in enumerate(groups) if x == g]].mean() for g in set(groups)}
    advantage = torch.stack([rewards[i] - mean[g] for i, g in enumerate(groups)])
    mask = batch.tensors["response_mask"].float()

    with PolicyUpdater(tiny_model_dir, settings) as updater:
        before = updater.log_probs(batch)
        # The trainer's logprobs of the replica's tokens match what the replica reported.
        mismatch = ((before - batch.tensors["rollout_log_probs"]).abs() * mask).sum() / mask.sum()
        assert mismatch < 1e-3
        metrics = updater.update(batch)
        after = updater.log_probs(batch)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    # Token-level: generated tokens of positive-advantage rows became likelier, of negative ones less so.
    delta = (after - before) * mask
    positive, negative = advantage > 0, advantage < 0
    assert delta[positive].sum() / mask[positive].sum() > 0, (delta.sum(1), advantage)
    assert delta[negative].sum() / mask[negative].sum() < 0, (delta.sum(1), advantage)
    # And row by row for the clearest cases: the best and the worst attempt of each group.
    for g in set(groups):
        rows = [i for i, x in enumerate(groups) if x == g]
        best, worst = max(rows, key=lambda i: advantage[i]), min(rows, key=lambda i: advantage[i])
        assert delta[best].sum() > 0 > delta[worst].sum(), (g, delta.sum(1), advantage)
