"""The proxy's OpenAPI document is honest: schemathesis fuzzes every route against it.

Bounded (a few examples per operation, seconds in all): 0 server errors, and every answer
conforms to the document (status code, content type, headers, body schema).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_settings
from tests.support.fault_replica import FaultReplica
from tests.support.servers import RunningProxy, run_proxy, serve_in_thread

KEY = "rk-openapi-test-agent-key-000000000000000000000000"
ADMIN = "adm-openapi-test"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    tmp = tmp_path_factory.mktemp("openapi")
    with serve_in_thread(FaultReplica()) as (replica, _):
        conf = make_settings(f"sqlite:///{tmp / 'rolltap.db'}", [replica], Path(tmp), open_access=False,
                             agent_key=KEY, admin_token=ADMIN, finish_timeout_s=2,
                             pool={"pause_wait_s": 0.2}, limits={"call_timeout_s": 10})
        with run_proxy(conf) as running:
            yield running


def test_document_lists_every_route_with_its_real_codes(proxy: RunningProxy) -> None:
    doc = httpx.get(f"{proxy.url}/openapi.json").json()
    paths = doc["paths"]
    for route in ("chat/completions", "completions", "messages", "models"):
        assert f"/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1/{route}" in paths
    for route in ("chat/completions", "completions", "messages", "responses", "embeddings", "models"):
        assert f"/v1/{route}" in paths
    for path, item in paths.items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            assert {"404", "431"} <= set(op["responses"]), (method, path)
            if path.startswith("/rollout"):
                assert {"400", "401", "403"} <= set(op["responses"]) and op["security"], (method, path)
    assert set(doc["components"]["securitySchemes"]) == {"AgentKey", "AgentApiKey", "AdminToken", "AdapterToken"}


def test_schemathesis_finds_no_server_error_and_no_schema_violation(proxy: RunningProxy) -> None:
    import schemathesis
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{proxy.url}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance]
    # The agent key in x-api-key and the admin token in Authorization: every route is reached past its guard.
    headers = {"x-api-key": KEY, "authorization": f"Bearer {ADMIN}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25
    tried = 0
    for operation in operations:
        if operation.path == "/admin/pause":
            continue  # pausing admission would turn the rest of the run into 503s after each wait

        @given(case=operation.as_strategy(), with_headers=st.booleans())
        @settings(max_examples=8, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case, with_headers: bool) -> None:
            nonlocal tried
            tried += 1
            case.call_and_validate(base_url=proxy.url, headers=headers if with_headers else None, checks=checks,
                                   timeout=30)

        run()
    assert tried >= 100
