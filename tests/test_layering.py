"""Dependencies point one way: proxy -> shared, trainer -> shared; shared needs no web stack or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "proxy": {"trainer"},
    "trainer": {"proxy"},
    "shared": {"fastapi", "starlette", "uvicorn", "aiohttp", "torch", "verl", "ray", "vllm", "transformers",
               "proxy", "trainer"},
    # The vLLM plugin is installed into replicas' environments, where none of Rolltap's packages is.
    "rolltap_vllm": {"proxy", "trainer", "shared", "tools"},
}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, wherever it sits (functions included)."""
    package = module.rsplit(".", 1)[0] if "." in module else module
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(top: str, module: str, source: str) -> list[str]:
    return [
        f"{module}:{line} imports {name}"
        for line, name in imported_modules(source, module)
        if name.split(".")[0] in FORBIDDEN[top]
    ]


def test_checker_sees_every_kind_of_import() -> None:
    # The checker itself must be able to fail: a forbidden edge in each form is caught.
    source = "import torch.nn\nfrom fastapi import FastAPI\ndef f():\n    from trainer import loop\n"
    assert violations("shared", "shared.x", source) == [
        "shared.x:1 imports torch.nn", "shared.x:2 imports fastapi", "shared.x:4 imports trainer"]
    assert violations("proxy", "proxy.routes.x", "from ...trainer import loop\n") == [
        "proxy.routes.x:1 imports trainer"]
    assert violations("proxy", "proxy.routes.x", "from . import ids\nfrom ..store import x\n") == []
    assert violations("shared", "shared.x", "import torchvision_like_name_ok\nimport rayon\n") == []


@pytest.mark.parametrize("top", sorted(FORBIDDEN))
def test_no_forbidden_imports(top: str) -> None:
    files = sorted((ROOT / top).rglob("*.py"))
    assert files, f"no Python files under {top}/"
    found = []
    for path in files:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found += violations(top, module, path.read_text())
    assert not found, "forbidden imports:\n" + "\n".join(found)


def test_proxy_app_does_not_import_torch() -> None:
    # The proxy image must not need torch: importing the app in a fresh interpreter loads none of it.
    code = ("import sys, proxy.app, proxy.main\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'verl', 'ray') if m in sys.modules)\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing proxy.app loaded {out.stdout.strip()}"
