"""Pool several `bench.rollout_throughput` runs into one table: ratios with their uncertainty.

One window of a CPU-bound replica varies by 7-20% from the next on the same path (measured on an
H200 host at 64 streams), more than the 3% a ratio goal cares about. So this pools every window
of the given runs: a path's ratio to a baseline is its generated tokens over the baseline's,
summed over all rounds (each window weighted by its length), with a 90% interval from
resampling whole rounds (a path's window and the baselines' of the same round travel together,
so drift between rounds is kept out of the ratio). Latency figures are medians over the windows
that have them.

    python -m bench.throughput_report docs/bench-results/gpu-throughput-*.json [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

BASELINES = ("direct", "direct_same_ask")


def baselines(paths: list[str]) -> list[str]:
    """The paths ratios are taken against: the direct ones, of every server group (`direct@a`)."""
    return [p for p in paths if p.partition("@")[0] in BASELINES]
FIGURES = ("ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50", "latency_ms_p99", "proxy_cores", "replica_cores")


def tagged(windows: list[dict[str, Any]], run: str, window_s: float) -> list[dict[str, Any]]:
    """One run's windows with their round's key (run, round) and the tokens they generated."""
    return [{**w, "key": (run, w["round"]), "tokens": w["tokens_per_s"] * window_s} for w in windows]


def load_windows(paths: list[Path]) -> list[dict[str, Any]]:
    """Every window of the runs, tagged."""
    windows = []
    for path in paths:
        run = json.loads(path.read_text())
        windows += tagged(run["windows"], path.name, float(run["args"]["window_s"]))
    return windows


def pooled_ratio(windows: list[dict[str, Any]], path: str, base: str, resamples: int = 4000,
                 seed: int = 1) -> tuple[float, float, float] | None:
    """Tokens of `path` over tokens of `base` in the rounds that have both, with a 90% interval."""
    by_round: dict[Any, dict[str, float]] = {}
    for w in windows:
        if w["path"] in (path, base):
            by_round.setdefault(w["key"], {})[w["path"]] = w["tokens"]
    # A round whose baseline window counted no tokens (a replica's counter that did not move in a short
    # CPU window) cannot be a denominator.
    rounds = [r for r in by_round.values() if path in r and base in r and r[base] > 0]
    if not rounds:
        return None

    def ratio(sample: list[dict[str, float]]) -> float:
        return sum(r[path] for r in sample) / sum(r[base] for r in sample)

    rng = random.Random(seed)
    spread = sorted(ratio([rng.choice(rounds) for _ in rounds]) for _ in range(resamples))
    return ratio(rounds), spread[int(0.05 * resamples)], spread[int(0.95 * resamples)]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def report(windows: list[dict[str, Any]]) -> str:
    """A markdown table per load: tokens/s, pooled ratios to both direct paths, latency, CPU."""
    lines = []
    for load in sorted({w["load"] for w in windows}):
        rows = [w for w in windows if w["load"] == load]
        paths = list(dict.fromkeys(w["path"] for w in rows))
        bases = baselines(paths)
        lines += [f"### {load} streams ({len({w['key'] for w in rows})} rounds)", "",
                  "| path | tokens/s (median) | " + "".join(f"x {b} | " for b in bases) + "first token p50 / p99 ms "
                  "| call p50 / p99 ms | proxy cores | replica cores |", "|" + "---|" * (6 + len(bases))]
        for path in paths:
            mine = [w for w in rows if w["path"] == path]
            cells = [path, f"{statistics.median(w['tokens_per_s'] for w in mine):,.0f}"]
            for base in bases:
                found = pooled_ratio(rows, path, base) if path != base else None
                cells.append(f"{found[0]:.2f} ({found[1]:.2f}-{found[2]:.2f})" if found else "")
            fig = {k: _median([w.get(k) for w in mine]) for k in FIGURES}
            cells.append(" / ".join(f"{fig[k]:,.0f}" if fig[k] is not None else "-" for k in FIGURES[:2]))
            cells.append(" / ".join(f"{fig[k]:,.0f}" if fig[k] is not None else "-" for k in FIGURES[2:4]))
            cells += [f"{fig[k]:.2f}" if fig[k] is not None else "" for k in FIGURES[4:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="JSON files written by bench.rollout_throughput --out")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    text = report(load_windows(args.runs))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
