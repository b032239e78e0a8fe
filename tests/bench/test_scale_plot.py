"""bench.scale_plot draws docs/scale.md's chart from its summary JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.scale_plot import main

SUMMARY = Path(__file__).resolve().parents[2] / "docs" / "bench-results" / "scale-8b-h200-2026-12-04.json"


def test_draws_the_committed_summary(tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    assert main([str(SUMMARY), str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    summary = json.loads(SUMMARY.read_text())
    assert all(low <= high for low, high in summary["push_s"].values())  # ranges as the chart draws them
