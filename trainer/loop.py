"""The training loop: read groups -> build a batch -> verl update -> checkpoint -> commit -> push.

Reads top to bottom, one call per phase. Exactly-once consumption rests on one order:

1. update the policy in memory;
2. save the checkpoint of step N (atomic; model, optimizer, step);
3. export the policy of version N (LoRA adapter or full weights);
4. commit, in ONE transaction, the training step N, the attempts it consumed and the
   policy version N it produced: the commit point;
5. push version N to the replicas and make it the proxy's active policy.

A trainer killed anywhere restarts from the checkpoint of the last committed step (not
a newer one: its update used attempts that were never marked consumed), so attempts are
neither consumed twice (the primary key on the attempt forbids it anyway) nor skipped. A
committed version not yet active on the proxy is pushed again on restart.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from shared.db.engine import create_sync_db
from shared.db.migrate import upgrade
from shared.db.models import PolicyVersion, TrainingStep
from shared.settings import Settings
from trainer.batch import Batch, build_batch
from trainer.consumption import record_training_step
from trainer.data import DataRead, read_samples
from trainer.trajectory import Tokenizer
from trainer.transfer import Backend
from trainer.update import PolicyUpdater
from trainer.weights import WeightPusher, lora_name

__all__ = ["StepReport", "last_committed_step", "run_loop"]

logger = logging.getLogger(__name__)

CRASH_ENV = "ROLLTAP_TRAINER_CRASH_AT"  # fault injection for the kill-and-restart test: "phase:step"


@dataclass
class StepReport:
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)


def last_committed_step(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.max(TrainingStep.step), 0))).scalar_one())


def _crash_point(phase: str, step: int) -> None:
    """Die here, like a SIGKILL would, when the fault-injection variable names this point."""
    if os.environ.get(CRASH_ENV) == f"{phase}:{step}":
        logger.error("fault injection: exiting at %s of step %d", phase, step)
        os._exit(137)


def _wait_for_data(engine: Engine, settings: Settings, tokenizer: Tokenizer | None,
                   should_stop: Callable[[], bool]) -> DataRead | None:
    """Ready groups with samples: `min_groups_per_step` of them, or fewer once `step_wait_s` has passed."""
    ts = settings.trainer
    first_seen: float | None = None
    while not should_stop():
        data = read_samples(engine, ts, tokenizer=tokenizer, max_groups=ts.groups_per_step)
        if data.samples:
            first_seen = first_seen if first_seen is not None else time.monotonic()
            if len(data.groups) >= ts.min_groups_per_step or time.monotonic() - first_seen >= ts.step_wait_s:
                return data
        elif data.groups:
            # Every ready group was skipped (no triplet, or tied under dynamic sampling): the
            # next step that finds samples consumes them with its own; logged so that a queue
            # of such groups is visible.
            logger.info("%d ready group(s), none trainable: %s; drops %s", len(data.groups),
                        dict(data.skip_counts()), dict(data.drop_counts()))
        time.sleep(ts.poll_interval_s)
    return None


def _data_metrics(data: DataRead, settings: Settings) -> dict[str, Any]:
    ts = settings.trainer
    finals = [a_reward for a_reward in (_final(a) for g in data.groups for a in g.attempts) if a_reward is not None]
    versions = [a.policy_version for g in data.groups for a in g.attempts]
    current = data.current_version
    skipped = data.skip_counts()
    off_policy = sum(1 for s in data.samples if (s.triplet.policy_version or 0) < current)
    metrics: dict[str, Any] = {
        "groups": len(data.groups),
        "attempts": len(data.attempt_pks),
        "triplets": len(data.samples),
        "calls": data.num_calls,
        "dropped_calls": len(data.drops),
        "reward_mean": statistics.fmean(finals) if finals else None,
        "reward_std": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
        "staleness_max": max(current - v for v in versions) if versions else 0,
        # Tied groups (every attempt scored the same): advantage exactly 0 when trained on,
        # skipped and consumed under dynamic sampling.
        "tied_groups": data.tied_groups + skipped.get("tied", 0),
        "skipped_groups": sum(skipped.values()),
        "off_policy_rows": off_policy,
        # How rows sampled by an older policy are treated this step (reported even when there are none).
        "off_policy_correction": f"tis-{ts.rollout_is}" if ts.rollout_is != "off" else "none",
    }
    metrics.update({f"skipped/{k}": v for k, v in skipped.items()})
    metrics.update({f"drops/{k}": v for k, v in data.drop_counts().items()})
    return metrics


def _final(attempt: Any) -> float | None:
    from trainer.credit import final_reward

    value: float | None = final_reward(attempt.rewards)
    return value


def _commit(engine: Engine, step: int, data: DataRead, metrics: dict[str, Any], version: PolicyVersionRow) -> None:
    with engine.begin() as conn:
        record_training_step(conn, step=step, attempt_pks=data.attempt_pks, policy_version=version.version,
                             metrics=metrics)
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        conn.execute(dialect.insert(PolicyVersion).values(
            version=version.version, served_name=version.served_name, base_model=version.base_model,
            kind=version.kind, path=version.path, is_active=False,
        ).on_conflict_do_nothing(index_elements=["version"]))


def _complete_metrics(engine: Engine, step: int, metrics: dict[str, Any]) -> None:
    with engine.begin() as conn:
        conn.execute(update(TrainingStep).where(TrainingStep.step == step).values(metrics=metrics))


@dataclass
class PolicyVersionRow:
    version: int
    served_name: str
    base_model: str | None
    kind: str
    path: str


def _policy_row(settings: Settings, step: int, policy_dir: Path, base_name: str, adapter: bool) -> PolicyVersionRow:
    if adapter:
        return PolicyVersionRow(step, lora_name(step), base_name, "lora", str(policy_dir))
    return PolicyVersionRow(step, base_name, base_name, "full", str(policy_dir))


def _push(pusher: WeightPusher, row: PolicyVersionRow, updater: PolicyUpdater, transfer: str) -> dict[str, Any]:
    """`row` to every replica: an adapter, a folder to reload, or (`trainer.weight_transfer` ipc or shm) the
    updater's weights in memory, which are row's version's."""
    if row.kind == "lora":
        result = pusher.push_lora(row.version, Path(row.path), base_model=row.base_model)
    elif transfer == "disk":
        result = pusher.push_full(row.version, Path(row.path), served_name=row.served_name)
    else:
        backend: Backend = "ipc" if transfer == "ipc" else "shm"
        result = pusher.push_full_in_memory(row.version, served_name=row.served_name, path=row.path,
                                            stage=lambda: updater.stage_weights(backend),
                                            release=updater.release_weights)
    return {"push_s": result.seconds, "pushed": len(result.pushed), "drained": len(result.drained)}


