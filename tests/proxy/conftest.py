"""Fixtures of the proxy's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.db_outage import Outage, database_outage
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread


@pytest.fixture(params=["sqlite", "postgresql"])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    """A database of each kind that the test can cut (an outage) and restore."""
    with database_outage(request.param, tmp_path) as cut:
        yield cut


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    """A fault replica (`tests/support/fault_replica.py`) shared by the tests of one module."""
    with serve_in_thread(FaultReplica()) as (url, _):
        yield url
