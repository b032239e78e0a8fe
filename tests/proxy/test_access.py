"""A closed proxy: only the inference API is relayed, and agent keys guard every agent route.

Real proxy under uvicorn, a fault-injecting replica that lists every path it was asked
for (so "never reached a replica" is checked on the replica's side), both databases.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.keystore import cli as keys_cli
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

AGENT_KEY = "rk-test-unscoped-agent-key-000000000000000000000"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def replica() -> Iterator[tuple[str, FaultReplica]]:
    fault = FaultReplica()
    with serve_in_thread(fault) as (url, _):
        yield url, fault


def raw_request(base: str, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """A request whose path goes on the wire exactly as written (httpx would resolve `..`)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(data) if data else None
    finally:
        conn.close()


def assert_openai_error(body: Any, code: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if code is not None:
        assert body["error"]["code"] == code, body


def create_key(db_url: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    assert keys_cli(["--db", db_url, "create", *args]) == 0
    out = capsys.readouterr().out
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return fields["id"], fields["key"]


def test_control_routes_never_reach_a_replica(proxy_for: ProxyFactory, replica: tuple[str, FaultReplica]) -> None:
    url, fault = replica
    with proxy_for([url]) as proxy:  # open access, and an admin token is configured: neither opens these
        before = list(fault.stats.paths)
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/../pause", "/v1/%2e%2e/collective_rpc",
                     "/v1/%2E%2E/reset_prefix_cache", "/v1/./../sleep", "/v1/chat/completions/../../resume",
                     "/rollout/r/attempt/../v1/chat/completions", "/rollout/../attempt/0/v1/completions",
                     "/v1/%2e%2e/metrics"):
            for method in ("POST", "GET"):
                status, _, body = raw_request(proxy.url, method, path, {"authorization": "Bearer t"}, b"{}")
                assert status in (404, 405), (method, path, status, body)
                assert_openai_error(body)
        assert fault.stats.paths == before  # the replica saw none of them
        # The inference API still goes through.
        assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert fault.stats.paths[len(before):] == ["/v1/chat/completions"]


def test_replica_control_only_through_the_admin_api(proxy_for: ProxyFactory,
                                                     replica: tuple[str, FaultReplica]) -> None:
    url, fault = replica
    with proxy_for([url], open_access=False, agent_key=AGENT_KEY) as proxy, \
            httpx.Client(base_url=f"{proxy.url}/admin", timeout=30) as admin:
        control = {"url": url, "action": "load_lora_adapter", "body": {"lora_name": "p1", "lora_path": "/x"}}
        for headers in ({}, {"authorization": f"Bearer {AGENT_KEY}"}, {"x-api-key": AGENT_KEY}):
            r = admin.post("/replicas/control", json=control, headers=headers)
            assert r.status_code == 401, r.text
        assert fault.stats.paths == []
        as_admin = {"authorization": "Bearer t"}
        r = admin.post("/replicas/control", json=control, headers=as_admin)
        assert r.status_code == 200 and r.json()["replica_status"] == 200, r.text
        for action, params in (("pause", {"mode": "wait"}), ("collective_rpc", None), ("reset_prefix_cache", None),
                               ("resume", None)):
            r = admin.post("/replicas/control", json={"url": url, "action": action, "params": params},
                           headers=as_admin)
            assert r.status_code == 200, r.text
        assert fault.stats.paths == ["/v1/load_lora_adapter", "/pause", "/collective_rpc", "/reset_prefix_cache",
                                     "/resume"]
        assert fault.stats.bodies[0] == {"lora_name": "p1", "lora_path": "/x"}
        r = admin.post("/replicas/control", json={"url": url, "action": "load_lora_adapter",
                                                  "body": {"fault": {"status": 400}}}, headers=as_admin)
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_refused"
        r = admin.post("/replicas/control", json={"url": "http://127.0.0.1:9", "action": "resume"}, headers=as_admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_replica"
        r = admin.post("/replicas/control", json={"url": url, "action": "shutdown"}, headers=as_admin)
        assert r.status_code == 400  # only the fixed set of actions


def test_random_paths_add_no_metric_series(proxy_for: ProxyFactory, replica: tuple[str, FaultReplica]) -> None:
    with proxy_for([replica[0]]) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
        client.post("/v1/chat/completions", json=CHAT)
        series_before = client.get("/metrics").text.count("\n")
        for i in range(1000):
            status = client.request("POST" if i % 2 else "GET", f"/v1/x{i}/y{i * 7}", json={}).status_code
            assert status == 404
        assert client.get("/metrics").text.count("\n") == series_before


def test_405_carries_allow(proxy_for: ProxyFactory, replica: tuple[str, FaultReplica]) -> None:
    with proxy_for([replica[0]]) as proxy:
        r = httpx.get(f"{proxy.url}/v1/chat/completions", timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert_openai_error(r.json(), "method_not_allowed")
        r = httpx.delete(f"{proxy.url}/rollout/a/attempt/0/finish", timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_keys_guard_every_agent_route(proxy_for: ProxyFactory, replica: tuple[str, FaultReplica], db_url: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    url, fault = replica
    with proxy_for([url], open_access=False, agent_key=AGENT_KEY, keys_refresh_s=0.3) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        # No key, a wrong key: 401 everywhere an agent goes.
        for headers in ({}, {"authorization": "Bearer rk-wrong"}, {"x-api-key": "rk-wrong"}):
            for method, path, body in (
                ("POST", "/rollout/team-a-1/attempt/0/v1/chat/completions", CHAT),
                ("GET", "/rollout/team-a-1/attempt/0/v1/models", None),
                ("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                ("POST", "/rollout/team-a-1/attempt/0/reward", {"value": 1}),
                ("POST", "/rollout/team-a-1/attempt/0/finish", {"status": "succeeded"}),
                ("GET", "/rollout/team-a-1/attempt/0", None),
                ("POST", "/rollouts", {"rollout_id": "team-a-1"}),
            ):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                assert_openai_error(r.json())
        assert fault.stats.requests == 0

        key_a_id, key_a = create_key(db_url, capsys, "--name", "team a", "--rollout-prefix", "team-a-")
        as_a = {"authorization": f"Bearer {key_a}"}
        time.sleep(1.0)  # unknown keys reload the cache at most once a second; the wrong keys above just did
        # A key scoped to team-a- works there (Bearer or x-api-key) and nowhere else.
        assert client.post("/rollouts", json={"rollout_id": "team-a-1"}, headers=as_a).status_code == 200
        ok = client.post("/rollout/team-a-1/attempt/0/v1/chat/completions", json=CHAT, headers=as_a)
        assert ok.status_code == 200, ok.text
        assert client.post("/rollout/team-a-1/attempt/0/v1/chat/completions", json=CHAT,
                           headers={"x-api-key": key_a}).status_code == 200
        assert client.post("/rollout/team-a-1/attempt/0/reward", json={"value": 1}, headers=as_a).status_code == 200
        assert client.post("/rollout/team-a-1/attempt/0/finish", json={}, headers=as_a).status_code == 200
        read = client.get("/rollout/team-a-1/attempt/0", headers=as_a)
        assert read.status_code == 200 and len(read.json()["calls"]) == 2
        for method, path, body in (
            ("POST", "/rollout/team-b-1/attempt/0/v1/chat/completions", CHAT),
            ("POST", "/rollout/team-b-1/attempt/0/reward", {"value": 1}),
            ("POST", "/rollout/team-b-1/attempt/0/finish", {}),
            ("GET", "/rollout/team-b-1/attempt/0", None),
            ("POST", "/rollouts", {"rollout_id": "team-b-1"}),
            ("POST", "/v1/chat/completions", CHAT),  # untracked calls need an unscoped key
        ):
            r = client.request(method, path, json=body, headers=as_a)
            assert r.status_code == 403, (path, r.text)
            assert_openai_error(r.json(), "key_scope")
        # An agent key is no admin token.
        for key in (key_a, AGENT_KEY):
            r = client.get("/admin/replicas", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        # The configured key (proxy.agent_key) is unscoped.
        unscoped = {"authorization": f"Bearer {AGENT_KEY}"}
        assert client.post("/v1/chat/completions", json=CHAT, headers=unscoped).status_code == 200
        assert client.get("/rollout/team-b-1/attempt/0/v1/models", headers=unscoped).status_code == 200

        # Keys are never forwarded to the replica nor recorded.
        assert all("authorization" not in h and "x-api-key" not in h for h in fault.stats.headers)
        assert key_a not in read.text and AGENT_KEY not in read.text

        # Revoked: refused within keys_refresh_s.
        assert keys_cli(["--db", db_url, "revoke", key_a_id]) == 0
        listed = capsys.readouterr()
        assert keys_cli(["--db", db_url, "list"]) == 0
        listing = capsys.readouterr().out
        assert key_a_id in listing and "team-a-" in listing and key_a not in listing and "revoked" in listed.out
        time.sleep(0.8)
        r = client.post("/rollout/team-a-1/attempt/0/v1/chat/completions", json=CHAT, headers=as_a)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_scoped_key_registers_only_groups_under_its_prefix(proxy_for: ProxyFactory,
                                                             replica: tuple[str, FaultReplica], db_url: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Otherwise team a's attempts could join team b's group and change its advantages."""
    url, _ = replica
    with proxy_for([url], open_access=False, agent_key=AGENT_KEY) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        _, key_a = create_key(db_url, capsys, "--name", "team a", "--rollout-prefix", "team-a-")
        as_a = {"authorization": f"Bearer {key_a}"}
        time.sleep(1.0)  # unknown keys reload the cache at most once a second
        for group in ("team-b-g", "team-a", "g", "TEAM-A-g"):
            r = client.post("/rollouts", json={"rollout_id": "team-a-1", "group_id": group}, headers=as_a)
            assert r.status_code == 403, (group, r.text)
            assert_openai_error(r.json(), "group_out_of_scope")
            assert r.json()["error"]["param"] == "group_id"
        for rollout, group in (("team-a-1", "team-a-g"), ("team-a-2", None)):
            r = client.post("/rollouts", json={"rollout_id": rollout, "group_id": group}, headers=as_a)
            assert r.status_code == 200, r.text
            assert r.json()["group_id"] == group or rollout
        # An unscoped key registers any group.
        unscoped = {"authorization": f"Bearer {AGENT_KEY}"}
        r = client.post("/rollouts", json={"rollout_id": "team-b-1", "group_id": "team-a-g"}, headers=unscoped)
        assert r.status_code == 200 and r.json()["group_id"] == "team-a-g"
        # Only what was allowed reached the database: team-a-1 joined its own group.
        assert client.post("/rollout/team-a-1/attempt/0/finish", json={}, headers=as_a).status_code == 200
        assert client.get("/rollout/team-a-1/attempt/0", headers=as_a).json()["group_id"] == "team-a-g"


def test_calls_in_flight_per_key_and_overall(proxy_for: ProxyFactory, replica: tuple[str, FaultReplica],
                                             db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = replica
    with proxy_for([url], open_access=False, limits={"max_calls_in_flight": 2}) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        _, key = create_key(db_url, capsys, "--max-concurrency", "1")
        _, other = create_key(db_url, capsys)
        time.sleep(1.0)  # the proxy loaded its keys at start, under a second ago
        slow = {**CHAT, "stream": True, "max_tokens": 6, "fault": {"delay_s": 0.15}}
        started = threading.Event()
        statuses: list[int] = []

        def stream(rollout: str, agent: str) -> None:
            with httpx.stream("POST", f"{proxy.url}/rollout/{rollout}/attempt/0/v1/chat/completions", json=slow,
                              headers={"authorization": f"Bearer {agent}"}, timeout=30) as r:
                started.set()
                statuses.append(r.status_code)
                r.read()

        first = threading.Thread(target=stream, args=("lim-1", key))
        first.start()
        assert started.wait(10)
        r = client.post("/rollout/lim-2/attempt/0/v1/chat/completions", json=CHAT,
                        headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert_openai_error(r.json(), "key_concurrency")
        started.clear()
        second = threading.Thread(target=stream, args=("lim-3", other))
        second.start()
        assert started.wait(10)
        r = client.post("/rollout/lim-4/attempt/0/v1/chat/completions", json=CHAT,
                        headers={"authorization": f"Bearer {other}"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert_openai_error(r.json(), "proxy_busy")
        first.join(30)
        second.join(30)
        assert statuses == [200, 200]
        # The refused calls are recorded as such; the streams that held the slots are whole.
        for rollout, status, http_status in (("lim-1", "ok", 200), ("lim-2", "failed", 429), ("lim-3", "ok", 200),
                                             ("lim-4", "failed", 503)):
            calls = client.get(f"/rollout/{rollout}/attempt/0",
                               headers={"authorization": f"Bearer {other}"}).json()["calls"]
            assert [(c["status"], c["http_status"]) for c in calls] == [(status, http_status)], rollout
        # Slots are given back: the key works again.
        assert client.post("/rollout/lim-5/attempt/0/v1/chat/completions", json=CHAT,
                           headers={"authorization": f"Bearer {key}"}).status_code == 200
