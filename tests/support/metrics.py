"""Reading one series of the proxy's Prometheus `/metrics` text in tests."""

from __future__ import annotations

import re


def metric(body: str, name: str, default: float | None = None) -> float:
    """The value of the unlabelled series `name` in `body`; `default` when it is absent (else a failure)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", body, re.MULTILINE)
    if match is None:
        assert default is not None, f"{name} is not in the metrics"
        return default
    return float(match.group(1))
