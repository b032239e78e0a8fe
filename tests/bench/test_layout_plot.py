"""bench.layout_plot draws docs/gpu-results.md's layout charts from the committed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.layout_plot import best_plain, main, panel_bars
from bench.throughput_report import load_windows

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "bench-results"
EIGHT_B = RESULTS / "gpu-at-scale-2026-12-04-graphs-llama3-8b.json"
SMALL = RESULTS / "gpu-at-scale-2026-12-04-graphs-smollm2-135m.json"


def test_draws_a_panel_per_run(tmp_path: Path) -> None:
    out = tmp_path / "layouts.png"
    assert main([f"8B={EIGHT_B}", f"135M={SMALL}", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000


def test_the_best_plain_path_is_chosen_per_load_from_the_data() -> None:
    # These runs disagree on the best layout: one engine for the 8B at 64 streams, four servers
    # for the 135M at 256; a fixed baseline would misstate one of them.
    eight_b = {load: best for load, best, _ in panel_bars(load_windows([EIGHT_B]))}
    small = {load: best for load, best, _ in panel_bars(load_windows([SMALL]))}
    assert eight_b[64] == "direct@a" and small[256] == "direct@c"


def test_only_proxy_paths_carry_a_ratio_and_it_is_tokens_over_tokens() -> None:
    windows = load_windows([SMALL])
    for load, best, bars in panel_bars(windows):
        for path, median, ratio in bars:
            assert median > 0
            assert (ratio is not None) == path.startswith("proxy")
            if ratio is not None:
                rows = [w for w in windows if w["load"] == load]
                mine = sum(w["tokens"] for w in rows if w["path"] == path)
                theirs = sum(w["tokens"] for w in rows if w["path"] == best)
                assert ratio == pytest.approx(mine / theirs)


def test_a_run_without_plain_direct_calls_is_refused() -> None:
    windows = [w for w in load_windows([SMALL]) if not w["path"].startswith("direct@")]
    with pytest.raises(SystemExit, match="plain direct"):
        best_plain(windows)
