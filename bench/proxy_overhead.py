"""Benchmark: what Rolltap's proxy costs per call, next to the replica alone and to other proxies.

One run starts an instant replica (``bench.instant_replica``: canned vLLM-shaped chat
completions, streams sent one SSE event per write) and measures, at each concurrency,
streamed and not, chat completions of 16 tokens:

* ``direct``   -- wrk -> replica: the replica alone;
* ``floor``    -- wrk -> the same canned answers from a raw ASGI app under uvicorn (uvloop +
  httptools; ``bench.instant_replica --impl asgi``), pinned like a proxy: no upstream hop, no
  recording, no routing. It is the most any server on the contract's stack (an ASGI app under
  uvicorn) can do here, so it bounds every "× direct" a uvicorn-served proxy can reach;
* ``bare``     -- wrk -> the least a Python relay can do: a Starlette route under uvicorn forwarding
  the bytes through one ``aiohttp.ClientSession`` (the proxy's client until 2026-12-07), no parsing,
  no recording (``bench.bare_forward``). Rolltap's CPU per call over this one's is
  issue 23's overhead target (<= 1.5x non-streamed, <= 1.2x streamed, recording included);
* ``bare-rolltap`` -- the same relay on the proxy's own client (``proxy.upstream``): Rolltap's CPU
  per call over this one's is what recording and routing cost, the client left out;
* ``sqlite``   -- wrk -> ``rolltap-proxy`` (the real CLI, a subprocess) recording to SQLite;
* ``postgres`` -- the same, recording to PostgreSQL (a fresh database, dropped afterwards);
* ``litellm``  -- wrk -> LiteLLM's proxy server (``litellm --config cfg.yaml``, one worker),
  the replica configured as an ``openai/...`` model with ``api_base``; from ``.venv-bench``;
* ``agl``      -- wrk -> Agent Lightning's gateway (``agl-server``, agentlightning 1.0.2),
  from ``.venv-agl`` (it needs Python >= 3.12). It does not stream: non-streamed cells only.

Load comes from ``wrk -t1`` with a Lua script that POSTs the body and, for the recording
proxies, spreads calls over one attempt per connection (``attempt/a<i % conc>``), with a
rollout id of its own for every wrk run. Every run is preceded by an unmeasured warm-up
at the same concurrency. Targets are interleaved (their order rotated per repeat) so
background load hits them alike; medians over repeats are reported, with the req/s range.

On a 2-core machine the server under test is pinned to one CPU (the one other work leaves
freest, sampled before the run, or ``--server-cpu``) and wrk (and, while a proxy is measured,
the replica) to the other (``--no-pin`` turns this off). PostgreSQL's backend is not pinned.
Agent Lightning's gateway is restarted before each of its cells: after a burst of client
disconnects its httpx pool keeps connections it never frees, and once the idle ones expire
every later request waits for the pool (300 s), so it cannot be reused across cells. "server CPU" is the CPU time (utime+stime, from /proc) of the server under test and
its child processes, from the start of a wrk run until the server is idle again (it finishes
the requests wrk left in flight; the next run waits for that), per request sent: the number
least disturbed by other load.

Also measured: the proxy's own ``x-rolltap-overhead-ms`` header at concurrency 1 (a wrk run
that collects it from every response), and, after the run, that each Rolltap database holds
exactly one call per request wrk sent (counted per rollout id, i.e. per wrk run), with
gap-free per-attempt sequence numbers. A recording benchmark that drops records is
invalid, so a mismatch makes the script exit non-zero.

Usage (from the repository root; needs ``wrk``: ``apt-get install -y wrk``)::

    .venv/bin/python -m bench.proxy_overhead                     # everything, 3 repeats
    .venv/bin/python -m bench.proxy_overhead --targets direct,sqlite --concurrency 1,32 --repeat 1

Setting up the comparison proxies (never in the main venv)::

    python3.11 -m venv .venv-bench && .venv-bench/bin/pip install -r bench/requirements-litellm-proxy.txt
    python3.12 -m venv .venv-agl && .venv-agl/bin/pip install agentlightning==1.0.2 httptools uvloop

(`litellm[proxy]==1.110.2` itself does not resolve from the registry: see the requirements file.
httptools and uvloop give both the same uvicorn fast paths Rolltap runs on; without them their
uvicorn falls back to the pure-Python h11 parser and the asyncio loop.)

A target whose environment is missing is skipped with a note, unless named in --targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bare_forward import start_bare_forward
from bench.harness import (
    REPO_ROOT,
    WRK_LUA,
    free_port,
    machine,
    run_wrk,
    terminate_group,
    wait_ready,
)

MODEL = "tiny"
ALL_TARGETS = ("direct", "floor", "bare", "bare-rolltap", "sqlite", "postgres", "litellm", "agl")
LABELS = {
    "direct": "direct",
    "floor": "uvicorn floor (no proxying)",
    "bare": "bare forward (aiohttp, no parsing, no recording)",
    "bare-rolltap": "bare forward (Rolltap's client, no parsing, no recording)",
    "sqlite": "Rolltap, SQLite",
    "postgres": "Rolltap, PostgreSQL",
    "litellm": "LiteLLM proxy",
    "agl": "Agent Lightning",
}
RECORDING = ("sqlite", "postgres")



# =============================================================================
# Servers
# =============================================================================


@dataclasses.dataclass
class Server:
    name: str
    base: str  # http://127.0.0.1:PORT
    path_fmt: Callable[[str], str | None]  # rollout id -> wrk path format (None: the static path)
    static_path: str
    proc: subprocess.Popen[bytes] | None
    stop: Callable[[], object]  # what it returns (an exit code) is not used
    streams: bool = True
    db_url: str | None = None
    prepare: Callable[[str], None] | None = None  # called with each new rollout id before its wrk run
    respawn: Callable[[], None] | None = None  # restart before each cell (Agent Lightning)
    cpu_pid: int | None = None  # the process whose CPU is counted, when `proc` is not it
    rollouts: dict[str, int] = dataclasses.field(default_factory=dict)  # rollout id -> requests sent


# Rolltap's agent key (proxy.agent_key): every call is authenticated, as in production.
AGENT_KEY = "rk-bench-" + os.urandom(16).hex()
os.environ["RT_AGENT_KEY"] = AGENT_KEY  # read by the wrk script


def _http(method: str, base: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes, Any]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"authorization": f"Bearer {AGENT_KEY}"}  # Rolltap is closed; the other targets ignore it
        if data is not None:
            headers["content-type"] = "application/json"
        conn.request(method, path, data, headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.headers
    finally:
        conn.close()


def _spawn(cmd: list[str], *, env: dict[str, str], cwd: Path, log_path: Path, cpu: int | None) -> subprocess.Popen[bytes]:
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]  # children (workers) inherit the affinity
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLTAP_", "LITELLM_", "AGL_"))}
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(k, None)
    return env


def start_rolltap(kind: str, replica: str, db_url: str, work: Path, cpu: int | None,
                  settings: dict[str, str] | None = None) -> Server:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    spool = work / f"spool-{kind}"
    log_path = work / f"rolltap-{kind}.log"
    env = _base_env() | {"ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(spool), "ROLLTAP_PROXY__AGENT_KEY": AGENT_KEY,
                         **(settings or {})}
    script = Path(sys.executable).parent / "rolltap-proxy"
    # The console script when installed; else the module (wheels unpacked beside the checkout).
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "proxy.main"]
    cmd = [*exe, "--replica", replica, "--db", db_url, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = _spawn(cmd, env=env, cwd=work, log_path=log_path, cpu=cpu)
    wait_ready(base, "/readyz", proc, 60.0, log_path=log_path, poll_s=0.1)

    def stop() -> None:
        rc = terminate_group(proc)
        if rc != 0:
            print(f"# WARNING: rolltap-proxy ({kind}) exited with {rc}; see {log_path}", file=sys.stderr)
        if spool.is_dir() and any(spool.rglob("*.jsonl")):
            print(f"# WARNING: rolltap-proxy ({kind}) left spooled batches in {spool}", file=sys.stderr)

    return Server(kind, base, lambda rid: f"/rollout/{rid}/attempt/a%d/v1/chat/completions",
                  "/v1/chat/completions", proc, stop, db_url=db_url)


def start_litellm(replica: str, venv: Path, work: Path, cpu: int | None) -> Server:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = work / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {replica}/v1\n"
        "      api_key: none\n"
        # No auth, like Rolltap's relay routes (and no database): the like-for-like setup, and
        # LiteLLM's cheapest. It refuses to start without a master key unless told so.
        "general_settings:\n"
        "  dangerously_permit_weak_or_unset_master_key: true\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
        "  json_logs: false\n"
    )
    log_path = work / "litellm.log"
    env = _base_env() | {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the model cost map at start
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "DISABLE_SCHEMA_UPDATE": "True",
    }
    cmd = [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
           "--num_workers", "1", "--telemetry", "False"]
    proc = _spawn(cmd, env=env, cwd=work, log_path=log_path, cpu=cpu)
    wait_ready(base, "/health/liveliness", proc, 180.0, log_path=log_path, poll_s=0.1)
    return Server("litellm", base, lambda rid: None, "/v1/chat/completions", proc, lambda: terminate_group(proc, 20))


def start_agl(replica: str, venv: Path, work: Path, cpu: int | None) -> Server:
    log_path = work / "agl.log"

    def spawn() -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [str(venv / "bin" / "agl-server"), "host=127.0.0.1", f"port={port}", f"default_proxy.model_name={MODEL}",
               f"hydra.run.dir={work / 'agl-hydra'}", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
        proc = _spawn(cmd, env=_base_env(), cwd=work, log_path=log_path, cpu=cpu)
        wait_ready(base, "/healthz", proc, 60.0, log_path=log_path, poll_s=0.1)
        status, body, _ = _http("POST", base, "/api/models", [{"model": MODEL, "endpoint": f"{replica}/v1"}])
        if status != 201:
            raise RuntimeError(f"agl: registering the replica failed: {status} {body[:300]!r}")
        return base, proc

    base, proc = spawn()
    srv = Server("agl", base, lambda rid: f"/proxy/rollout/{rid}/attempt/a%d/mode/train/openai/v1/chat/completions",
                 "", proc, lambda: None, streams=False)

    def stop() -> None:
        if srv.proc is not None:
            terminate_group(srv.proc, 20)

    def respawn() -> None:
        stop()
        srv.base, srv.proc = spawn()

    def prepare(rollout_id: str) -> None:
        status, body, _ = _http("POST", srv.base, "/api/rollouts", [{"rollout_id": rollout_id, "input": {}}], timeout=120)
        if status != 201:
            raise RuntimeError(f"agl: creating rollout {rollout_id} failed: {status} {body[:300]!r}")

    srv.stop, srv.prepare, srv.respawn = stop, prepare, respawn
    return srv


# =============================================================================
# PostgreSQL
# =============================================================================


def create_pg_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"rolltap_bench_{os.getpid()}_{int(time.time())}"
    admin = make_url(admin_url)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, drop


# =============================================================================
# Load
# =============================================================================


def _cpu_busy(sample_s: float = 2.0) -> list[float]:
    """Fraction of each CPU busy over `sample_s` (from /proc/stat), before we start anything."""
    def read() -> list[tuple[int, int]]:
        out = []
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    v = [int(x) for x in line.split()[1:]]
                    out.append((sum(v), v[3] + v[4]))  # total, idle + iowait
        return out

    a = read()
    time.sleep(sample_s)
    b = read()
    return [1 - (bi[1] - ai[1]) / max(bi[0] - ai[0], 1) for ai, bi in zip(a, b, strict=True)]


def _proc_tree_cpu(pid: int) -> float:
    """utime+stime (s) of a process and every live descendant (threads are included in each)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2:].split()
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        stats[p] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo += children.get(p, [])
    return total


