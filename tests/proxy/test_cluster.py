"""Several real proxy processes on one PostgreSQL database behind a round-robin balancer act as one.

- three proxies, 64 agents whose calls land on all of them, a policy push and a pause
  (weight push) during the run, `finish` on a random proxy: every call recorded exactly
  once and readable from any proxy; no call stamped with a version that was not active
  while it ran; the push and the pause waited for all three;
- `finish` on one proxy waits for the attempt's call still streaming on another;
- kill -9 of one of two proxies under load: the other keeps serving; the dead one's calls in
  flight are recorded `interrupted` within the lease time, and its own journal recovery,
  when it restarts, records nothing twice and upgrades the calls it had journaled whole;
- calls a killed proxy answered but had not committed: recorded `interrupted` by the other,
  then replaced by their complete records when the killed one restarts on its disk;
- a proxy cut off from the database serves unleased only once the others see it silent, and
  `finish` on another proxy waits for it until its calls are committed.

PostgreSQL only: SQLite serves one proxy process (`--workers > 1` on it is refused, tested here).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.support.databases import postgres_database
from tests.support.fault_replica import FaultReplica
from tests.support.proxy_process import ROOT, ProxyProcess
from tests.support.round_robin import RoundRobin
from tests.support.servers import free_port, serve_in_thread
from tests.support.tcp_tap import TcpTap

AUTH = {"authorization": "Bearer t"}
DEAD_AFTER_S = 2.0
HEARTBEAT_S = 0.25
CLUSTER_ENV = {"ROLLTAP_PROXY__ADMIN_TOKEN": "t", "ROLLTAP_PROXY__CLUSTER__DEAD_AFTER_S": str(DEAD_AFTER_S),
               "ROLLTAP_PROXY__CLUSTER__HEARTBEAT_S": str(HEARTBEAT_S), "ROLLTAP_PROXY__MODEL": "fault-model"}


@dataclass
class Seen:
    rollout_id: str
    call_id: str
    version: int
    started: float  # the client's clock, around the call
    ended: float


@contextmanager
def cluster(tmp_path: Path, n_proxies: int, n_replicas: int = 2, *, faults: list[FaultReplica] | None = None,
            **env: str) -> Iterator[tuple[str, list[ProxyProcess], RoundRobin, str]]:
    """`faults`: the replicas to serve (default: `n_replicas` new ones); `env`: more proxy settings."""
    with ExitStack() as stack:
        db_url = stack.enter_context(postgres_database())
        faults = faults if faults is not None else [FaultReplica() for _ in range(n_replicas)]
        replicas = [stack.enter_context(serve_in_thread(fault))[0] for fault in faults]
        proxies = []
        for i in range(n_proxies):
            proxy = ProxyProcess(tmp_path / f"p{i}", db_url, replicas, free_port(), **{**CLUSTER_ENV, **env})
            proxy.workdir.mkdir()
            stack.callback(proxy.stop)
            proxy.start()  # one after the other: the first one migrates
            proxies.append(proxy)
        balancer = RoundRobin([p.url for p in proxies])
        url, _ = stack.enter_context(serve_in_thread(balancer))
        yield db_url, proxies, balancer, url


def _rows(db_url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(db_url) as conn:
        return list(conn.execute(sql).fetchall())


def test_three_proxies_behind_a_balancer_act_as_one(tmp_path: Path) -> None:
    with cluster(tmp_path, 3) as (db_url, proxies, balancer, lb):
        assert len(_rows(db_url, "SELECT proxy_id FROM proxies")) == 3
        seen: list[Seen] = []
        push: dict[str, float] = {}
        pause_in_flight: list[int] = []

        async def agent(i: int, client: httpx.AsyncClient) -> None:
            rid = f"r{i}"
            mine = []
            for k in range(3):
                body = {"model": "m", "messages": [{"role": "user", "content": f"{i}-{k}"}], "max_tokens": 4,
                        "stream": (i + k) % 2 == 0, "fault": {"delay_s": 0.01}}
                started = time.time()
                r = await client.post(f"{lb}/rollout/{rid}/attempt/a/v1/chat/completions", json=body)
                ended = time.time()
                assert r.status_code == 200, r.text
                mine.append(Seen(rid, r.headers["x-rolltap-call-id"], int(r.headers["x-rolltap-policy-version"]),
                                 started, ended))
            seen.extend(mine)
            finish = await client.post(f"{random.choice(proxies).url}/rollout/{rid}/attempt/a/finish",
                                       json={"status": "succeeded"})
            assert finish.status_code == 200, finish.text
            # Right after `finish` returned, from any proxy: every call, once.
            got = await client.get(f"{random.choice(proxies).url}/rollout/{rid}/attempt/a")
            ids = [c["call_id"] for c in got.json()["calls"]]
            assert sorted(ids) == sorted(s.call_id for s in mine), (ids, mine)

        async def pusher(client: httpx.AsyncClient) -> None:
            while len(seen) < 40 and sum(balancer.requests.values()) < 60:
                await asyncio.sleep(0.01)
            push["sent"] = time.time()
            r = await client.put(f"{random.choice(proxies).url}/admin/policy", headers=AUTH,
                                 json={"version": 1, "served_name": "fault-model", "kind": "lora"})
            push["returned"] = time.time()
            assert r.status_code == 200, r.text
            # The push returned only once every proxy applied it.
            for proxy in proxies:
                assert (await client.get(f"{proxy.url}/admin/policy", headers=AUTH)).json()["version"] == 1
            # A full-weight push: pause waits until all three have drained.
            r = await client.post(f"{random.choice(proxies).url}/admin/pause", headers=AUTH, json={"wait": True})
            assert r.status_code == 200, r.text
            for proxy in proxies:
                replicas = (await client.get(f"{proxy.url}/admin/replicas", headers=AUTH)).json()["data"]
                pause_in_flight.append(sum(rep["in_flight"] for rep in replicas))
            await asyncio.sleep(0.2)
            r = await client.post(f"{random.choice(proxies).url}/admin/resume", headers=AUTH)
            assert r.status_code == 200, r.text

        async def main() -> None:
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                await asyncio.gather(pusher(client), *(agent(i, client) for i in range(64)))

        asyncio.run(main())
        assert len(seen) == 64 * 3
        assert pause_in_flight == [0, 0, 0]
        # Calls landed on every proxy.
        assert {balancer.served[s.call_id] for s in seen} == {p.url for p in proxies}
        # No call stamped with a version that was not active while it ran.
        for s in seen:
            if s.version == 0:
                assert s.started < push["returned"], s
            else:
                assert s.version == 1 and s.ended > push["sent"], s
        assert {s.version for s in seen} == {0, 1}
        # Exactly once, database-wide; no lease left behind (once the last records' linger is over).
        deadline = time.monotonic() + 5
        while len(ids := [r[0] for r in _rows(db_url, "SELECT call_id FROM calls")]) < len(seen):
            assert time.monotonic() < deadline, (len(ids), len(seen))
            time.sleep(0.05)
        assert len(ids) == len(set(ids)) == len(seen)
        assert _rows(db_url, "SELECT count(*) FROM call_leases") == [(0,)]


def test_finish_on_another_proxy_waits_for_the_call_in_flight(tmp_path: Path) -> None:
    with cluster(tmp_path, 2, n_replicas=1) as (_, [a, b], _balancer, _lb), httpx.Client(timeout=60) as http:
        slow = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": True,
                "fault": {"delay_s": 0.1}}
        ended: dict[str, float] = {}

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                async def stream() -> None:
                    r = await client.post(f"{a.url}/rollout/f/attempt/a/v1/chat/completions", json=slow)
                    ended["stream"] = time.time()
                    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")

                async def finish() -> None:
                    await asyncio.sleep(0.3)  # the stream is running on A
                    r = await client.post(f"{b.url}/rollout/f/attempt/a/finish", json={"status": "succeeded"})
                    ended["finish"] = time.time()
                    assert r.status_code == 200, r.text

                await asyncio.gather(stream(), finish())

        asyncio.run(main())
        assert ended["finish"] >= ended["stream"] - 0.05
        calls = http.get(f"{b.url}/rollout/f/attempt/a").json()["calls"]
        assert [c["status"] for c in calls] == ["ok"]


def test_kill9_of_one_proxy_under_load(tmp_path: Path) -> None:
    with cluster(tmp_path, 2) as (db_url, [a, b], balancer, lb):
        turns: list[tuple[str, str | None, bool, float]] = []  # rollout, call id, complete, when it ended
        stop = asyncio.Event()
        killed: dict[str, float] = {}

        async def agent(i: int, client: httpx.AsyncClient) -> None:
            k = 0
            while not stop.is_set():
                body = {"model": "m", "messages": [{"role": "user", "content": f"{i}-{k}"}], "max_tokens": 8,
                        "stream": True, "fault": {"delay_s": 0.03}}
                call_id, complete = None, False
                try:
                    async with client.stream("POST", f"{lb}/rollout/k{i}/attempt/a/v1/chat/completions",
                                             json=body) as r:
                        call_id = r.headers.get("x-rolltap-call-id")
                        raw = b"".join([chunk async for chunk in r.aiter_raw()])
                        complete = r.status_code == 200 and raw.rstrip().endswith(b"[DONE]")
                except (httpx.TransportError, httpx.StreamError):
                    pass
                turns.append((f"k{i}", call_id, complete, time.time()))
                k += 1

        async def killer() -> None:
            await asyncio.sleep(1.5)
            await asyncio.to_thread(a.kill9)
            killed["at"] = time.time()
            await asyncio.sleep(2.0)
            stop.set()

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                await asyncio.gather(killer(), *(agent(i, client) for i in range(16)))

        asyncio.run(main())
        on_a = {cid for _, cid, _, _ in turns if cid and balancer.served.get(cid) == a.url}
        cut_on_a = {cid for _, cid, complete, _ in turns if cid in on_a and not complete}
        assert on_a and cut_on_a, "the kill should have cut calls in flight on A"
        # B kept serving: every call it took after the kill completed.
        after = [(cid, complete) for _, cid, complete, t in turns
                 if cid and balancer.served.get(cid) == b.url and t > killed["at"] + 0.2]
        assert after and all(complete for _, complete in after)

        # Within the lease time (plus a heartbeat to notice it), A's cut calls are recorded interrupted.
        deadline = killed["at"] + DEAD_AFTER_S + 2 * HEARTBEAT_S + 1.5
        while True:
            rows = dict(_rows(db_url, "SELECT call_id, status FROM calls"))
            if all(rows.get(cid) == "interrupted" for cid in cut_on_a):
                break
            assert time.time() < deadline, {cid: rows.get(cid) for cid in cut_on_a}
            time.sleep(0.1)
        # No lease outlives its call: B's last records commit (and drop their leases) once its writer's
        # linger (`recorder.linger_ms`) is over.
        while _rows(db_url, "SELECT count(*) FROM call_leases") != [(0,)]:
            assert time.time() < deadline + 2, _rows(db_url, "SELECT call_id FROM call_leases")
            time.sleep(0.05)

        def check_exactly_once() -> dict[str, str]:
            rows = _rows(db_url, "SELECT call_id, status FROM calls")
            assert len(rows) == len({cid for cid, _ in rows})
            by_id = {str(cid): str(status) for cid, status in rows}
            for _, cid, complete, _ in turns:
                if cid is None:
                    continue
                assert cid in by_id, cid
                if complete and cid not in on_a:
                    assert by_id[cid] == "ok"
            return by_id

        before = check_exactly_once()
        # A comes back: its journal recovery writes what it journaled. What the reaper wrote stays,
        # except an `interrupted` call A had journaled whole (answered, not yet committed): it is
        # upgraded to that record. The only calls it may add are ones killed between their journal
        # entry and their lease row: never sent upstream and never answered, so `interrupted`, once.
        a.start()
        time.sleep(0.5)
        after = check_exactly_once()
        for cid, status in before.items():
            assert after[cid] == status or (status, after[cid]) == ("interrupted", "ok") and cid in on_a, cid
        assert all(after[cid] == "ok" for _, cid, complete, _ in turns if complete)  # A's too, now
        answered = {cid for _, cid, _, _ in turns if cid}
        assert all(status == "interrupted" and cid not in answered
                   for cid, status in after.items() if cid not in before)


def test_an_ejection_on_one_proxy_reaches_the_others(tmp_path: Path) -> None:
    """A replica failing A's calls is ejected by A; B stops routing there within a second (its
    rollouts move to the same healthy replica on both); after the hold, A's passing probe
    re-admits it on both and the rollouts come back."""
    hold_s = 5.0  # long enough for 32 calls on a loaded machine while X is held out
    x, y = FaultReplica(), FaultReplica()
    with cluster(tmp_path, 2, faults=[x, y], ROLLTAP_PROXY__CLUSTER__EJECT_HOLD_S=str(hold_s),
                 ROLLTAP_PROXY__HEALTH_INTERVAL_S="0.2") as (db_url, [a, b], _balancer, _lb), \
            httpx.Client(timeout=60) as http:
        rollouts = [f"e{k}" for k in range(16)]

        def where(proxy: ProxyProcess, tag: str) -> dict[str, str]:
            """Send one call per rollout through `proxy`; the replica (x or y) each landed on."""
            landed = {}
            for rid in rollouts:
                content = f"{tag}-{rid}"
                r = http.post(f"{proxy.url}/rollout/{rid}/attempt/a/v1/chat/completions",
                              json={"model": "m", "messages": [{"role": "user", "content": content}]})
                assert r.status_code == 200, r.text
                [name] = [name for name, fault in (("x", x), ("y", y))
                          if any(body["messages"][0]["content"] == content for body in fault.stats.bodies)]
                landed[rid] = name
            return landed

        def replica_view(proxy: ProxyProcess) -> dict[str, object]:
            """X as `proxy` sees it: healthy by its own marks and probes; ejected by another proxy."""
            [seen] = [r for r in http.get(f"{proxy.url}/admin/replicas", headers=AUTH).json()["data"]
                      if r["url"] == x_url]
            return {"x": seen["healthy"], "x_elsewhere": seen["ejected_elsewhere"]}

        before = where(b, "before")
        assert where(a, "before-a") == before  # one binding rule on both proxies
        assert set(before.values()) == {"x", "y"}
        x_url = http.get(f"{a.url}/admin/replicas", headers=AUTH).json()["data"][0]["url"]  # in `faults` order
        on_x = next(rid for rid, name in before.items() if name == "x")

        # X fails A's calls (5xx, while its /health still passes): A ejects it after 3.
        for k in range(3):
            r = http.post(f"{a.url}/rollout/{on_x}/attempt/a/v1/chat/completions",
                          json={"model": "m", "messages": [{"role": "user", "content": f"fail-{k}"}],
                                "fault": {"status": 500}})
            assert r.status_code == 500
        ejected_at = _until(lambda: replica_view(a)["x"] is False, 5.0)
        seen_by_b = _until(lambda: replica_view(b)["x_elsewhere"] is True, 5.0)
        assert seen_by_b - ejected_at < 1.0, seen_by_b - ejected_at
        assert _rows(db_url, "SELECT count(*) FROM replica_ejections") == [(1,)]
        # While held out: every call on B and on A lands on Y; rollouts that were on Y stay.
        during = where(b, "during")
        assert set(during.values()) == {"y"}
        assert where(a, "during-a") == during
        assert time.time() - ejected_at < hold_s, "the hold ran out before the check: a slow machine"

        # After the hold A's passing probe re-admits X, on both; the rollouts go back.
        readmitted = _until(lambda: replica_view(b) == {"x": True, "x_elsewhere": False}
                            and replica_view(a)["x"] is True, hold_s + 15.0)
        assert readmitted - ejected_at >= hold_s - 0.3
        assert _rows(db_url, "SELECT count(*) FROM replica_ejections") == [(0,)]
        assert where(b, "after") == before
        assert where(a, "after-a") == before


def _until(check: Callable[[], bool], timeout_s: float) -> float:
    """Poll `check` until it holds; when it did (time.time())."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return time.time()


