"""`docs/schema.md` is generated from the SQLAlchemy models and kept in sync with them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.db.models import Base
from shared.schema_docs import render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "schema.md"


def test_docs_match_the_models() -> None:
    assert DOC.read_text() == render(), "docs/schema.md is stale: run `python -m shared.schema_docs > docs/schema.md`"


def test_every_table_and_column_is_on_the_page() -> None:
    text = render()
    models = {m.class_.__tablename__: m.class_ for m in Base.registry.mappers}
    for name, table in Base.metadata.tables.items():
        assert models[name].__doc__, f"the model of {name} has no docstring"
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for column in table.columns:
            assert f"| `{column.name}` |" in section, f"{name}.{column.name} is not in docs/schema.md"
    # Spot checks of what is read from the models: a composite key, an index, a nullable column.
    assert "| [`replica_ejections`](#replica_ejections) | `url`, `proxy_id` |" in text
    assert "index `ix_calls_started_at` (`started_at`)" in text
    assert "| `seq` | INTEGER | yes |" in text


def test_module_entry_point_prints_the_page() -> None:
    out = subprocess.run([sys.executable, "-m", "shared.schema_docs"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout == render()
