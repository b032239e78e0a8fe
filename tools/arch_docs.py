"""Regenerates the tables of `docs/architecture.md` from the code: every HTTP route the proxy
serves, and every module of `shared/`, `proxy/` and `trainer/`.

    python -m tools.arch_docs            # rewrite the tables in docs/architecture.md
    python -m tools.arch_docs --check    # exit 1, saying so, when the page is stale

Only the text between `<!-- generated: NAME -->` and `<!-- end: NAME -->` is rewritten; the
prose around it is written by hand. Routes come from the app `proxy.app.create_app` builds
(nothing is started: no database, no replica), each with the first paragraph of its
endpoint's docstring. Modules are read with `ast` (none is imported), each with the first
paragraph of its docstring, so a module added or removed shows at the next run.
`tests/tools/test_arch_docs.py` fails when the page is stale.

It lives in `tools/` because it reads both the proxy (FastAPI) and the trainer, which
`shared/` may not import and neither package may import of the other.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["DOC", "PACKAGES", "module_rows", "render", "route_rows", "update"]

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("shared", "proxy", "trainer")
# Alembic's environment and numbered revisions: described in docs/schema.md, not module by module.
_SKIPPED_DIRS = {"migrations"}
# FastAPI's own routes carry no docstring of ours.
_FRAMEWORK_ROUTES = {
    "/openapi.json": "The OpenAPI document (FastAPI's, corrected by `proxy/openapi.py`).",
    "/docs": "Swagger UI over the OpenAPI document.",
    "/docs/oauth2-redirect": "Swagger UI's OAuth2 redirect page.",
    "/redoc": "ReDoc over the OpenAPI document.",
}
_MARKER = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?:.*?\n)?(<!-- end: (?P=name) -->)", re.S)


def summary(docstring: str | None) -> str:
    """The first paragraph of a docstring on one line; empty when there is none."""
    if not docstring:
        return ""
    return " ".join(docstring.strip().split("\n\n", 1)[0].split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def route_rows() -> list[tuple[str, str, str]]:
    """(methods, path, purpose) of every route of the proxy's app, in the order they are matched."""
    # Imported here: the module table needs neither FastAPI nor the proxy.
    from fastapi.routing import iter_route_contexts

    from proxy.app import create_app
    from shared.settings import Settings

    app = create_app(Settings())
    rows = []
    # FastAPI keeps an included router as one route; `iter_route_contexts` (what its OpenAPI
    # generator walks) yields the routes inside it with their full paths.
    for route in iter_route_contexts(app.routes):
        if route.path is None:
            continue
        methods = ", ".join(sorted(set(route.methods or ()) - {"HEAD"}))  # HEAD comes with every GET
        endpoint: Callable[..., Any] | None = route.endpoint
        purpose = _FRAMEWORK_ROUTES.get(route.path) or summary(endpoint.__doc__ if endpoint else None)
        rows.append((methods, route.path, purpose))
    return rows


def _modules(package: str) -> Iterator[Path]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if not _SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
            yield path


def module_rows(package: str) -> list[tuple[str, str]]:
    """(path, first paragraph of its docstring) of every module of `package`; a package's
    `__init__.py` only when it has a docstring (an empty one only marks the package)."""
    rows = []
    for path in _modules(package):
        doc = summary(ast.get_docstring(ast.parse(path.read_text())))
        if path.name == "__init__.py" and not doc:
            continue
        rows.append((path.relative_to(ROOT).as_posix(), doc))
    return rows


def _tables() -> dict[str, str]:
    tables = {"routes": "| method | path | purpose |\n|---|---|---|\n" + "".join(
        f"| {m} | `{p}` | {_cell(purpose)} |\n" for m, p, purpose in route_rows())}
    for package in PACKAGES:
        tables[f"modules-{package}"] = "| module | owns |\n|---|---|\n" + "".join(
            f"| `{path}` | {_cell(doc)} |\n" for path, doc in module_rows(package))
    return tables


def render(page: str) -> str:
    """`page` with every marked table regenerated; an unknown or missing marker is an error."""
    tables = _tables()
    seen: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in tables:
            raise ValueError(f"docs/architecture.md: no table is generated for marker {name!r}")
        seen.add(name)
        return match.group(1) + tables[name] + match.group(3)

    out = _MARKER.sub(fill, page)
    if missing := sorted(set(tables) - seen):
        raise ValueError(f"docs/architecture.md has no markers for {missing}")
    return out


def update(check: bool = False) -> bool:
    """Rewrite the page (or, with `check`, only compare); True when it was already fresh."""
    page = DOC.read_text()
    fresh = render(page)
    if fresh == page:
        return True
    if not check:
        DOC.write_text(fresh)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.arch_docs", description="Regenerate the tables of docs/architecture.md from the code.")
    parser.add_argument("--check", action="store_true", help="only say whether the page is stale")
    args = parser.parse_args(argv)
    if update(check=args.check):
        return 0
    if args.check:
        print("docs/architecture.md is stale: run `python -m tools.arch_docs`", file=sys.stderr)
        return 1
    print("docs/architecture.md: tables regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
