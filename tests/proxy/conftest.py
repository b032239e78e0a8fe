"""Fixtures of the proxy's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.db_outage import Outage, database_outage


@pytest.fixture(params=["sqlite", "postgresql"])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    """A database of each kind that the test can cut (an outage) and restore."""
    with database_outage(request.param, tmp_path) as cut:
        yield cut
