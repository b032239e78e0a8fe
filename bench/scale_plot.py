"""The 8B-class chart of docs/scale.md: push time per method and the LoRA step with its export.

Reads a summary JSON with `push_s` (method -> [low, high] seconds) and `step_s` (kind ->
median_step, export_before_fix, export_after_fix) and writes one PNG with two panels; the push
panel is on a log scale because the methods span three orders of magnitude.

    python3 -m bench.scale_plot docs/bench-results/scale-8b-h200-2026-12-04.json docs/scale-8b-h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def plot(summary: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pushes: dict[str, list[float]] = summary["push_s"]
    steps: dict[str, dict[str, float]] = summary["step_s"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    names = list(pushes)
    lows = [pushes[n][0] for n in names]
    highs = [pushes[n][1] for n in names]
    rows = range(len(names))
    left.barh(rows, highs, color="#9ecae1", label="slowest round")
    left.barh(rows, lows, color="#3182bd", label="fastest round")
    left.set_yticks(list(rows), names)
    left.invert_yaxis()
    left.set_xscale("log")
    left.set_xlabel("push time (s, log scale)")
    left.set_title(f"pushes to a vLLM replica, {summary['shape']}")
    left.legend(loc="lower right", fontsize=8)
    kinds = list(steps)
    width = 0.27
    for i, (key, label, colour) in enumerate((("median_step", "median update step", "#31a354"),
                                              ("export_before_fix", "LoRA export, before", "#de2d26"),
                                              ("export_after_fix", "LoRA export, after", "#fc9272"))):
        right.bar([k + (i - 1) * width for k in range(len(kinds))], [steps[k][key] for k in kinds], width,
                  color=colour, label=label)
    right.set_xticks(list(range(len(kinds))), kinds)
    right.set_ylabel("seconds")
    right.set_ylim(0, 1.4 * max(max(v.values()) for v in steps.values()))  # room for the legend above the bars
    right.set_title("the trainer's step (32 rows, 384 tokens)")
    right.legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle(f"{summary['shape']} on one {summary['gpu']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("summary", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(plot(json.loads(args.summary.read_text()), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
