"""Issue 24's cells as one chart: Rolltap's tokens/s over plain vLLM's, per model and load, with the
90% intervals `bench.rollout_throughput` pooled, against the 0.95 target.

Each cell is `LABEL=RESULT.json:PATH:BASELINE`: the ratio `summary[load][PATH]["x_BASELINE"]` of that
run, at every load it holds (`LABEL@256=...`: at that load only).

    python3 -m bench.cells_plot docs/gpu-cells-h100.png \\
        "135M=docs/bench-results/gpu-throughput-h100-2026-12-07-135m.json:proxy_on@c:direct@c" ...
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

TARGET = 0.95


@dataclass(frozen=True)
class Cell:
    label: str
    load: int
    ratio: float
    low: float
    high: float


def read_cells(spec: str) -> list[Cell]:
    """The cells one `LABEL[@LOAD]=RESULT.json:PATH:BASELINE` names, by load (lowest first)."""
    label, _, rest = spec.partition("=")
    label, _, only = label.partition("@")
    result, path, baseline = rest.rsplit(":", 2)
    summary = json.loads(Path(result).read_text())["summary"]
    cells = []
    for load in sorted(summary, key=int):
        if only and load != only:
            continue
        ratio = summary[load].get(path, {}).get(f"x_{baseline}")
        if ratio is None:
            raise SystemExit(f"{result}: no {path} over {baseline} at {load} streams")
        cells.append(Cell(label, int(load), *ratio))
    if not cells:
        raise SystemExit(f"{result}: no cell at {only} streams")
    return cells


def plot(cells: list[Cell], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.1 * len(cells) + 2.5, 4.0))
    xs = range(len(cells))
    colors = ["#3182bd" if c.ratio >= TARGET else "#de2d26" for c in cells]
    ax.bar(xs, [c.ratio for c in cells], color=colors, width=0.6)
    ax.errorbar(xs, [c.ratio for c in cells], yerr=[[c.ratio - c.low for c in cells], [c.high - c.ratio for c in cells]],
                fmt="none", ecolor="black", capsize=4, linewidth=1)
    ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1, label=f"target {TARGET}x")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_xticks(list(xs), [f"{c.label}\n{c.load} streams" for c in cells], fontsize=8)
    ax.set_ylim(min(0.8, min(c.low for c in cells) - 0.02), max(1.1, max(c.high for c in cells) + 0.02))
    ax.set_ylabel("tokens/s through Rolltap ÷ best plain vLLM")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    for x, c in zip(xs, cells, strict=True):
        ax.annotate(f"{c.ratio:.3f}", (x, c.high), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cells_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("cells", nargs="+", help="LABEL[@LOAD]=RESULT.json:PATH:BASELINE")
    parser.add_argument("--title", default="Rolltap (default settings) over the best plain vLLM layout, 90% intervals")
    args = parser.parse_args(argv)
    cells = [cell for spec in args.cells for cell in read_cells(spec)]
    print(plot(cells, args.out, args.title))


if __name__ == "__main__":
    main()
