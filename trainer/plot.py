"""Training charts as PNGs: reward per step with entropy beside it (`training_steps.metrics`), the
calls left out of training by drop reason (`call_drops`), and how stale the consumed attempts
were per step (the step's policy version minus the version that sampled each attempt).

Used by `rolltap-trainer stats --plot DIR` and `scripts/learn.py`. matplotlib (the
`trainer` extra) is imported only here, with its non-interactive backend: no display needed.
Read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, func, select

from shared.db.models import Attempt, CallDrop, TrainingStep, TrainingStepAttempt

__all__ = ["PANELS", "drop_counts", "plot_data_charts", "plot_drops", "plot_staleness", "plot_steps", "staleness_by_step",
           "step_metrics"]

# (metric key, panel title); the first is the reward the attempts of the step's groups earned.
PANELS = (("reward_mean", "mean reward"), ("entropy", "entropy (nats/token)"), ("clip_frac", "clip fraction"),
          ("grad_norm", "gradient norm"))


def step_metrics(conn: Connection) -> list[tuple[int, dict[str, Any]]]:
    """(step, metrics) of every recorded training step, in order."""
    rows = conn.execute(select(TrainingStep.step, TrainingStep.metrics).order_by(TrainingStep.step)).all()
    return [(int(step), dict(metrics or {})) for step, metrics in rows]


def plot_steps(steps: Sequence[tuple[int, dict[str, Any]]], out: Path, *, title: str | None = None) -> Path:
    """Write the curves of `steps` to the PNG `out` (a directory gets `training.png`); returns the file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    if out.suffix.lower() != ".png":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "training.png"
    if not steps:
        raise ValueError("no training steps recorded: nothing to plot")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        points = [(step, float(m[key])) for step, m in steps if isinstance(m.get(key), int | float)]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1)
        ax.set_title(label)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if key == "reward_mean":
            ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def drop_counts(conn: Connection) -> dict[str, int]:
    """Calls left out of every triplet, per drop reason, most frequent first."""
    rows = conn.execute(select(CallDrop.reason, func.count()).group_by(CallDrop.reason)).all()
    return dict(sorted(((str(r), int(n)) for r, n in rows), key=lambda item: (-item[1], item[0])))


def staleness_by_step(conn: Connection) -> list[tuple[int, float, int]]:
    """(step, mean, max) staleness of the attempts each step consumed, in policy versions."""
    lag = TrainingStep.policy_version - func.coalesce(Attempt.policy_version, 0)
    rows = conn.execute(
        select(TrainingStep.step, func.avg(lag), func.max(lag))
        .join(TrainingStepAttempt, TrainingStepAttempt.step == TrainingStep.step)
        .join(Attempt, Attempt.id == TrainingStepAttempt.attempt_pk)
        .where(TrainingStep.policy_version.is_not(None))
        .group_by(TrainingStep.step).order_by(TrainingStep.step)
    ).all()
    return [(int(step), float(mean), int(top)) for step, mean, top in rows]


def _figure(out: Path, name: str) -> tuple[Any, Any, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    return plt, (fig, ax), out / name


def plot_drops(counts: dict[str, int], out_dir: Path) -> Path:
    """A bar per drop reason (DIR/drops.png); an empty chart says there were none."""
    plt, (fig, ax), path = _figure(Path(out_dir), "drops.png")
    if counts:
        ax.barh(list(counts)[::-1], list(counts.values())[::-1], color="#c0504d")
        ax.set_xlabel("calls dropped")
    else:
        ax.text(0.5, 0.5, "no calls dropped", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("calls left out of training, by reason")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_staleness(points: Sequence[tuple[int, float, int]], out_dir: Path) -> Path:
    """Mean and max staleness of the consumed attempts per training step (DIR/staleness.png)."""
    plt, (fig, ax), path = _figure(Path(out_dir), "staleness.png")
    if points:
        steps = [p[0] for p in points]
        ax.plot(steps, [p[1] for p in points], marker=".", label="mean")
        ax.plot(steps, [p[2] for p in points], marker=".", linestyle="--", label="max")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no consumed attempts", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("staleness of consumed attempts (policy versions behind)")
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_data_charts(conn: Connection, out_dir: Path) -> list[Path]:
    """The charts beside the training curve: drops.png and staleness.png in `out_dir`."""
    return [plot_drops(drop_counts(conn), Path(out_dir)), plot_staleness(staleness_by_step(conn), Path(out_dir))]