def _wait_idle(pid: int, *, window_s: float = 0.3, busy: float = 0.1, timeout_s: float = 120.0) -> float:
    """Wait until a server (and its children) uses less than `busy` of a core; seconds waited.

    A server keeps working on the requests wrk abandoned when its run ended (LiteLLM's proxy
    at concurrency 256 for many seconds): that work must neither land in the next target's
    measurement (on the same pinned CPU) nor go missing from this one's CPU per request.
    """
    started = time.monotonic()
    prev, t = _proc_tree_cpu(pid), started
    while time.monotonic() - started < timeout_s:
        time.sleep(window_s)
        cur, now = _proc_tree_cpu(pid), time.monotonic()
        if (cur - prev) / (now - t) < busy:
            break
        prev, t = cur, now
    return time.monotonic() - started


@dataclasses.dataclass
class Cell:
    mode: str
    conc: int
    target: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float | None
    errors: int
    requests: int
    ovh_p50: float | None = None
    ovh_p99: float | None = None


def request_body(stream: bool, max_tokens: int, prompt_bytes: int = 0) -> bytes:
    """A chat request; `prompt_bytes` pads it with earlier turns to about that size (an agent's context)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    turn = 0
    while prompt_bytes and len(json.dumps(messages)) < prompt_bytes:
        role = ("user", "assistant")[turn % 2]
        messages.append({"role": role, "content": f"Turn {turn}: " + "the tool printed 42 lines of output. " * 20})
        turn += 1
    messages.append({"role": "user", "content": "Say something."})
    req: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    if stream:
        req["stream"] = True
    return json.dumps(req, separators=(",", ":")).encode()


class Bench:
    def __init__(self, servers: list[Server], replica_pid: int, lua: str, args: argparse.Namespace) -> None:
        self.servers = servers
        self.replica_pid = replica_pid
        self.lua = lua
        self.args = args
        self.pin = not args.no_pin
        self.server_cpu, self.client_cpu = args.server_cpu, args.client_cpu
        self._seq = 0

    def _place_replica(self, direct: bool) -> None:
        # The server under test gets CPU 0: the replica when measured directly, else the proxy.
        if self.pin:
            os.sched_setaffinity(self.replica_pid, {self.server_cpu if direct else self.client_cpu})

    def one(self, srv: Server, mode: str, conc: int, duration: int, *, collect: bool = False,
            tag: str = "m") -> dict[str, Any]:
        self._seq += 1
        rid = f"bench-{srv.name}-{mode}-c{conc}-{tag}{self._seq}"
        if srv.prepare is not None:
            srv.prepare(rid)
        fmt = srv.path_fmt(rid)
        url = srv.base + (srv.static_path if fmt is None else "/")
        body = request_body(mode == "stream", self.args.max_tokens, self.args.prompt_bytes)
        pid = srv.cpu_pid or (srv.proc.pid if srv.proc is not None else self.replica_pid)
        cpu0 = _proc_tree_cpu(pid)
        res = run_wrk(url, body, conc, duration, self.lua, path_fmt=fmt, collect=collect,
                      cpu=self.client_cpu if self.pin else None)
        # CPU until the server is idle again (requests in flight when wrk stopped are
        # finished too), per request sent.
        res["drain_s"] = _wait_idle(pid)
        res["cpu_us"] = (_proc_tree_cpu(pid) - cpu0) / max(res["sent"], 1) * 1e6
        if fmt is not None:
            srv.rollouts[rid] = res["sent"]
        return res

    def cell(self, srv: Server, mode: str, conc: int) -> Cell:
        self._place_replica(srv.name == "direct")
        if srv.respawn is not None:
            srv.respawn()
        if self.args.warmup > 0:
            self.one(srv, mode, conc, self.args.warmup, tag="w")
        r = self.one(srv, mode, conc, self.args.duration)
        return Cell(mode, conc, srv.name, r["rps"], r["p50_us"] / 1e3, r["p99_us"] / 1e3,
                    r["cpu_us"], int(r["errors"] + r["non2xx"]), int(r["requests"]))

    def overhead_header(self, srv: Server, mode: str) -> Cell:
        """x-rolltap-overhead-ms of every response at concurrency 1 (the proxy's own account)."""
        self._place_replica(False)
        r = self.one(srv, mode, 1, self.args.header_duration, collect=True, tag="h")
        return Cell(mode, 1, srv.name, r["rps"], r["p50_us"] / 1e3, r["p99_us"] / 1e3, r["cpu_us"],
                    int(r["errors"] + r["non2xx"]), int(r["requests"]), r["ovh_p50"], r["ovh_p99"])


def check_targets_answer(servers: list[Server], max_tokens: int) -> None:
    """One call of each kind through each target before measuring: 200 and the canned content."""
    for srv in servers:
        for stream in (False, True):
            if stream and not srv.streams:
                continue
            rid = f"bench-check-{srv.name}"
            if srv.prepare is not None:
                srv.prepare(rid)
            fmt = srv.path_fmt(rid)
            path = srv.static_path if fmt is None else fmt % 0
            status, data, headers = _http("POST", srv.base, path, request_body(stream, max_tokens))
            if status != 200 or b"quick" not in data:
                raise RuntimeError(f"{srv.name}: {status} {data[:500]!r}")
            if stream and data.count(b"data: ") < max_tokens:
                raise RuntimeError(f"{srv.name}: stream has too few events: {data[:500]!r}")
            if fmt is not None:
                srv.rollouts[rid] = srv.rollouts.get(rid, 0) + 1


# =============================================================================
# Verification of the recorded calls
# =============================================================================


def verify_records(srv: Server) -> tuple[bool, str]:
    """Every request wrk sent is one row in `calls`, per rollout id; seq gap-free per attempt."""
    from sqlalchemy import create_engine, text

    from shared.db.engine import sync_url

    engine = create_engine(sync_url(srv.db_url or ""))
    try:
        with engine.connect() as conn:
            counts = {r[0]: int(r[1]) for r in conn.execute(
                text("SELECT rollout_id, count(*) FROM calls WHERE rollout_id LIKE 'bench-%' GROUP BY rollout_id"))}
            statuses = {r[0]: int(r[1]) for r in conn.execute(text("SELECT status, count(*) FROM calls GROUP BY status"))}
            bad_seq = conn.execute(text(
                "SELECT count(*) FROM (SELECT rollout_id, attempt_id FROM calls WHERE rollout_id LIKE 'bench-%' "
                "GROUP BY rollout_id, attempt_id HAVING count(*) <> count(DISTINCT seq) "
                "OR min(seq) <> 0 OR max(seq) <> count(*) - 1) AS t")).scalar_one()
            bad_num = conn.execute(text(
                "SELECT count(*) FROM attempts a WHERE a.rollout_id LIKE 'bench-%' AND a.num_calls <> "
                "(SELECT count(*) FROM calls c WHERE c.rollout_id = a.rollout_id AND c.attempt_id = a.attempt_id)"
            )).scalar_one()
    finally:
        engine.dispose()
    sent = sum(srv.rollouts.values())
    recorded = sum(counts.get(rid, 0) for rid in srv.rollouts)
    wrong = {rid: (n, counts.get(rid, 0)) for rid, n in srv.rollouts.items() if counts.get(rid, 0) != n}
    stray = set(counts) - set(srv.rollouts)
    ok = not wrong and not stray and bad_seq == 0 and bad_num == 0
    msg = (f"{LABELS[srv.name]}: sent {sent:,} calls in {len(srv.rollouts)} wrk runs, recorded {recorded:,} "
           f"(statuses: {', '.join(f'{k} {v:,}' for k, v in sorted(statuses.items()))}); "
           f"runs with a wrong count: {len(wrong)}; unknown rollouts: {len(stray)}; "
           f"attempts with bad seq: {bad_seq}; attempts whose num_calls is off: {bad_num} -> {'OK' if ok else 'FAIL'}")
    if wrong:
        msg += "\n    " + "; ".join(f"{rid}: sent {a}, recorded {b}" for rid, (a, b) in list(wrong.items())[:10])
    return ok, msg


# =============================================================================
# Report
# =============================================================================


def _median(cells: list[Cell]) -> Cell:
    c0 = cells[0]
    cpu = [c.cpu_us for c in cells if c.cpu_us is not None]
    ovh50 = [c.ovh_p50 for c in cells if c.ovh_p50 is not None]
    ovh99 = [c.ovh_p99 for c in cells if c.ovh_p99 is not None]
    return Cell(c0.mode, c0.conc, c0.target, statistics.median(c.rps for c in cells),
                statistics.median(c.p50_ms for c in cells), statistics.median(c.p99_ms for c in cells),
                statistics.median(cpu) if cpu else None, sum(c.errors for c in cells), sum(c.requests for c in cells),
                statistics.median(ovh50) if ovh50 else None, statistics.median(ovh99) if ovh99 else None)


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    if x == float("inf"):
        return "∞"
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def report(runs: list[dict[tuple[str, int, str], Cell]], targets: list[str]) -> tuple[str, dict[tuple[str, int, str], Cell]]:
    keys = list(runs[0])
    med = {k: _median([r[k] for r in runs if k in r]) for k in keys}
    lines = [
        "| mode | conc | target | req/s | req/s range | × direct | × LiteLLM | p50 ms | + p50 ms vs direct "
        "| p99 ms | + p99 ms vs direct | server CPU µs/req | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, conc, target in keys:
        c = med[(mode, conc, target)]
        d = med.get((mode, conc, "direct"))
        lt = med.get((mode, conc, "litellm"))
        lo = min(r[(mode, conc, target)].rps for r in runs)
        hi = max(r[(mode, conc, target)].rps for r in runs)
        # A cell whose median run completed nothing has no latency to show (all still waiting).
        none_done = c.rps == 0
        add50 = "–" if d is None or target == "direct" or none_done else f"{c.p50_ms - d.p50_ms:+.2f}"
        add99 = "–" if d is None or target == "direct" or none_done else f"{c.p99_ms - d.p99_ms:+.2f}"
        x_lt = None if lt is None or target == "litellm" else _ratio(c.rps, lt.rps)
        p50 = "–" if none_done else f"{c.p50_ms:.2f}"
        p99 = "–" if none_done else f"{c.p99_ms:.2f}"
        cpu = "–" if c.cpu_us is None or none_done else f"{c.cpu_us:,.0f}"
        lines.append(
            f"| {mode} | {conc} | {LABELS[target]} | {c.rps:,.0f} | {lo:,.0f}–{hi:,.0f} | "
            f"{_fmt_ratio(None if d is None else _ratio(c.rps, d.rps))} | {_fmt_ratio(x_lt)} | {p50} | {add50} | "
            f"{p99} | {add99} | {cpu} | {c.errors} |"
        )
    return "\n".join(lines), med


def evaluate(med: dict[tuple[str, int, str], Cell], runs: list[dict[tuple[str, int, str], Cell]]) -> list[str]:
    out = []
    for mode in ("non-stream", "stream"):
        s1, d1 = med.get((mode, 1, "sqlite")), med.get((mode, 1, "direct"))
        if s1 and d1:
            added = s1.p50_ms - d1.p50_ms
            out.append(f"- {mode}: added p50 at concurrency 1 (SQLite) = {added:.2f} ms (target <= 0.5 ms): "
                       f"{'MET' if added <= 0.5 else 'NOT MET'}")
        s32, d32, l32 = (med.get((mode, 32, t)) for t in ("sqlite", "direct", "litellm"))
        if s32 and l32:
            x = _ratio(s32.rps, l32.rps)
            out.append(f"- {mode}: throughput at concurrency 32 (SQLite) = {x:.1f}× LiteLLM's proxy (target >= 10×): "
                       f"{'MET' if x >= 10 else 'NOT MET'}")
        if s32 and d32:
            x = _ratio(s32.rps, d32.rps)
            out.append(f"- {mode}: throughput at concurrency 32 (SQLite) = {x:.2f}× direct (target >= 0.3×): "
                       f"{'MET' if x >= 0.3 else 'NOT MET'}")
        b32 = med.get((mode, 32, "bare"))
        if s32 and b32 and s32.cpu_us and b32.cpu_us:
            # Issue 23's target: what recording and routing cost per call, from outside (/proc), against
            # the least a Python relay can do on the same stack.
            target = 1.5 if mode == "non-stream" else 1.2
            x = s32.cpu_us / b32.cpu_us
            # Each repeat's own ratio too: its two cells ran minutes apart at most, so a machine that
            # drifts between repeats (a shared VM: the bare relay's cost moved 1.5x within one run)
            # shows as spread here rather than hiding in two medians taken from different repeats.
            paired = [r[(mode, 32, "sqlite")].cpu_us / r[(mode, 32, "bare")].cpu_us for r in runs  # type: ignore[operator]
                      if r.get((mode, 32, "sqlite")) and r.get((mode, 32, "bare"))
                      and r[(mode, 32, "sqlite")].cpu_us and r[(mode, 32, "bare")].cpu_us]
            out.append(f"- {mode}: server CPU per call at concurrency 32 (SQLite) = {x:.2f}× the bare relay's "
                       f"({s32.cpu_us:,.0f} vs {b32.cpu_us:,.0f} µs; target <= {target}×): "
                       f"{'MET' if x <= target else 'NOT MET'}; each repeat's own ratio: "
                       f"{', '.join(f'{p:.2f}' for p in paired)}")
        r32 = med.get((mode, 32, "bare-rolltap"))
        if s32 and r32 and s32.cpu_us and r32.cpu_us:
            out.append(f"- {mode}: server CPU per call at concurrency 32 (SQLite) = {s32.cpu_us / r32.cpu_us:.2f}× "
                       f"the bare relay's on Rolltap's own client ({s32.cpu_us:,.0f} vs {r32.cpu_us:,.0f} µs): "
                       "recording and routing alone")
        f32 = med.get((mode, 32, "floor"))
        if f32 and d32:
            out.append(f"- {mode}: the uvicorn floor (an ASGI app answering from memory, no proxying) reaches "
                       f"{_ratio(f32.rps, d32.rps):.2f}× direct at concurrency 32"
                       + (f"; Rolltap reaches {_ratio(s32.rps, f32.rps):.2f}× of that floor" if s32 else ""))
    return out


def _versions(args: argparse.Namespace) -> str:
    from importlib.metadata import version

    parts = [f"{p} {version(p)}" for p in ("uvicorn", "starlette", "aiohttp", "SQLAlchemy", "aiosqlite", "asyncpg")]
    for venv, pkg in ((args.litellm_venv, "litellm"), (args.agl_venv, "agentlightning")):
        py = Path(venv) / "bin" / "python"
        if py.exists():
            v = subprocess.run([str(py), "-c", f"from importlib.metadata import version; print(version('{pkg}'))"],
                               capture_output=True, text=True).stdout.strip()
            parts.append(f"{pkg} {v or '?'}")
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    parts.append((wrk.stdout + wrk.stderr).split("[")[0].strip() or "wrk ?")
    return ", ".join(parts)


# =============================================================================
# Main
# =============================================================================


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"comma-separated subset of {ALL_TARGETS}")
    p.add_argument("--concurrency", default="1,32,256")
    p.add_argument("--modes", default="non-stream,stream")
    p.add_argument("--duration", type=int, default=5, help="seconds per measured wrk run")
    p.add_argument("--warmup", type=int, default=2, help="seconds of unmeasured load before each measured run")
    p.add_argument("--header-duration", type=int, default=3, help="seconds of the x-rolltap-overhead-ms run")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-bytes", type=int, default=0,
                   help="pad each request with earlier turns to about this many bytes (an agent's context)")
    p.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test",
                   help="an existing database to connect to; a fresh one is created beside it and dropped")
    p.add_argument("--keep", action="store_true", help="keep the work directory and the PostgreSQL database")
    p.add_argument("--litellm-venv", default=str(REPO_ROOT / ".venv-bench"))
    p.add_argument("--agl-venv", default=str(REPO_ROOT / ".venv-agl"))
    p.add_argument("--no-pin", action="store_true", help="do not pin the server under test and wrk to CPUs")
    p.add_argument("--server-cpu", type=int, help="CPU for the server under test (default: the least busy one)")
    p.add_argument("--client-cpu", type=int, help="CPU for wrk and the replica (default: another one)")
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--setting", action="append", default=[], metavar="ROLLTAP_...=VALUE",
                   help="a setting for the Rolltap proxies under test, as its environment variable (repeatable; "
                   "e.g. ROLLTAP_DB__SQLITE_SYNCHRONOUS=NORMAL): what a knob costs per call")
    a = p.parse_args(argv)
    if a.out:  # before anything runs: `make bench-cpu` writes to .rolltap/, which a fresh clone lacks
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if any(not entry.startswith("ROLLTAP_") or "=" not in entry for entry in a.setting):
        p.error("--setting: want ROLLTAP_...=VALUE")
    settings = dict(entry.partition("=")[::2] for entry in a.setting)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    if (os.cpu_count() or 1) < 2:
        a.no_pin = True
    # The server under test gets the CPU that other work leaves freest (on a shared machine
    # other processes may be pinned to one of them); wrk and the replica get the other.
    busy = _cpu_busy()
    a.server_cpu = min(range(len(busy)), key=lambda i: busy[i]) if a.server_cpu is None else a.server_cpu
    a.client_cpu = next(i for i in range(len(busy)) if i != a.server_cpu) if a.client_cpu is None else a.client_cpu
    targets = [t for t in ALL_TARGETS if t in a.targets.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    modes = [m for m in ("non-stream", "stream") if m in a.modes.split(",")]
    notes: list[str] = []
    for name, venv, exe in (("litellm", a.litellm_venv, "litellm"), ("agl", a.agl_venv, "agl-server")):
        if name in targets and not (Path(venv) / "bin" / exe).exists():
            notes.append(f"{LABELS[name]}: skipped, {venv}/bin/{exe} not found (see the module docstring)")
            targets.remove(name)

    from bench.instant_replica import start_instant_replica

    started = datetime.datetime.now(datetime.UTC)
    header = [
        f"# {started.isoformat(timespec='seconds')} on {machine()}; CPUs busy before the run: "
        + ", ".join(f"cpu{i} {b:.0%}" for i, b in enumerate(busy)),
        f"# {_versions(a)}",
        f"# command: {' '.join(['.venv/bin/python -m bench.proxy_overhead', *(argv if argv is not None else sys.argv[1:])])}",
        f"# wrk -t1 {f'(CPU {a.client_cpu}; server under test on CPU {a.server_cpu})' if not a.no_pin else '(unpinned)'}, "
        f"{a.warmup} s warm-up + {a.duration} s per cell, {a.repeat} repeat(s), max_tokens={a.max_tokens}, prompt_bytes={a.prompt_bytes}, "
        "streams one SSE event per write",
    ]
    print("\n".join(header), flush=True)
    work = Path(tempfile.mkdtemp(prefix="rolltap-overhead-"))
    lua = work / "post.lua"
    lua.write_text(WRK_LUA)
    replica_url, stop_replica = start_instant_replica(model_name=MODEL, split_stream=True,
                                                      cpus=None if a.no_pin else {a.client_cpu})
    replica_pid = _replica_pid("protocol")
    servers: list[Server] = []
    drop_pg: Callable[[], None] | None = None
    verified_ok = True
    pin_cpu = None if a.no_pin else a.server_cpu
    try:
        for t in targets:
            if t == "direct":
                servers.append(Server("direct", replica_url, lambda rid: None, "/v1/chat/completions", None,
                                      lambda: None))
            elif t == "floor":
                floor_url, stop_floor = start_instant_replica(model_name=MODEL, split_stream=True, impl="asgi",
                                                              cpus=None if pin_cpu is None else {pin_cpu})
                servers.append(Server("floor", floor_url, lambda rid: None, "/v1/chat/completions", None,
                                      stop_floor, cpu_pid=_replica_pid("asgi")))
            elif t in ("bare", "bare-rolltap"):
                fwd = start_bare_forward(replica_url, 1024, "aiohttp" if t == "bare" else "rolltap")
                if pin_cpu is not None:
                    os.sched_setaffinity(fwd.proc.pid, {pin_cpu})
                servers.append(Server(t, fwd.url, lambda rid: None, "/v1/chat/completions", fwd.proc, fwd.stop))
            elif t == "sqlite":
                servers.append(start_rolltap("sqlite", replica_url, f"sqlite:///{work / 'rolltap.db'}", work, pin_cpu,
                                             settings))
            elif t == "postgres":
                pg_url, drop_pg = create_pg_database(a.pg_url)
                servers.append(start_rolltap("postgres", replica_url, pg_url, work, pin_cpu, settings))
            elif t == "litellm":
                servers.append(start_litellm(replica_url, Path(a.litellm_venv), work, pin_cpu))
            elif t == "agl":
                servers.append(start_agl(replica_url, Path(a.agl_venv), work, pin_cpu))
        check_targets_answer(servers, a.max_tokens)
        if any(not s.streams for s in servers):
            notes.append("Agent Lightning: streamed cells not run -- its gateway answers `stream: true` with "
                         "400 \"Streaming responses are not supported\"")
        bench = Bench(servers, replica_pid, str(lua), a)
        runs: list[dict[tuple[str, int, str], Cell]] = []
        headers_seen: list[Cell] = []
        for rep in range(a.repeat):
            cells: dict[tuple[str, int, str], Cell] = {}
            for mode in modes:
                for conc in concs:
                    order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                    for srv in order:
                        if mode == "stream" and not srv.streams:
                            continue
                        c = bench.cell(srv, mode, conc)
                        cells[(mode, conc, srv.name)] = c
                        print(f"  rep {rep + 1} {mode:10s} c={conc:<3d} {srv.name:8s} {c.rps:9,.0f} req/s  "
                              f"p50 {c.p50_ms:8.2f} ms  p99 {c.p99_ms:8.2f} ms  cpu {c.cpu_us or 0:7,.0f} µs/req"
                              f"  errors {c.errors}", flush=True)
            runs.append({k: cells[k] for k in sorted(cells, key=lambda k: (modes.index(k[0]), k[1], targets.index(k[2])))})
            for srv in servers:
                if srv.name in RECORDING:
                    for mode in modes:
                        h = bench.overhead_header(srv, mode)
                        headers_seen.append(h)
                        print(f"  rep {rep + 1} {mode:10s} c=1   {srv.name:8s} x-rolltap-overhead-ms p50 "
                              f"{h.ovh_p50:.3f} p99 {h.ovh_p99:.3f} (wrk p50 {h.p50_ms:.2f} ms)", flush=True)
        # Stop the recording proxies (SIGTERM flushes the queue), then count what they wrote.
        checks: list[str] = []
        for srv in servers:
            if srv.name in RECORDING:
                srv.stop()
                ok, msg = verify_records(srv)
                verified_ok &= ok
                checks.append(msg)
                print(f"# recorded calls: {msg}", flush=True)
        if a.out:
            Path(a.out + ".json").write_text(json.dumps(
                {"runs": [[dataclasses.asdict(c) for c in r.values()] for r in runs],
                 "headers": [dataclasses.asdict(h) for h in headers_seen], "checks": checks}, indent=1))
        table, med = report(runs, targets)
        ovh_lines = []
        for name in RECORDING:
            for mode in modes:
                hs = [h for h in headers_seen if h.target == name and h.mode == mode]
                if hs:
                    m = _median(hs)
                    d = med.get((mode, 1, "direct"))
                    ovh_lines.append(
                        f"| {mode} | {LABELS[name]} | {m.ovh_p50:.3f} | {m.ovh_p99:.3f} | "
                        f"{min(h.ovh_p50 or 0 for h in hs):.3f}–{max(h.ovh_p50 or 0 for h in hs):.3f} | "
                        f"{m.p50_ms:.2f} | {'–' if d is None else f'{m.p50_ms - d.p50_ms:+.2f}'} |")
        out = ["", f"## Results (median of {a.repeat} repeat(s); ranges are min–max of req/s over repeats)", "", table]
        if ovh_lines:
            out += ["", "x-rolltap-overhead-ms at concurrency 1 (the proxy's own time, replica wait excluded; "
                    f"every response of a {a.header_duration} s wrk run, median over repeats):", "",
                    "| mode | target | header p50 ms | header p99 ms | p50 range | wrk p50 ms | + p50 ms vs direct |",
                    "|---|---|---:|---:|---:|---:|---:|", *ovh_lines]
        out += ["", "Recorded calls:", *[f"- {c}" for c in checks]]
        out += ["", "Targets:", *evaluate(med, runs)]
        if notes:
            out += ["", "Notes:", *[f"- {n}" for n in notes]]
        text = "\n".join(out)
        print(text, flush=True)
        if a.out:
            Path(a.out).write_text("\n".join(header) + "\n" + text + "\n")
    finally:
        for srv in servers:
            try:
                srv.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"# stopping {srv.name}: {exc}", file=sys.stderr)
        stop_replica()
        if drop_pg is not None and not a.keep:
            drop_pg()
        if a.keep:
            print(f"# work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if not verified_ok:
        print("RECORDING CHECK FAILED: the databases do not hold exactly the calls sent", file=sys.stderr)
        return 1
    return 0


def _replica_pid(impl: str) -> int:
    """The pid of our instant-replica child of this implementation (there is one of each at most)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            continue
        if (ppid == os.getpid() and any(part.endswith(b"instant_replica.py") for part in cmdline)
                and cmdline[cmdline.index(b"--impl") + 1] == impl.encode()):
            return int(entry)
    raise RuntimeError(f"instant replica ({impl}) not found")


if __name__ == "__main__":
    sys.exit(main())
