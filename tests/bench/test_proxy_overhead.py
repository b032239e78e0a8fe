"""bench.proxy_overhead's command line: what it refuses before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.proxy_overhead import main


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
