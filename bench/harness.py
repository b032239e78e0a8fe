"""What the benchmark scripts share: ports, readiness waits, stopping children, CPU time, wrk.

Only process and load plumbing lives here; what a benchmark measures stays in its own script.
Readiness is polled with `http.client`, not urllib or httpx: those honour `http_proxy`
variables, and a benchmark's loopback calls must never go through a proxy of the machine's.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["REPO_ROOT", "WRK_LUA", "cpu_seconds", "descendants", "free_port", "http_get", "listen", "machine", "run_wrk", "stop_process",
           "terminate_group", "tree_cpu_seconds", "wait_ready"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket to hand to a child (no bind race, no port discovery)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def http_get(url: str, path: str, timeout_s: float) -> tuple[int, bytes] | None:
    """`GET url+path` over loopback: status and body, or None when nothing answered."""
    hostport = url.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return None
    finally:
        conn.close()


def _answers_200(url: str, path: str, timeout_s: float) -> bool:
    answer = http_get(url, path, timeout_s)
    return answer is not None and answer[0] == 200


def wait_ready(url: str, path: str, proc: subprocess.Popen[bytes], timeout_s: float, *,
               log_path: Path | None = None, poll_s: float = 0.05) -> None:
    """Poll `GET url+path` until it answers 200; raise if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not _answers_200(url, path, 2.0):
        if proc.poll() is not None:
            tail = f"; {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}" if log_path else ""
            raise RuntimeError(f"{url} exited with {proc.returncode} during start-up{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f} s" + (f"; see {log_path}" if log_path else ""))
        time.sleep(poll_s)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL past `timeout_s`; idempotent."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def terminate_group(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    """The same for a child started with `start_new_session` and its children (a CLI's workers)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def cpu_seconds(pid: int, *, waited_children: bool = False) -> float:
    """utime + stime of a process from /proc (Linux), with its waited-for children's if asked; 0 once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return 0.0
    fields = stat[stat.rfind(b")") + 2:].split()
    ticks = sum(int(v) for v in fields[11:15 if waited_children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> set[int]:
    """A live process and all its live descendants (forked workers, vLLM's engine and API servers)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_bytes()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(raw[raw.rfind(b")") + 2:].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        kids = [child for child, parent in parents.items() if parent in frontier]
        tree.update(kids)
        frontier = kids
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process and all its live descendants."""
    return sum(cpu_seconds(p) for p in descendants(pid))


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        model = "?"
    return (f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


# wrk: POST the body; with RT_PATH_FMT, a per-request path ("%d" = the attempt index, one per
# connection on average); count every request written (`sent`) so the databases can be checked
# against it; with RT_COLLECT, keep every x-rolltap-overhead-ms header value.
WRK_LUA = r"""
wrk.method = "POST"
wrk.body = os.getenv("RT_BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("RT_AGENT_KEY") or "none")
local fmt = os.getenv("RT_PATH_FMT")
local attempts = tonumber(os.getenv("RT_ATTEMPTS") or "1")
sent = 0
ovh = {}
local threads = {}

setup = function(thread)
  table.insert(threads, thread)
end

request = function()
  sent = sent + 1
  if fmt then
    return wrk.format(nil, string.format(fmt, sent % attempts))
  end
  return wrk.format()
end

if os.getenv("RT_COLLECT") then
  response = function(status, headers, body)
    local v = headers["x-rolltap-overhead-ms"]
    if v then ovh[#ovh + 1] = tonumber(v) end
  end
end

done = function(summary, latency, requests)
  -- wrk calls request() once more, on the first thread, to check the request before
  -- starting (script_verify_request): that call sends nothing.
  local total_sent = -1
  local values = {}
  for _, t in ipairs(threads) do
    total_sent = total_sent + t:get("sent")
    local o = t:get("ovh")
    if o then for _, v in ipairs(o) do values[#values + 1] = v end end
  end
  table.sort(values)
  local function pct(p)
    if #values == 0 then return -1 end
    return values[math.max(1, math.ceil(#values * p / 100))]
  end
  local e = summary.errors
  io.write(string.format(
    'RT_RESULT {"requests":%d,"sent":%d,"duration_us":%d,"errors":%d,"non2xx":%d,' ..
    '"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,"mean_us":%.1f,"ovh_n":%d,"ovh_p50":%.4f,"ovh_p90":%.4f,' ..
    '"ovh_p99":%.4f}\n',
    summary.requests, total_sent, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, #values, pct(50),
    pct(90), pct(99)))
end
"""


def run_wrk(url: str, body: bytes, conc: int, duration_s: int, lua: str, *, path_fmt: str | None = None,
            collect: bool = False, cpu: int | None = None) -> dict[str, Any]:
    """One `wrk -t1` run with `WRK_LUA` (written to the file `lua`); its RT_RESULT line, plus `rps`."""
    cmd = ["wrk", "-t1", f"-c{conc}", f"-d{duration_s}s", "--timeout", "10s", "-s", lua, url]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    env = dict(os.environ, RT_BODY=body.decode(), RT_ATTEMPTS=str(conc))
    if path_fmt:
        env["RT_PATH_FMT"] = path_fmt
    if collect:
        env["RT_COLLECT"] = "1"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("RT_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    res: dict[str, Any] = json.loads(line.removeprefix("RT_RESULT "))
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    return res
