"""`rolltap-trainer stats`: what the database holds, from the trainer's point of view.

This module owns the report: attempts by status, how many are consumed (by training
steps, by exports), eligible and their groups' readiness, stale attempts, calls by
status, stored drop reasons, the distribution of final rewards, policy versions, and
the training signal of the last steps (reward, entropy, clip fraction, approximate KL,
gradient norm, train/replica logprob mismatch, tied groups, off-policy rows).
Read-only.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, exists, false, func, select

from shared.db.models import Attempt, Call, ExportAttempt, PolicyVersion, Reward, TrainingStep, TrainingStepAttempt
from shared.settings import TrainerSettings
from trainer.credit import final_reward
from trainer.drops import drop_counts
from trainer.reader import current_policy_version, eligible_statuses, scan_groups
from trainer.records import RewardRow

__all__ = ["collect_stats", "render_stats"]

HISTOGRAM_BINS = 10
RECENT_STEPS = 10
# (metric key in training_steps.metrics, column title) of the per-step signal table.
SIGNAL_COLUMNS = (
    ("reward_mean", "reward"), ("entropy", "entropy"), ("clip_frac", "clip"), ("ppo_kl", "approx_kl"),
    ("grad_norm", "grad"), ("logprob_mismatch", "mismatch"), ("kl", "ref_kl"), ("tied_groups", "tied"),
    ("off_policy_rows", "off_policy"),
)


def _recent_steps(conn: Connection) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(TrainingStep.step, TrainingStep.metrics).order_by(TrainingStep.step.desc()).limit(RECENT_STEPS)
    ).all()
    return [
        {"step": int(step), **{k: (metrics or {}).get(k) for k, _ in SIGNAL_COLUMNS},
         "off_policy_correction": (metrics or {}).get("off_policy_correction")}
        for step, metrics in reversed(rows)
    ]


def _reward_distribution(conn: Connection) -> dict[str, Any]:
    finished = ("succeeded", "failed", "cancelled")
    per_attempt: dict[tuple[str, str], list[RewardRow]] = defaultdict(list)
    status_of = dict(
        ((r, a), s)
        for r, a, s in conn.execute(
            select(Attempt.rollout_id, Attempt.attempt_id, Attempt.status).where(Attempt.status.in_(finished))
        )
    )
    for rid, aid, value, name, call_id in conn.execute(
        select(Reward.rollout_id, Reward.attempt_id, Reward.value, Reward.name, Reward.call_id).order_by(Reward.id)
    ):
        if (rid, aid) in status_of:
            per_attempt[(rid, aid)].append(RewardRow(float(value), name, call_id))
    values = [v for v in (final_reward(rs) for rs in per_attempt.values()) if v is not None]
    by_status: dict[str, list[float]] = defaultdict(list)
    for key, rs in per_attempt.items():
        v = final_reward(rs)
        if v is not None:
            by_status[status_of[key]].append(v)
    out: dict[str, Any] = {
        "rewarded_attempts": len(values),
        "unrewarded_finished_attempts": len(status_of) - len(values),
    }
    if not values:
        return out
    out.update(
        # `mean` and `pstdev` sum exactly (fractions): no overflow whatever the rewards.
        mean=statistics.mean(values),
        std=statistics.pstdev(values),
        min=min(values),
        median=statistics.median(values),
        max=max(values),
        mean_by_status={s: statistics.mean(v) for s, v in sorted(by_status.items())},
        histogram=_histogram(values),
    )
    return out


def _histogram(values: list[float]) -> list[dict[str, float]]:
    lo, hi = min(values), max(values)
    if math.isclose(lo, hi):
        return [{"lo": lo, "hi": hi, "count": len(values)}]
    # Divided before subtracting, edges as weighted means: `hi - lo` overflows near float64's range.
    width = hi / HISTOGRAM_BINS - lo / HISTOGRAM_BINS
    counts = Counter(min(int(v / width - lo / width), HISTOGRAM_BINS - 1) for v in values)
    edges = [lo * (1 - i / HISTOGRAM_BINS) + hi * (i / HISTOGRAM_BINS) for i in range(HISTOGRAM_BINS + 1)]
    return [{"lo": edges[i], "hi": edges[i + 1], "count": counts.get(i, 0)} for i in range(HISTOGRAM_BINS)]


def collect_stats(conn: Connection, settings: TrainerSettings, *, now: datetime | None = None) -> dict[str, Any]:
    """The whole report as one JSON-serialisable dict."""
    current = current_policy_version(conn)
    attempts = dict(conn.execute(select(Attempt.status, func.count()).group_by(Attempt.status)).all())
    calls = dict(
        conn.execute(select(Call.status, func.count()).where(Call.attempt_id.is_not(None)).group_by(Call.status)).all()
    )
    untracked = conn.execute(select(func.count()).select_from(Call).where(Call.attempt_id.is_(None))).scalar_one()
    consumed_training = conn.execute(select(func.count()).select_from(TrainingStepAttempt)).scalar_one()
    consumed_export = conn.execute(select(func.count()).select_from(ExportAttempt)).scalar_one()
    version = func.coalesce(Attempt.policy_version, 0)
    has_reward = exists().where(and_(Reward.rollout_id == Attempt.rollout_id, Reward.attempt_id == Attempt.attempt_id))
    stale = conn.execute(
        select(func.count())
        .select_from(Attempt)
        .where(
            Attempt.status.in_(eligible_statuses(settings)),
            version < current - settings.max_staleness if settings.staleness_gate else false(),
            has_reward,
            ~exists().where(TrainingStepAttempt.attempt_pk == Attempt.id),
            ~exists().where(ExportAttempt.attempt_pk == Attempt.id),
        )
    ).scalar_one()
    groups = scan_groups(conn, settings, now=now)
    readiness = Counter(g.readiness for g in groups)
    by_version = dict(conn.execute(select(version, func.count()).group_by(version)).all())
    versions = [
        {
            "version": v.version,
            "served_name": v.served_name,
            "kind": v.kind,
            "is_active": v.is_active,
            "attempts": int(by_version.pop(v.version, 0)),
        }
        for v in conn.execute(
            select(PolicyVersion.version, PolicyVersion.served_name, PolicyVersion.kind, PolicyVersion.is_active)
            .order_by(PolicyVersion.version)
        )
    ]
    return {
        "attempts_by_status": {str(k): int(v) for k, v in sorted(attempts.items())},
        "calls_by_status": {str(k): int(v) for k, v in sorted(calls.items())},
        "untracked_calls": int(untracked),
        "consumed": {"by_training": int(consumed_training), "by_export": int(consumed_export)},
        "eligible": {
            "attempts": sum(len(g.members) for g in groups),
            "stale_attempts": int(stale),
            "groups": {k: readiness.get(k, 0) for k in ("full", "timed_out", "waiting", "stalled")},
        },
        "drops": drop_counts(conn),
        "rewards": _reward_distribution(conn),
        "policy": {
            "current_version": current,
            "versions": versions,
            "attempts_of_unrecorded_versions": {str(k): int(v) for k, v in sorted(by_version.items())},
        },
        "steps": _recent_steps(conn),
        "settings": {
            "group_size": settings.group_size,
            "max_staleness": settings.max_staleness,
            "group_timeout_s": settings.group_timeout_s,
            "min_group_size": settings.min_group_size,
            "include_failed": settings.include_failed,
        },
    }


def _table(rows: dict[str, Any], indent: str = "  ") -> list[str]:
    if not rows:
        return [f"{indent}(none)"]
    width = max(len(str(k)) for k in rows)
    return [f"{indent}{str(k).ljust(width)}  {v}" for k, v in rows.items()]


def render_stats(stats: dict[str, Any]) -> str:
    """The report for a terminal."""
    lines = ["Attempts by status"]
    lines += _table(stats["attempts_by_status"])
    lines += ["", f"Calls by status (untracked: {stats['untracked_calls']})"]
    lines += _table(stats["calls_by_status"])
    c, e, s = stats["consumed"], stats["eligible"], stats["settings"]
    lines += [
        "",
        "Consumption",
        f"  consumed by training steps  {c['by_training']}",
        f"  consumed by exports         {c['by_export']}",
        f"  eligible, unconsumed        {e['attempts']}",
        f"  stale (never used)          {e['stale_attempts']}",
        f"  groups: {', '.join(f'{k} {v}' for k, v in e['groups'].items())}"
        f"  (group_size {s['group_size']}, timeout {s['group_timeout_s']:g} s, min {s['min_group_size']})",
        "",
        "Drop reasons (calls left out of triplets)",
    ]
    lines += _table(stats["drops"])
    r = stats["rewards"]
    lines += ["", f"Final rewards ({r['rewarded_attempts']} rewarded, {r['unrewarded_finished_attempts']} finished without)"]
    if r.get("histogram"):
        lines.append(
            f"  mean {r['mean']:.4g}  std {r['std']:.4g}  min {r['min']:.4g}  median {r['median']:.4g}  max {r['max']:.4g}"
        )
        lines += [f"  mean ({k})  {v:.4g}" for k, v in r["mean_by_status"].items()]
        top = max(b["count"] for b in r["histogram"])
        for b in r["histogram"]:
            bar = "#" * round(30 * b["count"] / top) if top else ""
            lines.append(f"  [{b['lo']:>9.3g}, {b['hi']:>9.3g}]  {b['count']:>7}  {bar}")
    p = stats["policy"]
    lines += ["", f"Policy versions (current {p['current_version']}, max_staleness {s['max_staleness']})"]
    if not p["versions"]:
        lines.append("  (none recorded: the base model is version 0)")
    for v in p["versions"]:
        active = " active" if v["is_active"] else ""
        lines.append(f"  v{v['version']:<4} {v['kind']:<5} {v['served_name']}{active}  attempts {v['attempts']}")
    for k, n in p["attempts_of_unrecorded_versions"].items():
        lines.append(f"  v{k:<4} (not in policy_versions)  attempts {n}")
    lines += ["", f"Training signal (last {RECENT_STEPS} steps)"]
    if not stats.get("steps"):
        lines.append("  (no training steps)")
    else:
        header = ["step", *(title for _, title in SIGNAL_COLUMNS), "correction"]
        lines.append("  " + "  ".join(f"{h:>10}" for h in header))
        for row in stats["steps"]:
            cells = [str(row["step"]), *(_cell(row.get(k)) for k, _ in SIGNAL_COLUMNS),
                     str(row.get("off_policy_correction") or "-")]
            lines.append("  " + "  ".join(f"{c:>10}" for c in cells))
    if stats.get("plot"):
        lines += ["", f"Plot: {stats['plot']}"]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