def test_workers_share_one_port_each_a_member(tmp_path: Path) -> None:
    with postgres_database() as db_url, serve_in_thread(FaultReplica()) as (replica, _):
        proxy = ProxyProcess(tmp_path, db_url, [replica], free_port(), **CLUSTER_ENV, ROLLTAP_PROXY__WORKERS="2")
        try:
            proxy.start()
            deadline = time.monotonic() + 30
            while len(_rows(db_url, "SELECT proxy_id FROM proxies")) < 2:
                assert time.monotonic() < deadline, proxy.log_tail()
                time.sleep(0.1)
            pids = {str(r[0]).split("-")[-2] for r in _rows(db_url, "SELECT proxy_id FROM proxies")}
            assert len(pids) == 2  # two processes
            with httpx.Client(timeout=30) as http:
                for k in range(8):
                    http.post(f"{proxy.url}/rollout/w{k}/attempt/a/v1/chat/completions",
                              json={"model": "m", "messages": [{"role": "user", "content": "x"}]}).raise_for_status()
            proxy.sigterm()
            assert proxy.wait(60) == 0, proxy.log_tail()
            assert _rows(db_url, "SELECT count(*) FROM calls") == [(8,)]
            assert _rows(db_url, "SELECT count(*) FROM proxies") == [(0,)]  # both left the registry
        finally:
            proxy.stop()


