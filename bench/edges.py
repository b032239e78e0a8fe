"""At the edges (issue 22): 64 streaming agents while PostgreSQL, a proxy or the proxy's disk fails.

    PYTHONPATH=$PWD .venv/bin/python -m bench.edges [--scenario {pg-immediate,kill-restart,disk-full,all}] \\
        [--agents 64] [--down-s S] [--duration-s S] [--out docs/bench-results/edges-<date>.json]

Real `rolltap-proxy` processes (`python -m proxy.main`) on a private PostgreSQL cluster
(initdb in a temporary directory; the shared server is never touched), in-process fault
replicas streaming 8 chunks 50 ms apart (so calls are in flight when the fault lands).
Each agent loops over attempts of 3 streamed calls (httpx, raw bytes: a stream is whole
only if it ends with `[DONE]`), then `finish`. A call refused before it started (503, 507;
502 from the balancer when its backend is dead; no answer at all) is sent again after its
`Retry-After` (0.2 s without one); `finish` is retried on 503 after its `Retry-After`. When
the run ends, each agent completes its attempt and its `finish` (given up after 120 s).

* pg-immediate: `pg_ctl -m immediate` at mid-run, started again `--down-s` (30 s) later;
* kill-restart: two proxies on the database (cluster, lease 2 s, heartbeat 0.25 s) behind
  `tests/support/round_robin.py`; `kill -9` of one 10 s in, once it has calls upstream (up to
  10 s more), restarted on the same workdir `--down-s` (10 s) later;
* disk-full: one proxy whose spool (and journal) is on a tmpfs of `--disk-size`, filled at
  mid-run for `--down-s` (30 s), then freed; `/readyz` and `/admin/replicas` sampled.

Afterwards every attempt is checked through the proxy's API (`check_attempts`: a call seen
complete is recorded `ok` exactly once, a started one is recorded, seqs 0..n-1,
`is_complete` right) and the database is read for the counts. Each scenario prints one
summary line; all are written as JSON to `--out`. Exit status 1 on any violation, and on a
run where the fault was never hit (nothing would have been shown).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.harness import REPO_ROOT, free_port, http_get, machine
from tests.support.fault_replica import FaultReplica
from tests.support.private_pg import PrivatePostgres
from tests.support.proxy_process import (
    AgentLog,
    ProxyProcess,
    check_attempts,
    stream_turn,
)
from tests.support.round_robin import RoundRobin
from tests.support.servers import serve_in_thread
from tests.support.small_disk import small_disk

TURNS = 3
REFUSED = {502, 503, 507, None}  # nothing went upstream: the agent sends the call again
ADMIN = {"authorization": "Bearer edges"}
BASE_ENV = {"ROLLTAP_PROXY__LOG_LEVEL": "warning", "ROLLTAP_PROXY__ADMIN_TOKEN": "edges"}
CLUSTER_ENV = {"ROLLTAP_PROXY__CLUSTER__DEAD_AFTER_S": "2", "ROLLTAP_PROXY__CLUSTER__HEARTBEAT_S": "0.25",
               "ROLLTAP_PROXY__MODEL": "fault-model"}
GIVE_UP_S = 120.0
SCENARIOS = ("pg-immediate", "kill-restart", "disk-full")
DEFAULT_DOWN_S = {"pg-immediate": 30.0, "kill-restart": 10.0, "disk-full": 30.0}


@dataclass
class Load:
    """What the agents saw."""

    log: AgentLog = field(default_factory=AgentLog)
    finishes: Counter[str] = field(default_factory=Counter)  # every `finish` answer, retries included
    finish_503_without_retry_after: int = 0
    unfinished: list[str] = field(default_factory=list)  # attempts whose `finish` never answered 200
    gave_up_calls: int = 0
    finish_s: list[float] = field(default_factory=list)  # from the first `finish` sent to its 200
    deadline: float = float("inf")  # set when the run ends: retries stop GIVE_UP_S later
    t0: float = field(default_factory=time.monotonic)
    events: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        self.events.append(f"t={time.monotonic() - self.t0:5.1f}s {message}")
        print("  " + self.events[-1], flush=True)


def _body(i: int, k: int, n: int) -> dict[str, Any]:
    return {"model": "fault-model", "messages": [{"role": "user", "content": f"agent {i} attempt {k} turn {n}"}],
            "max_tokens": 8, "stream": True, "fault": {"delay_s": 0.05}}


async def _call(client: httpx.AsyncClient, url: str, rid: str, aid: str, body: dict[str, Any], load: Load) -> None:
    while True:
        turn = await stream_turn(client, url, rid, aid, body)
        load.log.turns.append(turn)
        if turn.http_status not in REFUSED:
            return
        if time.monotonic() > load.deadline:
            load.gave_up_calls += 1
            return
        await asyncio.sleep(float(turn.retry_after or 0.2))


async def _finish(client: httpx.AsyncClient, url: str, rid: str, aid: str, load: Load) -> None:
    started = time.monotonic()
    while True:
        retry_after: str | None = None
        try:
            answer = await client.post(f"{url}/rollout/{rid}/attempt/{aid}/finish", json={"status": "succeeded"})
        except httpx.TransportError as exc:
            load.finishes[exc.__class__.__name__] += 1
        else:
            load.finishes[str(answer.status_code)] += 1
            if answer.status_code == 200:
                load.finish_s.append(time.monotonic() - started)
                return
            retry_after = answer.headers.get("retry-after")
            if answer.status_code == 503 and retry_after is None:
                load.finish_503_without_retry_after += 1
            if answer.status_code not in (502, 503):
                load.unfinished.append(f"{rid}/{aid}: finish {answer.status_code} {answer.text[:200]}")
                return
        if time.monotonic() > load.deadline:
            load.unfinished.append(f"{rid}/{aid}: finish not 200 after {GIVE_UP_S:.0f} s of retries")
            return
        await asyncio.sleep(float(retry_after or 0.2))


async def drive(url: str, n_agents: int, duration_s: float, fault: Callable[[Load], Coroutine[Any, Any, None]]) -> Load:
    """`n_agents` agents on `url` for `duration_s` while `fault(load)` runs; each then ends its attempt."""
    load = Load()
    stop = asyncio.Event()

    async def agent(i: int, client: httpx.AsyncClient) -> None:
        k = 0
        while not stop.is_set():
            rid, aid = f"edge-{i}", str(k)
            for n in range(TURNS):
                await _call(client, url, rid, aid, _body(i, k, n), load)
            await _finish(client, url, rid, aid, load)
            k += 1

    limits = httpx.Limits(max_connections=2 * n_agents, max_keepalive_connections=2 * n_agents)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=limits) as client:
        agents = [asyncio.create_task(agent(i, client)) for i in range(n_agents)]
        faulting = asyncio.create_task(fault(load))
        await asyncio.sleep(duration_s)
        stop.set()
        load.deadline = time.monotonic() + GIVE_UP_S
        load.note(f"run over: {len(load.log.turns)} calls sent; agents end their attempts")
        await faulting
        await asyncio.gather(*agents)
    load.note(f"agents done: {len(load.log.turns)} calls, {sum(load.finishes.values())} finish answers")
    return load


def _records(db_url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
    with psycopg.connect(db_url) as conn:
        calls = conn.execute("SELECT call_id, rollout_id, attempt_id, seq, status FROM calls "
                             "WHERE rollout_id LIKE 'edge-%'").fetchall()
        attempts = conn.execute("SELECT rollout_id, attempt_id, status FROM attempts "
                                "WHERE rollout_id LIKE 'edge-%'").fetchall()
        leases = conn.execute("SELECT count(*) FROM call_leases").fetchone()
    return calls, attempts, int(leases[0]) if leases else 0


def account(load: Load, db_url: str, check_url: str, *, is_proxy_alive: bool) -> tuple[dict[str, Any], list[str]]:
    """Counts from the agents' log and the database, and every violation of the recording guarantees."""
    violations: list[str] = []
    checked = check_attempts(check_url, load.log, finish=False, is_proxy_alive=is_proxy_alive,
                             violations=violations)
    calls, attempts, leases = _records(db_url)
    turns = load.log.turns
    complete = {t.call_id for t in turns if t.is_complete and t.call_id}
    by_id = {str(row[0]): row for row in calls}
    lost = sorted(cid for cid in complete if cid not in by_id)
    not_ok = sorted(cid for cid in complete if cid in by_id and by_id[cid][4] != "ok")
    duplicates = (len(calls) - len(by_id)) + sum(n - 1 for n in Counter((r[1], r[2], r[3]) for r in calls).values()
                                                if n > 1)
    seqs: dict[tuple[str, str], list[int]] = {}
    for row in calls:
        seqs.setdefault((row[1], row[2]), []).append(row[3])
    gaps = sum(sorted(s) != list(range(len(s))) for s in seqs.values())
    seen = load.log.by_attempt()
    running = [f"{rid}/{aid}" for rid, aid, status in attempts if status == "running"
               and all(t.call_id in by_id for t in seen.get((rid, aid), []) if t.call_id)]
    statuses = Counter(str(t.http_status) for t in turns)
    counts: dict[str, Any] = {
        "calls_sent": len(turns), "http_statuses": dict(statuses), "client_complete": len(complete),
        "streams_cut": sum(t.http_status == 200 and not t.is_complete for t in turns),
        "no_answer": sum(t.http_status is None for t in turns), "attempts": len(seen),
        "records": len(calls), "records_by_status": dict(Counter(str(r[4]) for r in calls)),
        "complete_recorded_ok": len(complete) - len(lost) - len(not_ok), "lost": len(lost),
        "complete_recorded_not_ok": len(not_ok),
        "interrupted_seen_complete": sum(by_id[cid][4] == "interrupted" for cid in not_ok), "duplicates": duplicates, "attempts_with_seq_gaps": gaps,
        "attempts_left_running_all_recorded": len(running), "leases_left": leases,
        "finish_answers": dict(load.finishes), "finish_503_without_retry_after": load.finish_503_without_retry_after,
        "finish_s_median_max": [round(statistics.median(load.finish_s), 2) if load.finish_s else None,
                                round(max(load.finish_s, default=0.0), 2)],
        "attempts_unfinished": len(load.unfinished), "calls_given_up": load.gave_up_calls, "checked_via_api": checked,
    }
    for what, items in (("complete calls not recorded", lost), ("complete calls recorded not ok", not_ok),
                        ("attempts left running though every call is recorded", running),
                        ("attempts whose finish never answered 200", load.unfinished)):
        if items:
            violations.append(f"{len(items)} {what}: {items[:5]}")
    for what, n in (("duplicate records", duplicates), ("attempts with seq gaps", gaps), ("leases left", leases),
                    ("finish 503 without Retry-After", load.finish_503_without_retry_after),
                    ("finish answered 500", load.finishes["500"]),
                    ("calls still refused when retries ended", load.gave_up_calls)):
        if n:
            violations.append(f"{n} {what}")
    return counts, violations


