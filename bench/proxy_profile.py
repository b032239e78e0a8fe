"""Benchmark: where the proxy's CPU goes per call, from a sampling profile under load.

Starts an instant replica (`bench.instant_replica`) and the real `rolltap-proxy` on SQLite,
drives tracked chat calls at `--concurrency` with wrk (the Lua script of
`bench.proxy_overhead`), and samples the proxy process with py-spy (`--native` off, 100 Hz)
for `--duration` seconds. The samples are folded into the proxy's own work by module
(`proxy/relay.py`, `proxy/recorder.py`, ...) and the libraries under it (uvicorn and
starlette, aiohttp, SQLAlchemy and the database driver, orjson, the event loop), by the
innermost frame that belongs to one of them ("self" time), so the shares add up to 100%.

py-spy is a profiler, not a dependency: install it beside the venv, e.g.
`.venv/bin/pip install --target /tmp/pyspy py-spy`, and pass `--py-spy /tmp/pyspy/bin/py-spy`.
It needs ptrace (root, or `kernel.yama.ptrace_scope=0`). Needs `wrk`.

    .venv/bin/python -m bench.proxy_profile --py-spy /tmp/pyspy/bin/py-spy --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import WRK_LUA, cpu_seconds, run_wrk, stop_process, wait_ready
from bench.instant_replica import start_instant_replica
from bench.proxy_overhead import request_body

ROOT = Path(__file__).resolve().parent.parent
AGENT_KEY = "rt-bench-profile-key"

# py-spy names a frame `function (package/module.py:line)`; a sample is charged to the innermost
# frame whose top-level package is one of these (our own code per module), so shares add to 100%.
_PACKAGES: dict[str, str] = {
    "sqlalchemy": "SQLAlchemy", "aiosqlite": "aiosqlite / sqlite3", "sqlite3": "aiosqlite / sqlite3",
    "aiohttp": "aiohttp (upstream client)", "yarl": "aiohttp (upstream client)",
    "multidict": "aiohttp (upstream client)", "uvicorn": "uvicorn (HTTP server)",
    "httptools": "uvicorn (HTTP server)", "h11": "uvicorn (HTTP server)", "starlette": "starlette / FastAPI",
    "fastapi": "starlette / FastAPI", "pydantic": "pydantic", "orjson": "orjson",
    "asyncio": "asyncio event loop", "uvloop": "asyncio event loop", "logging": "logging",
}


def _bucket(frame: str) -> str | None:
    path = frame.rpartition(" (")[2].rsplit(":", 1)[0]
    top = path.split("/", 1)[0]
    if top in ("proxy", "shared"):
        return path
    return _PACKAGES.get(top)


def module_bucket(frame: str) -> str:
    """Any process: the innermost frame's file for `vllm` (its module), its top-level package otherwise."""
    path = frame.rpartition(" (")[2].rsplit(":", 1)[0]
    top = path.split("/", 1)[0]
    return path if top == "vllm" else top


def fold(raw: str, bucket: Callable[[str], str | None] = _bucket) -> dict[str, float]:
    """py-spy's raw (collapsed) output -> share of samples per bucket, innermost known frame first."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        name = next((b for f in reversed(frames) if (b := bucket(f)) is not None), "other (interpreter, idle)")
        counts[name] += int(n)
    total = sum(counts.values()) or 1
    return {k: round(100 * v / total, 1) for k, v in counts.most_common()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=int, default=15, help="seconds sampled (wrk runs 3 s longer)")
    p.add_argument("--stream", action="store_true", help="streamed calls instead of whole ones")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per call (one SSE chunk each, streamed)")
    p.add_argument("--port", type=int, default=8097)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rolltap-profile-"))
    lua = work / "bench.lua"
    lua.write_text(WRK_LUA)
    replica_url, stop_replica = start_instant_replica()
    env = dict(os.environ, ROLLTAP_PROXY__OPEN_ACCESS="true", ROLLTAP_PROXY__AGENT_KEY=AGENT_KEY,
               ROLLTAP_PROXY__RECORDER__SPOOL_DIR=str(work / "spool"), RT_AGENT_KEY=AGENT_KEY)
    os.environ["RT_AGENT_KEY"] = AGENT_KEY
    proxy = subprocess.Popen([str(Path(sys.executable).parent / "rolltap-proxy"), "--db", f"sqlite:///{work / 'p.db'}",
                              "--port", str(args.port), "--replica", replica_url], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, "/readyz", proxy, 60.0, poll_s=0.2)
        body = request_body(args.stream, args.max_tokens)
        fmt = f"/rollout/profile-{int(time.time())}/attempt/a%d/v1/chat/completions"
        run_wrk(url, body, args.concurrency, 3, str(lua), path_fmt=fmt)  # warm-up, unmeasured
        result: dict[str, Any] = {}
        load = threading.Thread(target=lambda: result.update(
            run_wrk(url, body, args.concurrency, args.duration + 3, str(lua), path_fmt=fmt)))
        load.start()
        time.sleep(1.5)
        cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
        raw = subprocess.run([args.py_spy, "record", "--pid", str(proxy.pid), "--duration", str(args.duration),
                              "--rate", "100", "--format", "raw", "--output", str(work / "raw.txt"), "--nonblocking"],
                             capture_output=True, text=True, check=True)
        cpu_s, wall_s = cpu_seconds(proxy.pid) - cpu0, time.monotonic() - t0
        load.join()
        shares = fold((work / "raw.txt").read_text())
        report = {"concurrency": args.concurrency, "stream": args.stream, "calls_per_s": round(result["rps"], 1),
                  "max_tokens": args.max_tokens, "rollout_logprobs": env.get("ROLLTAP_PROXY__ROLLOUT_LOGPROBS", "on"),
                  # py-spy's own sampling is charged to the proxy too: compare runs, not absolutes
                  "proxy_cpu_us_per_call": round(cpu_s / (result["rps"] * wall_s) * 1e6, 1),
                  "proxy_cpu_share_of_a_core": round(cpu_s / wall_s, 2),
                  "samples_file": str(work / "raw.txt"), "share_of_samples_pct": shares,
                  "py_spy": raw.stderr.strip().splitlines()[-1:] or []}
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text)
    finally:
        stop_process(proxy, 30.0)
        stop_replica()


if __name__ == "__main__":
    main()