def test_several_workers_on_sqlite_are_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "proxy.main", "--db", f"sqlite:///{tmp_path / 'r.db'}",
                          "--replica", "http://127.0.0.1:9", "--workers", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--workers > 1 needs PostgreSQL" in run.stderr


@pytest.mark.parametrize("n_replicas", [2, 3, 4, 8])
def test_rollouts_spread_evenly_over_replicas(n_replicas: int) -> None:
    """The rule every proxy applies alike (a hash ring): busiest / least busy stays <= 1.5x."""
    from proxy.balancer import Balancer
    from proxy.upstream import Upstream
    from shared.settings import ProxySettings

    settings = ProxySettings()
    urls = [f"http://10.0.0.{i}:8000" for i in range(n_replicas)]
    balancer = Balancer(urls, Upstream(settings), settings.pool, 1.0)
    balancer.hash_rollouts = True
    for replica in balancer.replicas:
        replica.is_healthy = True
    counts = {u: 0 for u in urls}
    for k in range(4000):
        counts[balancer.pick(f"rollout-{k}", "a").url] += 1
    assert max(counts.values()) / min(counts.values()) <= 1.5, counts
    # The same rollout, asked of another proxy's balancer, lands on the same replica.
    other = Balancer(list(reversed(urls)), Upstream(settings), settings.pool, 1.0)
    other.hash_rollouts = True
    for replica in other.replicas:
        replica.is_healthy = True
    assert all(other.pick(f"rollout-{k}").url == balancer.pick(f"rollout-{k}").url for k in range(200))
    # Ejecting a replica moves only its own rollouts.
    gone = urls[0]
    balancer.mark_unreachable(balancer.get(gone), "test")
    other.mark_unreachable(other.get(gone), "test")
    assert all(other.pick(f"rollout-{k}").url == balancer.pick(f"rollout-{k}").url != gone for k in range(200))


