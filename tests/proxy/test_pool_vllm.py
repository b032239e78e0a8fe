"""The replica pool over two real CPU vLLM replicas: sticky balance, and a replica killed under load."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ProxyFactory
from tools.replica import VllmReplica

pytestmark = pytest.mark.vllm
AUTH = {"authorization": "Bearer t"}


def warm_up(url: str) -> None:
    """A fresh vLLM CPU server compiles kernels for the batch shapes it meets first, and is
    several times slower until then; balance is only comparable between warm replicas."""
    def one(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            _chat(http, f"{url}/v1", f"warm up {i}").raise_for_status()

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, range(64)))


@pytest.fixture(scope="module")
def second_replica(tiny_model_dir: Path, vllm_replica: Any) -> Iterator[VllmReplica]:
    # vLLM's CPU build binds its OpenMP threads to core 0 by default; two engines spinning on
    # one core starve each other unevenly (one replica served 2-20x the other). Core 1 here.
    with VllmReplica(tiny_model_dir, served_model_name="tiny",
                     extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"}) as replica:
        warm_up(replica.url)
        warm_up(vllm_replica.url)
        yield replica


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _chat(http: httpx.Client, base: str, content: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return http.post(f"{base}/chat/completions", json=body)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # placement does not depend on the backend
def test_200_rollouts_stick_and_balance(vllm_replica: Any, second_replica: VllmReplica,
                                        proxy_for: ProxyFactory) -> None:
    replicas = [vllm_replica.url, second_replica.url]
    with proxy_for(replicas) as proxy:
        def rollout(i: int) -> None:
            with httpx.Client(timeout=120) as http:
                base = proxy.base_url(f"bal-{i}", "0")
                for turn in range(3):
                    _chat(http, base, f"rollout {i} turn {turn}").raise_for_status()
                http.post(f"{proxy.url}/rollout/bal-{i}/attempt/0/finish", json={"status": "succeeded"}
                          ).raise_for_status()

        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(rollout, range(200)))
        with httpx.Client(timeout=60) as http:
            placements = [{c["replica"] for c in http.get(f"{proxy.url}/rollout/bal-{i}/attempt/0").json()["calls"]}
                          for i in range(200)]
    assert all(len(p) == 1 for p in placements), "an attempt's calls went to more than one replica"
    per_replica = Counter(next(iter(p)) for p in placements)
    assert set(per_replica) == set(replicas)
    busier, other = max(per_replica.values()), min(per_replica.values())
    assert busier <= 1.5 * other, per_replica


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # a replica restart costs ~1 min: one backend
def test_replica_killed_under_load(vllm_replica: Any, second_replica: VllmReplica, proxy_for: ProxyFactory,
                                   tiny_model_dir: Path) -> None:
    victim = second_replica
    killed_at: list[float] = []
    outcomes: list[tuple[float, str, str]] = []  # (start time, rollout, "ok" | "error_event" | other)
    lock = threading.Lock()
    stop = threading.Event()

    with proxy_for([vllm_replica.url, victim.url]) as proxy:
        def agent(n: int) -> None:
            with httpx.Client(timeout=120) as http:
                i = 0
                while not stop.is_set():
                    rollout = f"kill-{n}-{i}"
                    started = time.monotonic()
                    body = {"model": "m", "messages": [{"role": "user", "content": "tell a long story"}],
                            "max_tokens": 400, "ignore_eos": True, "stream": True}
                    with http.stream("POST", f"{proxy.base_url(rollout, '0')}/chat/completions", json=body) as r:
                        text = r.read().decode() if r.status_code == 200 else ""
                        if r.status_code != 200:
                            outcome = f"http_{r.status_code}"
                        elif '"upstream_disconnected"' in text:
                            outcome = "error_event"
                        else:
                            outcome = "ok" if text.rstrip().endswith("data: [DONE]") else "truncated"
                    with lock:
                        outcomes.append((started, rollout, outcome))
                    i += 1

        def pool_view(http: httpx.Client) -> dict[str, Any]:
            return {r["url"]: r for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]}

        with httpx.Client(timeout=60) as http:
            # Both replicas must be in the pool before the agents start: with one still unprobed,
            # every first rollout binds to the other and the victim may serve nothing before the kill.
            _wait_for(lambda: all(r["healthy"] for r in pool_view(http).values()), 30, "both replicas healthy")
            threads = [threading.Thread(target=agent, args=(n,)) for n in range(12)]
            for t in threads:
                t.start()
            # Kill only while streams run there: 400-token streams last seconds on this machine, so
            # one second after the victim holds calls, they are past their first byte.
            _wait_for(lambda: pool_view(http)[victim.url]["in_flight"] >= 3, 60, "streams on the victim")
            time.sleep(1.0)
        assert victim.proc is not None
        os.killpg(victim.proc.pid, signal.SIGKILL)  # a crash, not a shutdown
        killed_at.append(time.monotonic())
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join()
        victim.proc.wait()
        victim.proc = None

        with httpx.Client(timeout=60) as http:
            pool = {r["url"]: r for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]}
            assert pool[victim.url]["healthy"] is False  # ejected
            failed = []
            for started, rollout, outcome in outcomes:
                (call,) = http.get(f"{proxy.url}/rollout/{rollout}/attempt/0").json()["calls"]
                if outcome == "error_event":
                    failed.append(call)
                    assert call["status"] == "failed" and call["replica"] == victim.url
                    assert call["error"]["type"] == "upstream_disconnected"
                else:
                    assert outcome == "ok", (outcome, call)
                    assert call["status"] == "ok"
                if started > killed_at[0]:
                    assert outcome == "ok" and call["replica"] == vllm_replica.url  # not yet started: succeeded
            assert failed, "no stream was in flight on the killed replica"
            assert any(s > killed_at[0] for s, _, _ in outcomes)

            # Bring it back on the same port: the probes re-admit it, and it takes new rollouts again.
            revived = VllmReplica(tiny_model_dir, served_model_name="tiny", port=victim.port,
                                  extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
            revived.start()
            second_replica.proc = revived.proc  # the module fixture stops it at the end
            revived.wait_healthy(600)
            deadline = time.monotonic() + 30
            while not {r["url"]: r for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]
                       }[victim.url]["healthy"]:
                assert time.monotonic() < deadline, "the revived replica was not re-admitted"
                time.sleep(0.2)
            used = {_chat(http, proxy.base_url(f"back-{i}", "0"), "hi").status_code for i in range(6)}
            placed = {http.get(f"{proxy.url}/rollout/back-{i}/attempt/0").json()["calls"][0]["replica"]
                      for i in range(6)}
    assert used == {200}
    assert victim.url in placed
