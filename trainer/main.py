"""`rolltap-trainer` (placeholder until the data path lands)."""

from __future__ import annotations


def main() -> None:
    raise SystemExit("rolltap-trainer: no commands yet")
