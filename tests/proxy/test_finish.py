"""`finish` is a flush barrier: when it returns, another connection reads every call."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.metrics import metric
from tests.support.servers import serve_in_thread


def _count(db_url: str, rollout_id: str) -> tuple[int, str | None]:
    engine = create_engine(sync_url(db_url))
    try:
        with engine.connect() as conn:
            calls = conn.execute(text("SELECT count(*) FROM calls WHERE rollout_id = :r"), {"r": rollout_id}).scalar()
            status = conn.execute(text("SELECT status FROM attempts WHERE rollout_id = :r"), {"r": rollout_id}).scalar()
    finally:
        engine.dispose()
    return int(calls or 0), status


@pytest.mark.vllm
def test_finish_waits_until_calls_are_readable(vllm_replica: Any, proxy_for: ProxyFactory, db_url: str) -> None:
    # A lingering writer: without the barrier, finish would return before the records land.
    with proxy_for([vllm_replica.url], recorder={"linger_ms": 400}) as proxy, httpx.Client(timeout=60) as http:
        base = proxy.base_url("f1", "a1")
        for stream in (False, True, False):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
            assert http.post(f"{base}/chat/completions", json=body).status_code == 200
        r = http.post(f"{proxy.url}/rollout/f1/attempt/a1/finish", json={"status": "succeeded", "reward": 0.5})
        assert r.status_code == 200, r.text
        assert _count(db_url, "f1") == (3, "succeeded")
        attempt = http.get(f"{proxy.url}/rollout/f1/attempt/a1").json()
    assert attempt["rewards"][0]["value"] == 0.5 and attempt["rewards"][0]["name"] == "final"


def test_finish_waits_for_a_call_still_in_flight(proxy_for: ProxyFactory, db_url: str) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy:
        body = {"model": "m", "messages": [], "stream": True, "max_tokens": 10, "fault": {"delay_s": 0.1}}
        done = threading.Event()

        def slow_call() -> None:
            with httpx.stream("POST", f"{proxy.base_url('f2', 'a1')}/chat/completions", json=body) as r:
                r.read()
            done.set()

        thread = threading.Thread(target=slow_call)
        thread.start()
        time.sleep(0.3)  # the stream is under way
        r = httpx.post(f"{proxy.url}/rollout/f2/attempt/a1/finish", json={"status": "failed"}, timeout=30)
        assert r.status_code == 200
        assert done.is_set()  # finish waited for the stream to end ...
        assert _count(db_url, "f2") == (1, "failed")  # ... and for its record
        thread.join()


def test_finish_twice_and_bad_bodies(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy, httpx.Client() as http:
        finish = f"{proxy.url}/rollout/f3/attempt/a1/finish"
        assert http.post(finish, json={"status": "succeeded"}).status_code == 200
        assert http.post(finish, json={"status": "succeeded"}).status_code == 200  # idempotent retry
        again = http.post(finish, json={"status": "failed"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_finished"
        bad = http.post(finish, json={"status": "great"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
        nan = http.post(f"{proxy.url}/rollout/f3/attempt/a1/reward", content=b'{"value": NaN}',
                        headers={"content-type": "application/json"})
        assert nan.status_code == 400 and set(nan.json()["error"]) == {"message", "type", "param", "code"}


def _batches(proxy_url: str) -> float:
    """Transactions the recorder has committed record batches in (its write-time histogram's count)."""
    return metric(httpx.get(f"{proxy_url}/metrics").text, "rolltap_recorder_write_seconds_count")


def test_a_lingering_batch_is_cut_short_by_whoever_waits_on_it(proxy_for: ProxyFactory, db_url: str) -> None:
    """Records of calls ending close together share a transaction (the writer lingers for them), and
    nobody waits out the linger: `finish` and lifecycle writes (a reward) have it written at once."""
    replica = FaultReplica()
    linger_s = 5.0
    with serve_in_thread(replica) as (url, _), proxy_for([url], recorder={"linger_ms": linger_s * 1000}) as proxy, \
            httpx.Client(timeout=30) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        batches = _batches(proxy.url)
        for attempt in ("a1", "a1", "a2"):
            assert http.post(f"{proxy.base_url('lg', attempt)}/chat/completions", json=body).status_code == 200
        time.sleep(0.3)
        assert _count(db_url, "lg")[0] == 0  # the batch lingers for companions
        started = time.monotonic()
        reward = http.post(f"{proxy.url}/rollout/lg/attempt/a2/reward", json={"value": 1.0})
        assert reward.status_code == 200, reward.text
        assert time.monotonic() - started < linger_s / 2  # the reward's write took the batch with it
        assert _count(db_url, "lg")[0] == 3
        assert _batches(proxy.url) == batches + 1  # three calls, one transaction

        # A finish barrier: its attempt's record goes at once too, without waiting out the linger.
        assert http.post(f"{proxy.base_url('lg2', 'a1')}/chat/completions", json=body).status_code == 200
        started = time.monotonic()
        r = http.post(f"{proxy.url}/rollout/lg2/attempt/a1/finish", json={"status": "succeeded"})
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < linger_s / 2
        assert _count(db_url, "lg2") == (1, "succeeded")
