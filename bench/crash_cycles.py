"""`kill -9` / restart cycles of the proxy under streaming agents, against real replicas.

    .venv/bin/python -m bench.crash_cycles --replica http://127.0.0.1:18000 [--db sqlite|postgresql]
        [--agents 64] [--cycles 4] [--max-tokens 96]

The CI test (`tests/proxy/test_crash.py`) does the same against the fault replica's
slow streams; this runs it against vLLM. Each agent carries one attempt across all cycles;
in each cycle the proxy (`python -m proxy.main`) starts, the agents stream until each has
completed a call in this cycle, and 0.3 s later the proxy is killed with SIGKILL. After
the last cycle a fresh proxy recovers the journal, and every attempt is checked
(`tests.support.proxy_process.check_attempts`): every call the client saw complete is
recorded `ok` exactly once, calls in flight are `interrupted`, seqs have no gap, and
attempts with an interrupted call say `is_complete: false` in GET and in `finish`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from tests.support.databases import database
from tests.support.proxy_process import AgentLog, ProxyProcess, check_attempts, run_agents
from tests.support.servers import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    def body_of(i: int, k: int) -> dict[str, object]:
        return {"model": "tiny", "stream": True, "max_tokens": args.max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"agent {i} turn {k}"}]}

    work = Path(tempfile.mkdtemp(prefix="rolltap-cycles-"))
    log = AgentLog()
    violations: list[str] = []
    with database(args.db, work) as db_url:
        proxy = ProxyProcess(work, db_url, args.replica, free_port(), ROLLTAP_PROXY__LOG_LEVEL="warning")
        try:
            for cycle in range(args.cycles):
                up_s = proxy.start()
                loop = asyncio.new_event_loop()
                before = sum(t.is_complete for t in log.turns)
                future = loop.create_task(run_agents(proxy.url, args.agents, lambda i: (f"cycle-{i}", "0"), body_of,
                                                     asyncio.Event(), log))
                deadline = time.monotonic() + 300
                while sum(t.is_complete for t in log.turns) - before < args.agents and time.monotonic() < deadline:
                    loop.run_until_complete(asyncio.sleep(0.05))
                loop.run_until_complete(asyncio.sleep(0.3))
                proxy.kill9()
                loop.run_until_complete(future)
                loop.close()
                cut = sum(1 for t in log.turns[-args.agents * 3:] if t.http_status == 200 and not t.is_complete)
                print(f"cycle {cycle}: proxy up in {up_s:.1f} s, killed with ~{cut} streams cut; "
                      f"{len(log.turns)} calls so far", flush=True)
            up_s = proxy.start()
            print(f"restart with recovery: {up_s:.1f} s")
            counts = check_attempts(proxy.url, log, violations=violations)
            proxy.sigterm()
            exit_code = proxy.wait(120)
        finally:
            proxy.stop()
    print(json.dumps({"db": args.db, "agents": args.agents, "cycles": args.cycles, "calls_sent": len(log.turns),
                      "complete_seen_by_clients": sum(t.is_complete for t in log.turns), "checked": counts,
                      "violations": len(violations), "first_violations": violations[:10],
                      "proxy_exit_code": exit_code}, indent=1))
    raise SystemExit(1 if violations or exit_code else 0)


if __name__ == "__main__":
    main()
