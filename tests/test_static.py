"""Static checks, run with the tests and so in CI: ruff and `mypy --strict`, both configured in pyproject.toml.

A call to an undefined name went unnoticed until these ran; they are tests so that `make test` fails on one.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str, timeout_s: float) -> None:
    command = [sys.executable, "-m", *args]
    t0 = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    took_s = time.monotonic() - t0
    assert done.returncode == 0, (
        f"`{' '.join(args)}` exited {done.returncode} after {took_s:.0f} s:\n{done.stdout}{done.stderr}")


def test_ruff() -> None:
    # The whole repository ([tool.ruff] excludes virtualenvs and build output).
    _check("ruff", "check", ".", timeout_s=120)


def test_mypy_strict() -> None:
    # One run over [tool.mypy]'s files (shared, proxy, trainer), strict. From the repository root its
    # incremental cache is .mypy_cache there (gitignored): about 90 s cold on 2 cores, seconds after.
    _check("mypy", timeout_s=600)
