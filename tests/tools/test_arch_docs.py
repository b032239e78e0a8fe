"""`docs/architecture.md`'s route and module tables are generated from the code and kept fresh."""

from __future__ import annotations

import pytest

from tools.arch_docs import DOC, PACKAGES, module_rows, render, route_rows


def test_tables_match_the_code() -> None:
    page = DOC.read_text()
    assert render(page) == page, "docs/architecture.md is stale: run `python -m tools.arch_docs`"


def test_every_route_and_module_says_what_it_is_for() -> None:
    routes = route_rows()
    assert {(m, p) for m, p, _ in routes} >= {
        ("POST", "/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"),
        ("POST", "/rollout/{rollout_id}/attempt/{attempt_id}/finish"), ("GET", "/readyz"), ("PUT", "/admin/policy")}
    assert not [p for _, p, purpose in routes if not purpose], "routes without a docstring"
    for package in PACKAGES:
        rows = module_rows(package)
        assert f"{package}/main.py" in dict(rows) or package == "shared"
        assert not [path for path, doc in rows if not doc], "modules without a docstring"


def test_markers_must_match_the_tables() -> None:
    page = DOC.read_text()
    with pytest.raises(ValueError, match="no table is generated for marker 'nope'"):
        render(page + "\n<!-- generated: nope -->\n<!-- end: nope -->\n")
    with pytest.raises(ValueError, match="no markers for"):
        render(page.replace("<!-- generated: routes -->", "").replace("<!-- end: routes -->", ""))