def test_a_restarted_proxy_upgrades_the_survivors_interrupted_records(tmp_path: Path) -> None:
    """Calls the client saw complete on a proxy killed before it committed them: the survivor records
    them `interrupted` (it cannot know better), and the killed proxy, restarted on its disk, replaces
    them with the complete records from its journal (same call ids and seqs; only interrupted -> ok)."""
    with ExitStack() as stack:
        db_url = stack.enter_context(postgres_database())
        replica = stack.enter_context(serve_in_thread(FaultReplica()))[0]
        # A holds its records 5 s before writing them (linger): the kill lands in that window.
        a = ProxyProcess(tmp_path / "a", db_url, [replica], free_port(), **CLUSTER_ENV,
                         ROLLTAP_PROXY__RECORDER__LINGER_MS="5000")
        b = ProxyProcess(tmp_path / "b", db_url, [replica], free_port(), **CLUSTER_ENV)
        for proxy in (a, b):
            proxy.workdir.mkdir()
            stack.callback(proxy.stop)
            proxy.start()
        calls: dict[str, str] = {}
        with httpx.Client(timeout=30) as http:
            for i in range(6):
                body = {"model": "m", "messages": [{"role": "user", "content": f"u{i}"}], "max_tokens": 4,
                        "stream": i % 2 == 0}
                answer = http.post(f"{a.url}/rollout/up{i}/attempt/0/v1/chat/completions", json=body)
                assert answer.status_code == 200
                calls[answer.headers["x-rolltap-call-id"]] = f"up{i}"
            a.kill9()
            deadline = time.monotonic() + DEAD_AFTER_S + 10
            while {str(s) for _, s in _rows(db_url, "SELECT call_id, status FROM calls")} != {"interrupted"} \
                    or len(_rows(db_url, "SELECT call_id FROM calls")) < len(calls):
                assert time.monotonic() < deadline, _rows(db_url, "SELECT call_id, status FROM calls")
                time.sleep(0.1)
            seqs = dict(_rows(db_url, "SELECT call_id, seq FROM calls"))
            finished = http.post(f"{b.url}/rollout/up0/attempt/0/finish", json={"status": "succeeded"}).json()
            assert finished["is_complete"] is False and finished["interrupted_calls"] == 1

            a.start()  # recovery runs before /healthz answers
            rows = {str(cid): (str(status), seq, tokens) for cid, status, seq, tokens in _rows(
                db_url, "SELECT call_id, status, seq, completion_token_ids FROM calls")}
            assert set(rows) == set(calls)  # nothing twice, nothing new
            for call_id, (status, seq, tokens) in rows.items():
                assert status == "ok" and seq == seqs[call_id]
                streamed = int(calls[call_id][2:]) % 2 == 0
                assert tokens == ([100, 101, 102, 103] if streamed else [7])  # the full record
            again = http.get(f"{b.url}/rollout/up1/attempt/0").json()
            assert [c["status"] for c in again["calls"]] == ["ok"]


