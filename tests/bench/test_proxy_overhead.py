"""bench.proxy_overhead's command line: what it refuses before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.proxy_overhead import Cell, _median, evaluate, main


@pytest.mark.parametrize("entry", ["DB__SQLITE_SYNCHRONOUS=NORMAL", "ROLLTAP_DB__SQLITE_SYNCHRONOUS"])
def test_a_setting_must_be_a_rolltap_variable_with_a_value(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--setting", entry])
    assert exited.value.code == 2
    assert "want ROLLTAP_...=VALUE" in capsys.readouterr().err


def test_the_report_folder_is_made_before_the_run(tmp_path: Path) -> None:
    # `make bench-cpu` writes to .rolltap/: in a fresh clone the run's results were lost at the end.
    out = tmp_path / "fresh" / "bench-cpu.md"
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--setting", "not-a-setting"])  # refused after the folder, before any server
    assert out.parent.is_dir()


def test_the_cpu_target_shows_each_repeats_own_ratio() -> None:
    def cell(target: str, cpu: float) -> Cell:
        return Cell("stream", 32, target, 1000.0, 1.0, 2.0, cpu, 0, 5000, None, None)

    runs = [{("stream", 32, "sqlite"): cell("sqlite", s), ("stream", 32, "bare"): cell("bare", b)}
            for s, b in ((600.0, 500.0), (900.0, 450.0), (560.0, 400.0))]
    med = {key: _median([r[key] for r in runs]) for key in runs[0]}
    line = next(line for line in evaluate(med, runs) if "the bare relay's (" in line)
    # Medians 600 / 450 = 1.33; the repeats' own ratios 1.20, 2.00, 1.40.
    assert "= 1.33×" in line and "NOT MET" in line and line.endswith("each repeat's own ratio: 1.20, 2.00, 1.40")
