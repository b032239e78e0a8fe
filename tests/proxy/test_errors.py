"""Bad input gets a 4xx/5xx in OpenAI's error shape; the proxy keeps serving; nothing is lost."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import free_port, serve_in_thread

SHAPE = {"message", "type", "param", "code"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _assert_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == SHAPE
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", [
    "/rollout/bad%20id/attempt/a1/v1/chat/completions",
    "/rollout/r1/attempt/" + "x" * 129 + "/v1/chat/completions",
    "/rollout/r%C3%A9/attempt/a1/v1/completions",
    "/rollout/r1/attempt/a%24/finish",
])
def test_invalid_ids(proxy_for: ProxyFactory, path: str) -> None:
    with serve_in_thread(FaultReplica()) as (url, _), proxy_for([url]) as proxy:
        error = _assert_error(httpx.post(proxy.url + path, json=CHAT), 400)
        assert error["code"] == "invalid_id"
        assert httpx.get(proxy.url + "/healthz").status_code == 200


def test_bad_bodies_and_routes(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy, httpx.Client() as http:
        base = proxy.base_url("e1", "a1")
        assert _assert_error(http.post(f"{base}/chat/completions", content=b"{not json"), 400)["code"] == "invalid_json"
        assert _assert_error(http.post(f"{base}/chat/completions", content=b"[1, 2]"), 400)["code"] == "invalid_body"
        assert _assert_error(http.post(f"{base}/chat/completions", content=b'"s"'), 400)["code"] == "invalid_body"
        _assert_error(http.get(f"{proxy.url}/nowhere"), 404)
        _assert_error(http.post(f"{base}/embeddings-nope", json={}), 404)
        _assert_error(http.get(f"{base}/chat/completions"), 405)
        _assert_error(http.post(f"{proxy.url}/rollouts", json={"rollout_id": "bad id"}), 400)
        _assert_error(http.post(f"{proxy.url}/rollouts", content=b"{"), 400)
        _assert_error(http.get(f"{proxy.url}/rollout/none/attempt/none"), 404)
        # Replica errors pass through unchanged and are recorded as such.
        r = http.post(f"{base}/chat/completions", json={**CHAT, "fault": {"status": 422}})
        assert r.status_code == 422 and r.json()["error"]["message"] == "injected"
        # Still serving, and every call that reached the proxy with valid ids was recorded.
        assert http.post(f"{base}/chat/completions", json=CHAT).status_code == 200
        calls = http.get(f"{proxy.url}/rollout/e1/attempt/a1").json()["calls"]
    assert [c["status"] for c in calls] == ["invalid_request"] * 3 + ["upstream_error", "ok"]
    assert calls[3]["http_status"] == 422 and calls[3]["error"]["message"] == "injected"
    assert calls[0]["request"] == {"raw": "{not json"}


def test_unreachable_replica(proxy_for: ProxyFactory) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for([dead]) as proxy, httpx.Client() as http:
        error = _assert_error(http.post(f"{proxy.base_url('e2', 'a1')}/chat/completions", json=CHAT), 503)
        assert error["type"] == "upstream_unavailable"
        _assert_error(http.post(f"{proxy.base_url('e2', 'a1')}/chat/completions", json={**CHAT, "stream": True}), 503)
        ready = http.get(f"{proxy.url}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["replica"] is False
        assert http.get(f"{proxy.url}/healthz").status_code == 200
        calls = http.get(f"{proxy.url}/rollout/e2/attempt/a1").json()["calls"]
    assert [(c["status"], c["http_status"]) for c in calls] == [("failed", 503), ("failed", 503)]


def test_replica_dies_mid_stream(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy, httpx.Client() as http:
        body = {**CHAT, "stream": True, "max_tokens": 10, "fault": {"drop_after": 3}}
        r = http.post(f"{proxy.base_url('e3', 'a1')}/chat/completions", json=body)
        assert r.status_code == 200
        events = [line for line in r.text.split("\n\n") if line]
        assert len(events) == 4 and '"error"' in events[-1] and "upstream_disconnected" in events[-1]
        (call,) = http.get(f"{proxy.url}/rollout/e3/attempt/a1").json()["calls"]
    assert call["status"] == "failed" and call["error"]["type"] == "upstream_disconnected"
    assert call["completion_token_ids"] == [100, 101, 102]
