"""The replica-layout chart of docs/gpu-results.md "At scale": tokens/s per path, model and load.

Reads `bench.rollout_throughput` runs given as `TITLE=FILE` (one panel each) and draws, per load,
one bar per path: the median of its windows' tokens/s. Above each proxy path's bar it writes its
pooled ratio to the run's best plain direct path at that load (`bench.throughput_report`'s
ratio: tokens summed over the rounds), the figure the issue's 0.95x goal is about.

    python -m bench.layout_plot "SmolLM2-135M=docs/bench-results/gpu-at-scale-2026-12-04-graphs-smollm2-135m.json" \
        ... --out docs/gpu-at-scale-graphs.png --title "..."
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.throughput_report import load_windows, pooled_ratio

COLOURS = {"direct": "#3182bd", "direct_same_ask": "#9ecae1", "proxy_on": "#e6550d", "proxy_sample": "#fdae6b",
           "proxy_off": "#fdd0a2"}
HATCHES = ("", "//", "..", "xx")


def best_plain(windows: list[dict[str, Any]]) -> str:
    """The plain direct path (`direct` or `direct@GROUP`) with the most tokens over the windows."""
    totals: dict[str, float] = {}
    for w in windows:
        if w["path"].partition("@")[0] == "direct":
            totals[w["path"]] = totals.get(w["path"], 0.0) + w["tokens"]
    if not totals:
        raise SystemExit("a run without a plain direct path: nothing to take ratios against")
    return max(totals, key=lambda p: totals[p])


def panel_bars(windows: list[dict[str, Any]]) -> list[tuple[int, str, list[tuple[str, float, float | None]]]]:
    """Per load: (load, its best plain path, [(path, median tokens/s, ratio to that path or None)])."""
    out = []
    for load in sorted({w["load"] for w in windows}):
        rows = [w for w in windows if w["load"] == load]
        best = best_plain(rows)
        bars = []
        for path in dict.fromkeys(w["path"] for w in rows):
            median = statistics.median(w["tokens_per_s"] for w in rows if w["path"] == path)
            found = pooled_ratio(rows, path, best) if path.startswith("proxy") else None
            bars.append((path, median, found[0] if found else None))
        out.append((load, best, bars))
    return out


def plot(runs: list[tuple[str, Path]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.6), squeeze=False)
    for ax, (name, path) in zip(axes[0], runs, strict=True):
        loads = panel_bars(load_windows([path]))
        width = 0.8 / max(len(bars) for _, _, bars in loads)
        groups = {p.partition("@")[2] for _, _, bars in loads for p, _, _ in bars}  # server groups: one hatch each
        for i, (_, best, bars) in enumerate(loads):
            for j, (p, median, ratio) in enumerate(bars):
                x = i + (j - (len(bars) - 1) / 2) * width
                kind, _, group = p.partition("@")
                ax.bar(x, median, width * 0.95, color=COLOURS.get(kind, "#999999"), label=p if i == 0 else None,
                       hatch=HATCHES[sorted(groups).index(group) % len(HATCHES)],
                       edgecolor="black" if p == best else "white", linewidth=1.2 if p == best else 0.5)
                if ratio is not None:
                    ax.text(x, median, f"{ratio:.2f}", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(loads)), [f"{load} streams" for load, _, _ in loads])
        ax.set_ylabel("generated tokens/s (median window)")
        ax.set_ylim(0, 1.25 * max(m for _, _, bars in loads for _, m, _ in bars))
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title + "\n(numbers: a proxy path's tokens over the best plain direct path's, outlined)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="TITLE=FILE", help="a rollout_throughput JSON and its panel title")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="Replica layouts on one GPU")
    args = parser.parse_args(argv)
    runs = []
    for entry in args.runs:
        name, sep, file = entry.rpartition("=")
        if not sep or not name:
            parser.error(f"{entry!r}: want TITLE=FILE")
        runs.append((name, Path(file)))
    print(plot(runs, args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
