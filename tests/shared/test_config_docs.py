"""`docs/config.md` is generated from the settings model and kept in sync with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.config_docs import iter_sections, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"


def test_docs_match_the_settings_model() -> None:
    assert DOC.read_text() == render(), "docs/config.md is stale: run `python -m shared.config_docs > docs/config.md`"


def test_every_setting_is_described_and_listed() -> None:
    text = DOC.read_text()
    count = 0
    for path, model, fields in iter_sections():
        assert model.__doc__, f"section {'.'.join(path)} ({model.__name__}) has no docstring"
        for name, info in fields:
            count += 1
            key = ".".join((*path, name))
            assert info.description and info.description.strip(), f"setting {key} has no description"
            assert f"`ROLLTAP_{'__'.join((*path, name)).upper()}`" in text, f"{key} is not in docs/config.md"
    # The walk reached the nested recorder section and every leaf under it.
    assert {".".join(p) for p, _, _ in iter_sections()} >= {"db", "proxy", "proxy.recorder", "trainer"}
    assert count >= 30


def test_module_entry_point_prints_the_page() -> None:
    out = subprocess.run([sys.executable, "-m", "shared.config_docs"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout == render()