def run_loop(
    settings: Settings,
    *,
    tokenizer: Tokenizer | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[StepReport]:
    """Train until `trainer.max_steps` (or `should_stop()`); returns this run's step reports."""
    ts = settings.trainer
    if ts.model is None:
        raise ValueError("trainer.model: the policy's local model directory is required")
    if ts.checkpoint_dir is None:
        raise ValueError("trainer.checkpoint_dir is required: a restarted trainer resumes from it")
    logger.info("trainer settings: %s", ts.model_dump_json(exclude={"admin_token"}))
    if settings.db.migrate_on_start:
        upgrade(settings.db)
    engine = create_sync_db(settings.db)
    run_dir = Path(ts.run_dir or Path(ts.checkpoint_dir) / "policies").resolve()
    reports: list[StepReport] = []
    pusher = _pusher(settings)
    updater = PolicyUpdater(ts.model, ts)
    try:
        _resume(engine, updater, Path(ts.checkpoint_dir))
        base_name = _base_name(engine, settings, pusher)
        if pusher is not None and updater.step > 0:
            _repush_if_needed(pusher, engine, updater.step, run_dir, updater, base_name, ts.weight_transfer)
        # One step counter: the updater's (saved in and restored from its checkpoints).
        while updater.step < ts.max_steps and not should_stop():
            started = time.perf_counter()
            data = _wait_for_data(engine, settings, tokenizer, should_stop)
            if data is None:
                break
            read_s = time.perf_counter() - started
            batch: Batch = build_batch(data.samples, mini_batch_size=ts.mini_batch_size,
                                       batch_round=ts.batch_round, pad_token_id=ts.pad_token_id)
            metrics = _data_metrics(data, settings)
            t = time.perf_counter()
            metrics.update(updater.update(batch))
            metrics["update_s"] = time.perf_counter() - t
            step = updater.step  # counted by the update
            _crash_point("after_update", step)
            t = time.perf_counter()
            checkpoint = updater.save_checkpoint()
            # In memory (weight_transfer ipc or shm), no folder is written: the version's weights are its
            # checkpoint's, and a re-push after a crash sends them from the updater resumed from it.
            in_memory = updater.export_kind == "full" and ts.weight_transfer != "disk"
            policy_dir = checkpoint if in_memory else updater.export(run_dir / f"policy-v{step}")
            metrics["save_s"] = time.perf_counter() - t
            row = _policy_row(settings, step, policy_dir, base_name, updater.export_kind == "lora")
            _crash_point("before_commit", step)
            metrics["read_s"] = read_s
            _commit(engine, step, data, metrics, row)
            _crash_point("after_commit", step)
            if pusher is not None:
                metrics.update(_push(pusher, row, updater, ts.weight_transfer))
            metrics["step_time_s"] = time.perf_counter() - started
            # The step committed before the push (a crash between them re-pushes on restart), so
            # the push's numbers and the whole step's time are added to the step's row afterwards.
            _complete_metrics(engine, step, metrics)
            report = StepReport(step, metrics)
            reports.append(report)
            _log_step(report)
            if on_step is not None:
                on_step(report)
    finally:
        updater.close()
        if pusher is not None:
            pusher.close()
        engine.dispose()
    return reports


def _pusher(settings: Settings) -> WeightPusher | None:
    ts = settings.trainer
    if not ts.push:
        return None
    token = ts.admin_token or settings.proxy.admin_token
    if token is None:
        raise ValueError("trainer.push needs the proxy's admin token (trainer.admin_token or proxy.admin_token)")
    return WeightPusher(ts.proxy_url, token.get_secret_value(), keep_loaded=ts.keep_loaded_versions,
                        lora_transport=ts.lora_transport)


def _base_name(engine: Engine, settings: Settings, pusher: WeightPusher | None) -> str:
    """The served name of the base model: version 0 as the proxy recorded it, else configuration."""
    with engine.connect() as conn:
        name = conn.execute(select(PolicyVersion.served_name).where(PolicyVersion.version == 0)).scalar_one_or_none()
    if name:
        return str(name)
    if pusher is not None:
        return str(pusher.active_policy()["served_name"])
    return settings.trainer.served_name or Path(str(settings.trainer.model)).name


def _resume(engine: Engine, updater: PolicyUpdater, checkpoint_dir: Path) -> None:
    """Restore the updater (its step included) from the checkpoint of the last committed step."""
    committed = last_committed_step(engine)
    if committed == 0:
        return
    path = checkpoint_dir / f"step_{committed:08d}"
    if not path.is_dir():
        raise RuntimeError(f"step {committed} is committed but its checkpoint {path} is missing; cannot resume "
                           "without repeating or skipping data")
    updater.load_checkpoint(path)
    logger.info("resumed at committed step %d from %s", committed, path)


def _repush_if_needed(pusher: WeightPusher, engine: Engine, step: int, run_dir: Path, updater: PolicyUpdater,
                      base_name: str, transfer: str) -> None:
    """A crash between commit and push leaves version N committed but not served: push it now."""
    with engine.connect() as conn:
        row = conn.execute(select(PolicyVersion).where(PolicyVersion.version == step)).scalar_one_or_none()
    active = pusher.active_policy().get("version")
    if row is None or active == step:
        return
    if row.kind == "full" and transfer != "disk":
        policy_dir = Path(row.path or "")
    elif row.path and Path(row.path).exists():
        policy_dir = Path(row.path)
    else:
        policy_dir = updater.export(run_dir / f"policy-v{step}")
    logger.info("version %d was committed but not active on the proxy (active: %s); pushing it", step, active)
    _push(pusher, PolicyVersionRow(step, row.served_name, row.base_model or base_name, row.kind, str(policy_dir)),
          updater, transfer)


def _log_step(report: StepReport) -> None:
    m = report.metrics

    def f(key: str, fmt: str = ".3f") -> str:
        value = m.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    logger.info(
        "step %d | reward %s ± %s | loss %s | kl %s | grad %s | clip %s | approx_kl %s | entropy %s | tokens %s | "
        "mismatch %s | tied %s | off-policy %s (%s) | stale %s | %ss (read %s, update %s, save %s, push %s)",
        report.step, f("reward_mean"), f("reward_std"), f("loss"), f("kl"), f("grad_norm"), f("clip_frac"),
        f("ppo_kl", ".4f"), f("entropy"),
        f("tokens", "d") if isinstance(m.get("tokens"), int) else f("tokens", ".0f"), f("logprob_mismatch"),
        f("tied_groups", "d"), f("off_policy_rows", "d"), m.get("off_policy_correction", "-"),
        f("staleness_max", "d"), f("step_time_s", ".2f"), f("read_s", ".2f"), f("update_s", ".2f"),
        f("save_s", ".2f"), f("push_s", ".2f"),
    )
