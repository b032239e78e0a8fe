"""Benchmark: proxy throughput against `--workers` (processes on one port, one PostgreSQL database).

For each worker count N it starts `python -m proxy.main --workers N` (the real CLI) on a fresh
database, in front of several instant replicas (`bench.instant_replica`: canned answers in
microseconds, so the upstream is never the bottleneck), and drives `--concurrency` agents
(non-streamed tracked chat calls, one attempt per agent, calls back to back) from several
load processes for `--duration` seconds after a warm-up. It reports calls/s, latency
percentiles, the speed-up over one worker and the CPU each part used, then checks that the
database holds exactly one record per answered call (after a SIGTERM flush): a benchmark
that loses records is invalid and exits non-zero.

Several workers need PostgreSQL (`--workers > 1` on SQLite is refused). With `--database`
(a server URL whose user may CREATE DATABASE, e.g. postgresql://postgres@127.0.0.1:5432/postgres)
each run gets a database of its own there; without it a private server is started with
`initdb`/`pg_ctl` from PATH or /usr/lib/postgresql/*/bin (as root it runs as user `postgres`).

    python -m bench.scaling --workers 1,2,4,8 --out scaling.json
    python -m bench.scaling --workers 1,2 --duration 5 --database postgresql://postgres@127.0.0.1:5432/test
    python -m bench.scaling --workers 1 --concurrency 32 --direct    # tail latency, with the replica alone

Prints the JSON it writes to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import cpu_seconds, free_port, wait_ready
from bench.instant_replica import start_instant_replica

ROOT = Path(__file__).resolve().parent.parent


def _load(url: str, agents: int, first: int, warmup_s: float, duration_s: float, *,
          is_direct: bool = False) -> dict[str, Any]:
    """One load process: `agents` agents calling back to back; counts only the measured window.
    `is_direct`: `url` is a replica, called on its own path (the same load without the proxy)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import aiohttp

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).encode()
    # ok/errors/latencies: the measured window; answered/transport_errors: every call (for the record count).
    out: dict[str, Any] = {"ok": 0, "errors": 0, "latencies_ms": [], "answered": 0, "transport_errors": 0}

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector, headers={"content-type": "application/json"}) as http:
            start = time.perf_counter()
            measure_from, measure_to = start + warmup_s, start + warmup_s + duration_s

            async def agent(i: int) -> None:
                path = f"{url}/v1/chat/completions" if is_direct else f"{url}/rollout/s{first + i}/attempt/a/v1/chat/completions"
                while True:
                    t0 = time.perf_counter()
                    if t0 >= measure_to:
                        return
                    try:
                        async with http.post(path, data=body) as resp:
                            await resp.read()
                            is_ok = resp.status == 200
                        out["answered"] += 1
                    except aiohttp.ClientError:
                        is_ok = False
                        out["transport_errors"] += 1
                    t1 = time.perf_counter()
                    if measure_from <= t0 and t1 <= measure_to:
                        if is_ok:
                            out["ok"] += 1
                            out["latencies_ms"].append((t1 - t0) * 1000)
                        else:
                            out["errors"] += 1

            await asyncio.gather(*(agent(i) for i in range(agents)))

    asyncio.run(main())
    return out


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes and their children that were waited for."""
    return sum(cpu_seconds(pid, waited_children=True) for pid in pids)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


class _Postgres:
    """A database per run on `--database`'s server, or on a private server started here."""

    def __init__(self, admin_url: str | None) -> None:
        self._private = None
        if admin_url is None:
            sys.path.insert(0, str(ROOT))
            from tests.support.private_pg import PrivatePostgres

            self._private = PrivatePostgres()
            self._private.init()
            self._private.start()
            admin_url = self._private.url
        self.admin_url = admin_url

    def create(self) -> tuple[str, str]:
        name = "rolltap_scaling_" + uuid.uuid4().hex[:10]
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name, self.admin_url.rsplit("/", 1)[0] + "/" + name

    def drop(self, name: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        if self._private is not None:
            self._private.destroy()


def _drive(url: str, args: argparse.Namespace, *, is_direct: bool = False) -> list[dict[str, Any]]:
    """`--concurrency` agents split over `--load-processes` processes; each one's counts."""
    loaders = args.load_processes
    per = [args.concurrency // loaders + (1 if i < args.concurrency % loaders else 0) for i in range(loaders)]
    with ProcessPoolExecutor(loaders) as pool:
        futures = [pool.submit(_load, url, n, sum(per[:i]), args.warmup, args.duration, is_direct=is_direct)
                   for i, n in enumerate(per)]
        return [f.result() for f in futures]


def _percentiles(latencies: list[float]) -> dict[str, float]:
    q = statistics.quantiles(sorted(latencies), n=100) if len(latencies) >= 100 else [float("nan")] * 99
    return {"p50_ms": round(q[49], 2), "p90_ms": round(q[89], 2), "p99_ms": round(q[98], 2)}


def _run_direct(replica: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same agents against one replica, no proxy: what the load generator and replica cost alone."""
    results = _drive(replica, args, is_direct=True)
    ok = sum(r["ok"] for r in results)
    return {"target": "direct", "concurrency": args.concurrency, "duration_s": args.duration,
            "calls_per_s": round(ok / args.duration, 1), "errors": sum(r["errors"] for r in results),
            **_percentiles([x for r in results for x in r["latencies_ms"]])}


def _run_one(workers: int, replicas: list[str], pg: _Postgres, args: argparse.Namespace,
             workdir: Path) -> dict[str, Any]:
    name, db_url = pg.create()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLTAP_")}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "ROLLTAP_PROXY__OPEN_ACCESS": "true", "ROLLTAP_PROXY__LOG_LEVEL": "warning",
                "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(workdir / f"spool-{workers}"),
                # Each worker's pool: workers x (writer 1 + reader 5 + cluster 4) connections in all.
                "ROLLTAP_PROXY__POOL__POLICY": "consistent_hash"})
    env.update(dict(kv.split("=", 1) for kv in args.proxy_env))
    cmd = [sys.executable, "-m", "proxy.main", "--db", db_url, "--port", str(port), "--workers", str(workers)]
    for replica in replicas:
        cmd += ["--replica", replica]
    log_path = workdir / f"proxy-{workers}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        wait_ready(url, "/healthz", proc, 120.0, log_path=log_path, poll_s=0.1)
        # Every worker has joined once the registry holds N live rows.
        while True:
            with psycopg.connect(db_url) as conn:
                live = conn.execute("SELECT count(*) FROM proxies").fetchone()[0]  # type: ignore[index]
            if live >= workers or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        pids = [proc.pid, *_children(proc.pid)]
        cpu0, wall0 = _cpu_s(pids), time.perf_counter()
        results = _drive(url, args)
        wall = time.perf_counter() - wall0
        cpu = _cpu_s(pids) - cpu0
        ok = sum(r["ok"] for r in results)
        latencies = [x for r in results for x in r["latencies_ms"]]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        with psycopg.connect(db_url) as conn:
            recorded = conn.execute("SELECT count(*) FROM calls").fetchone()[0]  # type: ignore[index]
            leases = conn.execute("SELECT count(*) FROM call_leases").fetchone()[0]  # type: ignore[index]
        answered = sum(r["answered"] for r in results)
        transport_errors = sum(r["transport_errors"] for r in results)
        return {
            "workers": workers, "concurrency": args.concurrency, "duration_s": args.duration,
            "calls_per_s": round(ok / args.duration, 1), "errors": sum(r["errors"] for r in results),
            **_percentiles(latencies),
            # CPU of the proxy processes over the whole load (warm-up included), per call.
            "proxy_cpu_s": round(cpu, 2), "proxy_cores_busy": round(cpu / wall, 2),
            # Exactly once: one record per call that got an HTTP answer (checked when no connection failed).
            "records_in_db": recorded, "calls_answered": answered, "transport_errors": transport_errors,
            "leases_left": leases,
        }
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        pg.drop(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts to measure (comma-separated)")
    parser.add_argument("--concurrency", type=int, default=256, help="agents calling back to back")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per worker count")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before")
    parser.add_argument("--replicas", type=int, default=4, help="instant replicas (child processes)")
    parser.add_argument("--load-processes", type=int, default=max(1, min(6, (os.cpu_count() or 2) // 3)),
                        help="load generator processes")
    parser.add_argument("--database", help="PostgreSQL server URL to create databases on (default: a private one)")
    parser.add_argument("--direct", action="store_true",
                        help="also drive the same agents at one replica with no proxy (reported as `direct`)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the proxy (e.g. ROLLTAP_PROXY__CLUSTER__ENABLED=false with "
                        "--workers 1: the single-process baseline without cluster membership)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    report: dict[str, Any] = {
        "benchmark": "bench.scaling", "command": " ".join([Path(sys.executable).name, "-m", "bench.scaling",
                                                            *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor()},
        "replicas": args.replicas, "load_processes": args.load_processes, "runs": [],
    }
    failed = False
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="rolltap-scaling-") as tmp:
        replicas = []
        for _ in range(args.replicas):
            replica_url, stop = start_instant_replica()
            stack.callback(stop)
            replicas.append(replica_url)
        if args.direct:
            report["direct"] = _run_direct(replicas[0], args)
            print(json.dumps(report["direct"]), file=sys.stderr, flush=True)
        pg = _Postgres(args.database)
        stack.callback(pg.close)
        for n in counts:
            run = _run_one(n, replicas, pg, args, Path(tmp))
            base = report["runs"][0]["calls_per_s"] if report["runs"] else run["calls_per_s"]
            run["speedup"] = round(run["calls_per_s"] / base, 2) if base else None
            report["runs"].append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
            if run["leases_left"] or (run["transport_errors"] == 0 and run["records_in_db"] != run["calls_answered"]):
                print(f"INVALID: {run['records_in_db']} records for {run['calls_answered']} answered calls, "
                      f"{run['leases_left']} leases left", file=sys.stderr)
                failed = True
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
