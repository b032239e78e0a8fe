"""bench.cells_plot: the cells it reads are the run's pooled ratios, and it refuses a cell a run lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cells_plot import Cell, plot, read_cells

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs/bench-results/gpu-throughput-h100-2026-12-07-8b.json"


def test_cells_are_the_runs_pooled_ratios(tmp_path: Path) -> None:
    summary = json.loads(RUN.read_text())["summary"]
    cells = read_cells(f"8B={RUN}:proxy_on@a:direct@a")
    assert [c.load for c in cells] == [64, 256]
    assert [[c.ratio, c.low, c.high] for c in cells] == [summary["64"]["proxy_on@a"]["x_direct@a"],
                                                         summary["256"]["proxy_on@a"]["x_direct@a"]]
    assert read_cells(f"8B@256={RUN}:proxy_on@n:direct@a") == [
        Cell("8B", 256, *summary["256"]["proxy_on@n"]["x_direct@a"])]
    out = plot(cells, tmp_path / "cells.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cell_the_run_lacks_is_refused() -> None:
    with pytest.raises(SystemExit, match="no proxy_on@z over direct@a"):
        read_cells(f"8B={RUN}:proxy_on@z:direct@a")
    with pytest.raises(SystemExit, match="no cell at 32 streams"):
        read_cells(f"8B@32={RUN}:proxy_on@a:direct@a")
