"""What `scripts/learn.py --task calculator` adds to its report: the held-out score with its interval,
the agent's curves (reward, calls per episode, valid tool calls, held-out score) as one PNG, and one
trained row of an episode shown token by token with its mask.

The rows are rebuilt from the run's database with the trainer's own code (`trainer.reader`,
`trainer.data`), under the run's credit rule: what is shown is what the update trained on.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select

from shared.db.models import Attempt, Rollout
from shared.settings import TrainerSettings
from trainer.data import Sample, build_samples
from trainer.reader import load_attempt_data
from trainer.records import AttemptRow, Group

__all__ = ["Score", "attempt_samples", "curve_from_log", "interval", "main", "plot_agent", "plot_compare",
           "row_markdown"]


@dataclass(frozen=True)
class Score:
    """A held-out evaluation at one policy version: the mean score and its 90% bootstrap interval."""

    version: int
    mean: float
    low: float
    high: float
    n: int
    calls: float  # model calls per episode
    valid: float  # share of tool calls that asked the question's numbers


def interval(values: Sequence[float], *, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over `values` (one per held-out task)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    cut = (1 - level) / 2
    return means[int(cut * resamples)], means[min(resamples - 1, int((1 - cut) * resamples))]


def attempt_samples(conn: Connection, rollout_ids: Sequence[str], settings: TrainerSettings) -> list[Sample]:
    """The rows the trainer builds from these rollouts' attempts, consumed or not (read-only)."""
    rows = conn.execute(
        select(Attempt.id, Attempt.rollout_id, Attempt.attempt_id, Rollout.group_id, Attempt.status,
               Attempt.policy_version, Attempt.finished_at)
        .join(Rollout, Rollout.rollout_id == Attempt.rollout_id)
        .where(Attempt.rollout_id.in_(list(rollout_ids)))
        .order_by(Attempt.id)
    ).all()
    attempts = [AttemptRow(pk, rid, aid, gid or rid, status, int(v or 0), finished or datetime.now(UTC))
                for pk, rid, aid, gid, status, v, finished in rows]
    load_attempt_data(conn, attempts)
    groups: dict[str, list[AttemptRow]] = {}
    for a in attempts:
        groups.setdefault(a.group_id, []).append(a)
    return build_samples([Group(g, members, True) for g, members in groups.items()], settings).samples


def row_markdown(sample: Sample, decode: Any) -> list[str]:
    """One row as Markdown: the prompt, then the response turn by turn, generated text (mask 1) apart
    from what the trainer masked (mask 0: the tool's answer and the template's glue)."""
    t = sample.triplet
    lines = [f"Rollout `{sample.rollout_id}`, attempt `{sample.attempt_id}`: {len(t.seqs)} calls (seqs "
             f"{t.seqs}) in one row; prompt {len(t.prompt_ids)} tokens, response {len(t.response_ids)} tokens, "
             f"of which {sum(t.response_mask)} trained (mask 1); per-turn advantages "
             f"{[round(a, 3) for a in sample.turn_advantages or []]}.", "",
             "| part | mask | tokens | text |", "|---|---:|---:|---|",
             f"| prompt | - | {len(t.prompt_ids)} | `{_cell(decode(t.prompt_ids))}` |"]
    start = 0
    for i in range(1, len(t.response_mask) + 1):
        if i == len(t.response_mask) or t.response_mask[i] != t.response_mask[start]:
            mask = t.response_mask[start]
            part = "generated" if mask else "masked (tool answer, template)"
            lines.append(f"| {part} | {mask} | {i - start} | `{_cell(decode(t.response_ids[start:i]))}` |")
            start = i
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n").replace("`", "'")


def _pyplot() -> Any:
    """matplotlib's pyplot on its non-interactive backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def plot_agent(curve: Sequence[dict[str, Any]], scores: Sequence[Score], out: Path, *, title: str) -> Path:
    """Four panels over policy versions: mean reward, model calls per episode, valid tool calls, held-out score."""
    plt = _pyplot()
    versions = [c["version"] for c in curve]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = (("reward", "mean reward (training episodes)", (0, 1.05)),
              ("calls", "model calls per episode", None),
              ("valid", "tool calls asking the question's numbers", (0, 1.05)))
    for ax, (key, label, ylim) in zip(axes.flat, panels, strict=False):
        ax.plot(versions, [c.get(key) for c in curve], marker=".", lw=1)
        ax.set_title(label, fontsize=10)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    ax.errorbar([s.version for s in scores], [s.mean for s in scores],
                yerr=[[s.mean - s.low for s in scores], [s.high - s.mean for s in scores]],
                marker="o", capsize=4, lw=1)
    ax.set_title(f"held-out score (greedy, {scores[0].n if scores else 0} tasks, 90% interval)", fontsize=10)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("policy version")
    return _save(fig, out, title)


def plot_compare(runs: Sequence[tuple[str, dict[str, Any]]], out: Path, *, title: str) -> Path:
    """Runs side by side (each a label and its `curve.json`): mean reward, valid tool calls and the
    held-out score per policy version, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, data in runs:
        curve = data["curve"]
        versions = [c["version"] for c in curve]
        axes[0].plot(versions, [c["reward"] for c in curve], marker=".", lw=1, label=label)
        axes[1].plot(versions, [c.get("valid") for c in curve], marker=".", lw=1, label=label)
        held = data.get("held_out") or []
        axes[2].errorbar([h["version"] for h in held], [h["mean"] for h in held],
                         yerr=[[h["mean"] - h["low"] for h in held], [h["high"] - h["mean"] for h in held]],
                         marker="o", capsize=4, lw=1, label=label)
    for ax, name in zip(axes, ("mean reward (training episodes)", "tool calls asking the question's numbers",
                               "held-out score (90% interval)"), strict=True):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("policy version")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, title)


_VERSION_LINE = re.compile(r"^policy v(\d+): mean reward ([\d.]+) .*?(?:, ([\d.]+) calls/episode, valid tool calls (\d+)%)?\)$")
_HELD_OUT_LINE = re.compile(r"^held-out at v(\d+): ([\d.]+) \(90% ([\d.]+)-([\d.]+)\)")


def curve_from_log(text: str) -> dict[str, Any]:
    """A run's curve from the lines `scripts.learn` prints as it goes (`policy vN: ...`, `held-out at
    vN: ...`): what is left of a run stopped before it wrote `curve.json`."""
    curve: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := _VERSION_LINE.match(line.strip()):
            curve.append({"version": int(m[1]), "reward": float(m[2]), "calls": float(m[3]) if m[3] else None,
                          "valid": int(m[4]) / 100 if m[4] else None})
        elif m := _HELD_OUT_LINE.match(line.strip()):
            held.append({"version": int(m[1]), "mean": float(m[2]), "low": float(m[3]), "high": float(m[4])})
    return {"curve": curve, "held_out": held}


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m scripts.agent_report LABEL=RUN ... --out PNG [--title T]`: runs compared, each RUN a
    `curve.json` or the log `scripts.learn` printed (a run stopped before its report)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("runs", nargs="+", metavar="LABEL=CURVE_JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="credit over turns compared")
    args = parser.parse_args(argv)
    runs = [(label, json.loads(text) if path.endswith(".json") else curve_from_log(text))
            for label, path in (r.split("=", 1) for r in args.runs) for text in [Path(path).read_text()]]
    print(plot_compare(runs, args.out, title=args.title))


if __name__ == "__main__":
    main()
