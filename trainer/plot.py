"""The training curve as a PNG: reward per step with entropy beside it, from `training_steps.metrics`.

Used by `rolltap-trainer stats --plot DIR` and `scripts/learn.py`. matplotlib (the
`trainer` extra) is imported only here, with its non-interactive backend: no display needed.
Read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select

from shared.db.models import TrainingStep

__all__ = ["PANELS", "plot_steps", "step_metrics"]

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
