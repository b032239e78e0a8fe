"""Soak: many streaming agents for minutes while a replica dies and PostgreSQL stops; nothing unaccounted for.

    .venv/bin/python -m bench.crash_soak --replica http://127.0.0.1:18000 --model-dir /work/tiny-model \\
        [--agents 200] [--duration-s 300] [--pg-down-s 30]

One `rolltap-proxy` process (`python -m proxy.main`) on a private PostgreSQL cluster
(initdb in a temporary directory: the shared server is never touched) in front of two
replicas: `--replica` (kept) and a CPU vLLM replica this script starts (`--victim vllm`,
the default) or a fault replica (`--victim fault`, for a quick run). `--agents` agents
stream chat calls one after another (three calls per attempt) for `--duration-s`:

* at 20 % of the run, the victim replica is killed (SIGKILL, its whole process group)
  and started again on the same port;
* at 50 %, PostgreSQL is stopped (`pg_ctl -m fast`) for `--pg-down-s`, then started.

Then the agents stop, and every attempt is read back and finished: every call the
client saw complete is recorded `ok` exactly once; every call that got an HTTP answer
has exactly one record (a failed call's record says so); seqs have no gap. Proxy RSS at
start and end, dead-lettered and still-spooled records, and counts are printed; the exit
status is 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.support.fault_replica import FaultReplica
from tests.support.private_pg import PrivatePostgres
from tests.support.proxy_process import AgentLog, ProxyProcess, check_attempts, run_agents
from tests.support.servers import free_port, serve_in_thread


class Victim:
    """The replica that gets killed and restarted."""

    def __init__(self, kind: str, model_dir: Path | None) -> None:
        self.kind = kind
        self._replica: Any = None
        self._fault_cm: Any = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._model_dir = model_dir

    def start(self) -> float:
        started = time.monotonic()
        if self.kind == "vllm":
            from tools.replica import VllmReplica

            if self._replica is None:
                assert self._model_dir is not None, "a vLLM victim serves a model"
                self._replica = VllmReplica(self._model_dir, served_model_name="tiny", port=self.port)
            self._replica.start()
            self._replica.wait_healthy(600)
        else:
            self._fault_cm = serve_in_thread(FaultReplica(), port=self.port)
            self._fault_cm.__enter__()
        return time.monotonic() - started

    def kill(self) -> None:
        if self.kind == "vllm":
            os.killpg(self._replica.proc.pid, signal.SIGKILL)
            self._replica.stop()  # reaps it
        else:
            self._fault_cm.__exit__(None, None, None)

    def stop(self) -> None:
        if self.kind == "vllm" and self._replica is not None:
            self._replica.stop()
        elif self._fault_cm is not None:
            self._fault_cm.__exit__(None, None, None)


async def soak(args: argparse.Namespace) -> int:
    events: list[str] = []
    t0 = time.monotonic()

    def note(message: str) -> None:
        events.append(f"t={time.monotonic() - t0:6.1f}s {message}")
        print(events[-1], flush=True)

    work = Path(tempfile.mkdtemp(prefix="rolltap-soak-"))
    pg = PrivatePostgres()
    pg.init()
    pg.start()
    db_url = pg.database("soak")
    victim = Victim(args.victim, args.model_dir)
    keeper_cm = None
    keepers = list(args.replica)
    if not keepers:
        keeper_cm = serve_in_thread(FaultReplica())
        keepers = [keeper_cm.__enter__()[0]]
    proxy = ProxyProcess(work, db_url, [*keepers, victim.url], free_port(), ROLLTAP_PROXY__LOG_LEVEL="warning")
    log = AgentLog()
    rss: list[tuple[float, int]] = []
    violations: list[str] = []
    try:
        note(f"victim replica ({args.victim}) up in {victim.start():.0f} s")
        proxy.start()
        t0 = time.monotonic()
        note(f"proxy up, RSS {proxy.rss_kb() / 1024:.0f} MB; {args.agents} agents start")
        rss.append((0.0, proxy.rss_kb()))
        stop = asyncio.Event()
        is_fault = args.victim == "fault" and not args.replica

        def body_of(i: int, k: int) -> dict[str, Any]:
            body: dict[str, Any] = {"model": "tiny", "stream": True, "max_tokens": args.max_tokens,
                                    "messages": [{"role": "user", "content": f"agent {i} turn {k}: a story"}]}
            if is_fault:
                body["fault"] = {"delay_s": 0.05}
            return body

        turn_of: dict[int, int] = Counter()

        def attempt_of(i: int) -> tuple[str, str]:
            turn_of[i] += 1
            return f"soak-{i}", str((turn_of[i] - 1) // 3)

        agents = asyncio.ensure_future(run_agents(proxy.url, args.agents, attempt_of, body_of, stop, log,
                                                  stop_on_error=False))

        async def sample_rss() -> None:
            while not stop.is_set():
                await asyncio.sleep(10)
                rss.append((time.monotonic() - t0, proxy.rss_kb()))

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.sleep(args.duration_s * 0.2)
        note(f"kill -9 victim replica; {len(log.turns)} calls so far")
        await asyncio.to_thread(victim.kill)
        restart = asyncio.ensure_future(asyncio.to_thread(victim.start))
        await asyncio.sleep(max(0.0, args.duration_s * 0.5 - (time.monotonic() - t0)))
        note(f"PostgreSQL fast shutdown for {args.pg_down_s:.0f} s; {len(log.turns)} calls so far")
        await asyncio.to_thread(pg.stop, "fast")
        await asyncio.sleep(args.pg_down_s)
        await asyncio.to_thread(pg.start)
        note("PostgreSQL started again")
        await asyncio.sleep(max(0.0, args.duration_s - (time.monotonic() - t0)))
        stop.set()
        note("stopping agents (each ends its current call)")
        await agents
        await sampler
        if restart.done():
            note(f"victim replica had come back after {restart.result():.0f} s")
        else:
            note("victim replica still starting at the end")
            await restart
        rss.append((time.monotonic() - t0, proxy.rss_kb()))
        # Give the recorder time to replay what it spooled during the outage.
        for _ in range(120):
            ready = httpx.get(f"{proxy.url}/readyz", timeout=10).json()
            if ready["checks"]["database"] and ready["checks"]["recorder_queue_depth"] == 0:
                break
            await asyncio.sleep(1)
        counts = await asyncio.to_thread(check_attempts, proxy.url, log, is_proxy_alive=True, violations=violations)
        spool = work / "spool"
        dead = sum(1 for _ in (spool / "dead").glob("*.jsonl")) if (spool / "dead").is_dir() else 0
        waiting = sum(1 for _ in spool.glob("*.jsonl")) if spool.is_dir() else 0
        statuses = Counter(str(t.http_status) for t in log.turns)
        seen = Counter("complete" if t.is_complete else ("cut" if t.http_status == 200 else "refused/failed")
                       for t in log.turns)
        proxy.sigterm()
        exit_code = await asyncio.to_thread(proxy.wait, 120)
        summary = {
            "agents": args.agents, "duration_s": args.duration_s, "calls_sent": len(log.turns),
            "client_view": dict(seen), "http_statuses": dict(statuses), "checked": counts,
            "dead_letter_files": dead, "spool_files_left": waiting, "proxy_exit_code": exit_code,
            "rss_mb": " ".join(f"t={t:.0f}s:{kb / 1024:.0f}" for t, kb in rss), "violations": len(violations), "first_violations": violations[:10], "events": events,
        }
        print(json.dumps(summary, indent=1))
        return 1 if violations or dead or exit_code != 0 else 0
    finally:
        proxy.stop()
        victim.stop()
        if keeper_cm is not None:
            keeper_cm.__exit__(None, None, None)
        pg.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", action="append", default=[], help="replica kept up (repeatable)")
    parser.add_argument("--victim", choices=("vllm", "fault"), default="vllm")
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get("ROLLTAP_TEST_MODEL_DIR", "")))
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--pg-down-s", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    raise SystemExit(asyncio.run(soak(args)))


if __name__ == "__main__":
    threading.current_thread().name = "soak"
    main()
