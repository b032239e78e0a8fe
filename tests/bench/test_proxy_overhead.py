"""bench.proxy_overhead's command line: what it refuses before it starts anything."""

from __future__ import annotations

import pytest

from bench.proxy_overhead import main


@pytest.mark.parametrize("entry", ["DB__SQLITE_SYNCHRONOUS=NORMAL", "ROLLTAP_DB__SQLITE_SYNCHRONOUS"])
def test_a_setting_must_be_a_rolltap_variable_with_a_value(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--setting", entry])
    assert exited.value.code == 2
    assert "want ROLLTAP_...=VALUE" in capsys.readouterr().err