def _new_proxy(workdir: Path, db_url: str, replicas: list[str], **env: str) -> ProxyProcess:
    workdir.mkdir(parents=True)
    return ProxyProcess(workdir, db_url, replicas, free_port(), **{**BASE_ENV, **env})


def _log_count(proxy: ProxyProcess, needle: str) -> int:
    return proxy.log_path.read_text(errors="replace").count(needle)


def _metric(url: str, name: str) -> float:
    got = http_get(url, "/metrics", 10.0)
    assert got is not None and got[0] == 200, f"{url}/metrics: {got}"
    match = re.search(rf"^{name} (\S+)$", got[1].decode(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _upstream_in_flight(url: str) -> int:
    """Calls this proxy has sent to its replicas and not yet ended (summed over replicas)."""
    got = http_get(url, "/metrics", 2.0)
    values = re.findall(r"^rolltap_replica_in_flight\{[^}]*\} (\S+)$", got[1].decode(), re.MULTILINE) if got else []
    return int(sum(float(v) for v in values))


def _complete_between(load: Load, start: int, end: int) -> int:
    """Calls seen complete among those that ended between two points of the run (turns are logged as they end)."""
    return sum(t.is_complete for t in load.log.turns[start:end])


async def pg_immediate(stack: ExitStack, pg: PrivatePostgres, work: Path, args: argparse.Namespace,
                       down_s: float, duration_s: float) -> tuple[dict[str, Any], list[str], list[str]]:
    db_url = pg.database("edges_pg")
    replica = stack.enter_context(serve_in_thread(FaultReplica()))[0]
    proxy = _new_proxy(work / "pg", db_url, [replica])
    stack.callback(proxy.stop)
    proxy.start()
    at_s = (duration_s - down_s) / 2
    marks: list[int] = []  # calls ended when PostgreSQL stopped, and when it was back

    async def fault(load: Load) -> None:
        await asyncio.sleep(at_s)
        marks.append(len(load.log.turns))
        load.note(f"pg_ctl -m immediate ({marks[0]} calls so far)")
        await asyncio.to_thread(pg.stop, "immediate")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(pg.start)
        marks.append(len(load.log.turns))
        load.note(f"PostgreSQL started again ({marks[1]} calls so far)")

    load = await drive(proxy.url, args.agents, duration_s, fault)
    counts, violations = await asyncio.to_thread(account, load, db_url, proxy.url, is_proxy_alive=True)
    counts["complete_during_outage"] = _complete_between(load, *marks)
    counts["records_spooled"] = _metric(proxy.url, "rolltap_records_spooled_total")
    spool = proxy.workdir / "spool"
    counts["dead_letter_files"] = len(list((spool / "dead").glob("*"))) if (spool / "dead").is_dir() else 0
    counts["spool_files_left"] = len(list(spool.glob("*.jsonl")))
    counts["proxy_log_tracebacks"] = _log_count(proxy, "Traceback")
    if counts["dead_letter_files"] or counts["spool_files_left"]:
        violations.append(f"spool not empty: {counts['dead_letter_files']} dead, {counts['spool_files_left']} left")
    if not load.finishes["503"]:
        violations.append("the outage was not hit: no finish answered 503")
    return counts, violations, load.events


async def kill_restart(stack: ExitStack, pg: PrivatePostgres, work: Path, args: argparse.Namespace,
                       down_s: float, duration_s: float) -> tuple[dict[str, Any], list[str], list[str]]:
    db_url = pg.database("edges_kill")
    replicas = [stack.enter_context(serve_in_thread(FaultReplica()))[0] for _ in range(2)]
    a, b = (_new_proxy(work / name, db_url, replicas, **CLUSTER_ENV) for name in ("kill-a", "kill-b"))
    for proxy in (a, b):
        stack.callback(proxy.stop)
        proxy.start()  # one after the other: the first one migrates
    balancer = RoundRobin([a.url, b.url])
    lb = stack.enter_context(serve_in_thread(balancer))[0]
    restart_s: list[float] = []

    in_flight: list[int] = []

    async def fault(load: Load) -> None:
        await asyncio.sleep(10.0)
        # Agents move in step (3 calls, then finish): wait for a moment with calls on A, or the kill shows nothing.
        wanted, deadline = max(1, args.agents // 8), time.monotonic() + 10.0
        while True:
            in_flight[:] = [await asyncio.to_thread(_upstream_in_flight, a.url)]
            if in_flight[0] >= wanted or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(a.kill9)
        load.note(f"kill -9 proxy A with {in_flight[0]} calls in flight on it ({len(load.log.turns)} calls so far)")
        await asyncio.sleep(down_s)
        load.note("restarting proxy A on its workdir")
        restart_s.append(await asyncio.to_thread(a.start))
        load.note(f"proxy A serves again (start-up {restart_s[0]:.1f} s)")

    load = await drive(lb, args.agents, duration_s, fault)
    counts, violations = await asyncio.to_thread(account, load, db_url, b.url, is_proxy_alive=False)
    on_a = {cid for cid, url in balancer.served.items() if url == a.url}
    turns = load.log.turns
    counts["cut_on_killed_proxy"] = sum(t.call_id in on_a and t.http_status == 200 and not t.is_complete
                                        for t in turns)
    counts["in_flight_on_a_at_kill"] = in_flight[0] if in_flight else None
    counts["requests_per_proxy"] = {"A (killed)": balancer.requests[a.url], "B": balancer.requests[b.url]}
    counts["restart_s"] = round(restart_s[0], 1) if restart_s else None
    counts["proxy_log_tracebacks"] = _log_count(a, "Traceback") + _log_count(b, "Traceback")
    if not counts["cut_on_killed_proxy"]:
        violations.append("the kill was not hit: no call was cut on the killed proxy")
    return counts, violations, load.events


async def disk_full(stack: ExitStack, pg: PrivatePostgres, work: Path, args: argparse.Namespace,
                    down_s: float, duration_s: float) -> tuple[dict[str, Any], list[str], list[str]]:
    db_url = pg.database("edges_disk")
    replica = stack.enter_context(serve_in_thread(FaultReplica()))[0]
    disk = stack.enter_context(small_disk(work / "disk", args.disk_size))
    # Segments far below the disk's size, so the journal's own growth never fills it outside the window.
    proxy = _new_proxy(work / "disk-proxy", db_url, [replica],
                       ROLLTAP_PROXY__RECORDER__SPOOL_DIR=str(disk.path / "spool"),
                       ROLLTAP_PROXY__RECORDER__JOURNAL_SEGMENT_BYTES=str(4 << 20))
    stack.callback(proxy.stop)
    proxy.start()
    at_s = (duration_s - down_s) / 2
    window: dict[str, float] = {}
    marks: list[int] = []  # calls ended when the disk was filled, and when it was freed
    ready: list[tuple[float, str, str]] = []  # (t, /readyz status, local_storage) sampled through the run
    unhealthy: list[str] = []

    async def sample(load: Load) -> None:
        while "freed" not in window or time.monotonic() - load.t0 < window["freed"] + 5:
            got = await asyncio.to_thread(http_get, proxy.url, "/readyz", 5.0)
            if got is not None:
                body = json.loads(got[1])
                ready.append((time.monotonic() - load.t0, body["status"], str(body["checks"]["local_storage"])))
            async with httpx.AsyncClient(timeout=5) as http:
                for rep in (await http.get(f"{proxy.url}/admin/replicas", headers=ADMIN)).json()["data"]:
                    if not rep["healthy"]:
                        unhealthy.append(f"t={time.monotonic() - load.t0:.1f}s {rep['url']}")
            await asyncio.sleep(0.5)

    async def fault(load: Load) -> None:
        sampler = asyncio.create_task(sample(load))
        await asyncio.sleep(at_s)
        marks.append(len(load.log.turns))
        await asyncio.to_thread(disk.fill)
        window["filled"] = time.monotonic() - load.t0
        load.note(f"disk filled, {disk.free_bytes} bytes free ({len(load.log.turns)} calls so far)")
        await asyncio.sleep(down_s)
        marks.append(len(load.log.turns))
        disk.free()
        window["freed"] = time.monotonic() - load.t0
        load.note(f"disk freed, {disk.free_bytes >> 20} MiB free")
        await sampler

    load = await drive(proxy.url, args.agents, duration_s, fault)
    counts, violations = await asyncio.to_thread(account, load, db_url, proxy.url, is_proxy_alive=True)
    refused = [t for t in load.log.turns if t.http_status == 507]
    in_window = [s for t, s, _ in ready if window["filled"] <= t <= window["freed"]]
    after = ready[-1][1] if ready else "none"
    counts |= {
        "complete_during_fill": _complete_between(load, *marks),
        "journal_write_failures": _metric(proxy.url, "rolltap_journal_write_failures_total"),
        "refused_507": len(refused), "refused_507_without_retry_after": sum(t.retry_after is None for t in refused),
        "refused_507_other_code": sum("local_storage_unavailable" not in (t.error or "") for t in refused),
        "readyz_during_fill": dict(Counter(in_window)), "readyz_after": after,
        "local_storage_seen": sorted({storage for _, _, storage in ready if storage != "ok"})[:3],
        "replicas_unhealthy_samples": len(unhealthy), "proxy_log_ejected": _log_count(proxy, "ejected"),
        "proxy_log_tracebacks": _log_count(proxy, "Traceback"),
    }
    for what, n in (("streams cut", counts["streams_cut"]), ("calls without an answer", counts["no_answer"]),
                    ("507 without Retry-After", counts["refused_507_without_retry_after"]),
                    ("507 not local_storage_unavailable", counts["refused_507_other_code"]),
                    ("replica ejections in the log", counts["proxy_log_ejected"]),
                    ("samples with an unhealthy replica", len(unhealthy))):
        if n:
            violations.append(f"{n} {what}")
    if not refused or not counts["complete_during_fill"]:
        violations.append("the fill was not hit: no call was refused 507, or no stream ran across it")
    if "degraded" not in in_window:
        violations.append(f"/readyz never said degraded while the disk was full: {dict(Counter(in_window))}")
    if after != "ready":
        violations.append(f"/readyz says {after} after the disk was freed")
    return counts, violations, load.events


RUNNERS = {"pg-immediate": pg_immediate, "kill-restart": kill_restart, "disk-full": disk_full}


async def run(name: str, pg: PrivatePostgres, args: argparse.Namespace) -> dict[str, Any]:
    down_s = args.down_s if args.down_s is not None else DEFAULT_DOWN_S[name]
    duration_s = args.duration_s if args.duration_s is not None else down_s + 30.0
    print(f"{name}: {args.agents} agents, {duration_s:.0f} s, fault {down_s:.0f} s", flush=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"rolltap-edges-{name}-"))
    with ExitStack() as stack:
        counts, violations, events = await RUNNERS[name](stack, pg, work, args, down_s, duration_s)
    result = {"agents": args.agents, "down_s": down_s, "duration_s": duration_s,
              "run_s": round(time.monotonic() - started, 1), "counts": counts, "violations": violations,
              "events": events, "workdir": str(work)}
    c = counts
    print(f"{name}: {c['calls_sent']} calls sent, {c['client_complete']} complete -> {c['complete_recorded_ok']} "
          f"recorded ok, {c['lost']} lost, {c['duplicates']} duplicates, {c['attempts_with_seq_gaps']} seq gaps, "
          f"records {c['records_by_status']}, finish {c['finish_answers']}, {len(violations)} violations "
          f"({result['run_s']:.0f} s)", flush=True)
    for violation in violations[:20]:
        print(f"  VIOLATION {violation}", flush=True)
    return result


async def main_async(args: argparse.Namespace) -> int:
    pg = PrivatePostgres()
    pg.init()
    pg.start()
    results: dict[str, Any] = {}
    try:
        for name in SCENARIOS if args.scenario == "all" else (args.scenario,):
            results[name] = await run(name, pg, args)
    finally:
        pg.destroy()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "load_average": os.getloadavg(), "command": f"python -m bench.edges --scenario {args.scenario}",
              "scenarios": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(r["violations"] for r in results.values()) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--down-s", type=float, default=None,
                        help="how long the fault lasts (default 30 s; 10 s for kill-restart)")
    parser.add_argument("--duration-s", type=float, default=None, help="the whole run (default down + 30 s)")
    parser.add_argument("--disk-size", default="64m", help="the disk-full scenario's tmpfs size")
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "docs" / "bench-results" / f"edges-{time.strftime('%Y-%m-%d')}.json")
    raise SystemExit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