def test_finish_waits_for_a_proxy_cut_off_from_the_database(tmp_path: Path) -> None:
    """A proxy that cannot write lease rows still serves (its records wait in its spool), but `finish`
    on another proxy does not call the attempt complete until the cut-off one has committed them."""
    with ExitStack() as stack:
        db_url = stack.enter_context(postgres_database())
        replica = stack.enter_context(serve_in_thread(FaultReplica()))[0]
        parsed = make_url(db_url)
        tap = stack.enter_context(TcpTap(parsed.host or "127.0.0.1", parsed.port or 5432))
        tapped = parsed.set(host="127.0.0.1", port=tap.port).render_as_string(hide_password=False)
        b = ProxyProcess(tmp_path / "b", db_url, [replica], free_port(), **CLUSTER_ENV,
                         ROLLTAP_PROXY__FINISH_TIMEOUT_S="1")
        a = ProxyProcess(tmp_path / "a", tapped, [replica], free_port(), **CLUSTER_ENV,
                         ROLLTAP_PROXY__RECORDER__RETRY_INTERVAL_S="0.2")
        for proxy in (b, a):
            proxy.workdir.mkdir()
            stack.callback(proxy.stop)
            proxy.start()
        with httpx.Client(timeout=30) as http:
            tap.cut()
            body = {"model": "m", "messages": [{"role": "user", "content": "cut"}], "max_tokens": 3, "stream": True}
            answer = http.post(f"{a.url}/rollout/cut/attempt/0/v1/chat/completions", json=body)
            assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
            call_id = answer.headers["x-rolltap-call-id"]
            refused = http.post(f"{b.url}/rollout/cut/attempt/0/finish", json={"status": "succeeded"})
            assert refused.status_code == 503, refused.text  # not "complete" with the call still on A
            assert refused.headers["retry-after"] == "1"
            assert _rows(db_url, "SELECT call_id FROM calls") == []

            tap.restore()
            deadline = time.monotonic() + 30
            while (finished := http.post(f"{b.url}/rollout/cut/attempt/0/finish",
                                         json={"status": "succeeded"})).status_code == 503:
                assert time.monotonic() < deadline, finished.text
                time.sleep(0.2)
            assert finished.status_code == 200 and finished.json()["is_complete"] is True
            assert _rows(db_url, "SELECT call_id, status FROM calls") == [(call_id, "ok")]
