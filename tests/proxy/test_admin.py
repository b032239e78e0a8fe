"""Admin API: token protection, replicas at run time, drain, pause/resume, active policy."""

from __future__ import annotations

import threading
import time

import httpx

from tests.conftest import ProxyFactory
from tests.proxy.test_balancer import CHAT, fault_replicas
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

AUTH = {"authorization": "Bearer t"}
SHAPE = {"message", "type", "param", "code"}


def test_admin_needs_the_token(proxy_for: ProxyFactory) -> None:
    with serve_in_thread(FaultReplica()) as (url, _):
        with proxy_for([url]) as proxy, httpx.Client() as http:
            r = http.get(f"{proxy.url}/admin/replicas")
            assert r.status_code == 401 and set(r.json()["error"]) == SHAPE
            assert http.get(f"{proxy.url}/admin/replicas", headers={"authorization": "Bearer nope"}).status_code == 401
            assert http.get(f"{proxy.url}/admin/replicas", headers=AUTH).status_code == 200
        with proxy_for([url], admin_token=None) as proxy:
            r = httpx.get(f"{proxy.url}/admin/replicas", headers=AUTH)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_add_and_remove_replicas_at_run_time(proxy_for: ProxyFactory) -> None:
    with fault_replicas(2) as [(a_url, a), (b_url, b)], proxy_for([a_url]) as proxy, httpx.Client() as http:
        added = http.post(f"{proxy.url}/admin/replicas", json={"url": b_url + "/v1", "weight_mode": "lora"},
                          headers=AUTH)
        assert added.status_code == 201 and added.json()["weight_mode"] == "lora"
        assert http.post(f"{proxy.url}/admin/replicas", json={"url": b_url}, headers=AUTH).status_code == 409
        deadline = time.monotonic() + 10
        while not all(r["healthy"] for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        removed = http.delete(f"{proxy.url}/admin/replicas", params={"url": a_url}, headers=AUTH)
        assert removed.status_code == 200 and removed.json()["state"] == "removed"
        for r in range(4):
            http.post(f"{proxy.base_url(f'n{r}', 'a')}/chat/completions", json=CHAT).raise_for_status()
        assert b.stats.requests == 4 and a.stats.requests == 0
        assert [r["url"] for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]] == [b_url]
        missing = http.delete(f"{proxy.url}/admin/replicas", params={"url": a_url}, headers=AUTH)
        assert missing.status_code == 404


def test_drain_lets_in_flight_end_then_removes(proxy_for: ProxyFactory) -> None:
    with fault_replicas(2) as [(a_url, _), (b_url, _)], proxy_for([a_url, b_url]) as proxy, httpx.Client() as http:
        slow = {**CHAT, "stream": True, "max_tokens": 8, "fault": {"delay_s": 0.1}}
        results: dict[str, str] = {}

        def stream() -> None:
            # Rollout "s" lands on the least-loaded replica: the first in order, a.
            results["text"] = http.post(f"{proxy.base_url('s', 'a')}/chat/completions", json=slow).text

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(0.3)
        busy = [r for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"] if r["in_flight"]]
        assert len(busy) == 1
        draining_url = busy[0]["url"]
        started = time.monotonic()
        r = http.post(f"{proxy.url}/admin/replicas/drain", json={"url": draining_url}, headers=AUTH)
        assert r.status_code == 200 and r.json()["state"] == "draining"
        # No new calls (not even of the rollout bound to it) go to a draining replica.
        for _ in range(3):
            http.post(f"{proxy.base_url('s', 'b')}/chat/completions", json=CHAT).raise_for_status()
        waited = http.post(f"{proxy.url}/admin/replicas/drain", json={"url": draining_url, "wait": True},
                           headers=AUTH, timeout=30)
        assert waited.status_code in (200, 404)  # removed by then (404: already gone)
        thread.join()
        assert time.monotonic() - started > 0.3  # it waited for the stream
        assert results["text"].rstrip().endswith("data: [DONE]")  # the in-flight stream ended normally
        listed = [r["url"] for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]]
        (streamed,) = http.get(f"{proxy.url}/rollout/s/attempt/a").json()["calls"]
        later = http.get(f"{proxy.url}/rollout/s/attempt/b").json()["calls"]
    assert draining_url not in listed and len(listed) == 1
    assert streamed["replica"] == draining_url and streamed["status"] == "ok"
    assert len(later) == 3 and {c["replica"] for c in later} == set(listed)


def test_pause_and_resume(proxy_for: ProxyFactory) -> None:
    with fault_replicas(1) as [(url, replica)], proxy_for([url], pool={"pause_wait_s": 0.5}) as proxy, \
            httpx.Client(timeout=30) as http:
        slow = {**CHAT, "stream": True, "max_tokens": 5, "fault": {"delay_s": 0.1}}
        in_flight = threading.Thread(target=lambda: http.post(f"{proxy.base_url('p', 'a')}/chat/completions",
                                                              json=slow).raise_for_status())
        in_flight.start()
        time.sleep(0.2)
        started = time.monotonic()
        paused = http.post(f"{proxy.url}/admin/pause", json={"wait": True}, headers=AUTH)
        assert paused.status_code == 200 and paused.json() == {"object": "rolltap.admission", "paused": True,
                                                               "in_flight": 0}
        assert time.monotonic() - started > 0.2  # waited for the stream in flight
        in_flight.join()
        # Past the deadline: 503 with Retry-After, in OpenAI's shape, recorded.
        refused = http.post(f"{proxy.base_url('p', 'a')}/chat/completions", json=CHAT)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused"
        assert int(refused.headers["retry-after"]) >= 1
        # A call arriving while paused waits, and goes through on resume.
        waiting: dict[str, int] = {}
        caller = threading.Thread(target=lambda: waiting.setdefault(
            "status", http.post(f"{proxy.base_url('p', 'a')}/chat/completions", json=CHAT).status_code))
        caller.start()
        time.sleep(0.2)
        assert "status" not in waiting
        assert http.post(f"{proxy.url}/admin/resume", headers=AUTH).json()["paused"] is False
        caller.join()
        assert waiting["status"] == 200
        calls = http.get(f"{proxy.url}/rollout/p/attempt/a").json()["calls"]
    assert [c["status"] for c in calls] == ["ok", "failed", "ok"]
    assert replica.stats.requests == 2


def test_active_policy_moves_and_stamps_records(proxy_for: ProxyFactory) -> None:
    with fault_replicas(1) as [(url, replica)], proxy_for([url]) as proxy, httpx.Client() as http:
        assert http.get(f"{proxy.url}/admin/policy", headers=AUTH).json()["version"] == 0
        http.post(f"{proxy.base_url('v', 'a')}/chat/completions", json=CHAT).raise_for_status()
        put = http.put(f"{proxy.url}/admin/policy", json={"version": 1, "served_name": "policy-v1"}, headers=AUTH)
        assert put.status_code == 200
        r = http.post(f"{proxy.base_url('v', 'a')}/chat/completions", json=CHAT)
        assert r.headers["x-rolltap-policy-version"] == "1"
        calls = http.get(f"{proxy.url}/rollout/v/attempt/a").json()["calls"]
        bad = http.put(f"{proxy.url}/admin/policy", json={"version": -1, "served_name": "x"}, headers=AUTH)
    assert [(c["policy_version"], c["served_model"]) for c in calls] == [(0, "fault-model"), (1, "policy-v1")]
    assert replica.stats.bodies[-1]["model"] == "policy-v1"
    assert bad.status_code == 400
