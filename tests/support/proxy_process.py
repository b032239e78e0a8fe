"""The proxy as a real process (`python -m proxy.main`) to kill, signal and restart, and agents to load it.

Used by the crash and drain tests and by `bench/crash_soak.py`: the same harness for a
seconds-long CI proof and a minutes-long soak.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


class ProxyProcess:
    """One `python -m proxy.main` on a fixed port; `start()` again after a kill is a restart."""

    def __init__(self, workdir: Path, db_url: str, replicas: list[str], port: int, **env: str) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self._args = [sys.executable, "-m", "proxy.main", "--db", db_url, "--host", "127.0.0.1", "--port", str(port)]
        for replica in replicas:
            self._args += ["--replica", replica]
        base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLTAP_")}
        self._env = {**base, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
                     "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(workdir / "spool"),
                     "ROLLTAP_PROXY__HEALTH_INTERVAL_S": "0.5",
                     # Crash and drain tests are about recording; keys are tested in tests/proxy/test_access.py.
                     "ROLLTAP_PROXY__OPEN_ACCESS": "true", **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / "proxy.log"

    def start(self, timeout_s: float = 120.0) -> float:
        """Start and wait for `/healthz` (served only once start-up, recovery included, is done); seconds taken."""
        started = time.monotonic()
        with open(self.log_path, "ab") as log:  # a file, not a pipe: a full pipe would stall the proxy
            log.write(f"--- start {self.starts}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self._args, cwd=self.workdir, env=self._env, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.starts += 1
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"proxy exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout_s:
                raise AssertionError("proxy did not start:\n" + self.log_tail())
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def sigterm(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def rss_kb(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@dataclass
class Turn:
    """What one agent saw of one call."""

    rollout_id: str
    attempt_id: str
    call_id: str | None = None  # from `x-rolltap-call-id`: the response started
    http_status: int | None = None
    is_complete: bool = False  # the whole stream, `[DONE]` and its end, reached the client
    error: str | None = None
    retry_after: str | None = None  # the `Retry-After` header of a refused call


@dataclass
class AgentLog:
    turns: list[Turn] = field(default_factory=list)

    def by_attempt(self) -> dict[tuple[str, str], list[Turn]]:
        out: dict[tuple[str, str], list[Turn]] = {}
        for turn in self.turns:
            out.setdefault((turn.rollout_id, turn.attempt_id), []).append(turn)
        return out


async def stream_turn(client: httpx.AsyncClient, url: str, rollout_id: str, attempt_id: str,
                      body: dict[str, Any]) -> Turn:
    """One streamed chat call; never raises for transport errors (they are what is measured)."""
    turn = Turn(rollout_id, attempt_id)
    try:
        async with client.stream("POST", f"{url}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions",
                                 json=body) as response:
            turn.http_status = response.status_code
            turn.call_id = response.headers.get("x-rolltap-call-id")
            turn.retry_after = response.headers.get("retry-after")
            raw = b""
            async for chunk in response.aiter_raw():
                raw += chunk
            turn.is_complete = response.status_code == 200 and raw.rstrip().endswith(b"data: [DONE]")
            if response.status_code != 200:
                turn.error = raw[:300].decode(errors="replace")
    except (httpx.TransportError, httpx.StreamError) as exc:
        turn.error = exc.__class__.__name__
    return turn


async def run_agents(url: str, n_agents: int, attempt_of: Any, body_of: Any, stop: asyncio.Event, log: AgentLog,
                     *, stop_on_error: bool = True, pause_s: float = 0.0) -> None:
    """`n_agents` agents, each calling in turn (`attempt_of(i)` -> (rid, aid), `body_of(i, k)`) until `stop`.

    With `stop_on_error`, an agent stops at its first call that did not complete (the proxy
    died under it); otherwise it goes on (a replica or the database may come back).
    """
    limits = httpx.Limits(max_connections=n_agents + 8, max_keepalive_connections=n_agents + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=limits) as client:

        async def agent(i: int) -> None:
            k = 0
            while not stop.is_set():
                rid, aid = attempt_of(i)
                turn = await stream_turn(client, url, rid, aid, body_of(i, k))
                log.turns.append(turn)
                k += 1
                if not turn.is_complete:
                    if stop_on_error:
                        return
                    await asyncio.sleep(0.2)
                elif pause_s:
                    await asyncio.sleep(pause_s)

        await asyncio.gather(*(agent(i) for i in range(n_agents)))


def check_attempts(url: str, log: AgentLog, *, finish: bool = True, is_proxy_alive: bool = False,
                   violations: list[str] | None = None) -> dict[str, int]:
    """The crash guarantee, attempt by attempt; returns counts. Raises AssertionError on a violation.

    - every call the client saw complete is recorded `ok`, exactly once;
    - every call whose response started is recorded (ok, or interrupted when the proxy died);
    - a call no client saw start may be there only as `interrupted`;
    - seqs are 0..n-1 (no gap); an attempt with an interrupted call says `is_complete: false`,
      in GET and in `finish`;
    - with `is_proxy_alive` (the proxy never died under the load): one record per call that got
      an HTTP answer, whatever its status, and none for calls that got none.

    A violation raises AssertionError, or, given `violations`, is appended to it (a soak counts them all).
    """

    def fail(message: str) -> None:
        if violations is None:
            raise AssertionError(message)
        violations.append(message)

    counts = {"attempts": 0, "calls": 0, "complete_seen": 0, "started_seen": 0, "interrupted": 0,
              "incomplete_attempts": 0, "ok": 0}
    with httpx.Client(timeout=120) as client:
        for (rid, aid), turns in sorted(log.by_attempt().items()):
            got = client.get(f"{url}/rollout/{rid}/attempt/{aid}")
            seen_ids = {t.call_id for t in turns if t.call_id}
            if got.status_code == 404:
                if seen_ids:
                    fail(f"{rid}/{aid}: no attempt but the client saw calls {seen_ids}")
                continue
            if got.status_code != 200:
                fail(f"{rid}/{aid}: GET answered {got.status_code} {got.text}")
                continue
            attempt = got.json()
            calls = attempt["calls"]
            by_id: dict[str, dict[str, Any]] = {}
            for call in calls:
                if call["call_id"] in by_id:
                    fail(f"{rid}/{aid}: call {call['call_id']} recorded twice")
                by_id[call["call_id"]] = call
            if [c["seq"] for c in calls] != list(range(len(calls))):
                fail(f"{rid}/{aid}: seqs {[c['seq'] for c in calls]} have a gap")
            for turn in turns:
                if turn.is_complete:
                    if turn.call_id not in by_id:
                        fail(f"{rid}/{aid}: completed call {turn.call_id} missing")
                    elif by_id[turn.call_id]["status"] != "ok":
                        fail(f"{rid}/{aid}: completed call recorded {by_id[turn.call_id]['status']}")
                    counts["complete_seen"] += 1
                elif turn.call_id is not None and turn.http_status == 200:
                    if turn.call_id not in by_id:
                        fail(f"{rid}/{aid}: started call {turn.call_id} missing")
                    elif by_id[turn.call_id]["status"] not in ("ok", "interrupted", "failed"):
                        fail(f"{rid}/{aid}: started call recorded {by_id[turn.call_id]['status']}")
                    counts["started_seen"] += 1
            for call in calls:
                if call["call_id"] not in seen_ids:
                    if call["status"] not in ("interrupted", "failed"):
                        fail(f"{rid}/{aid}: unseen call {call['call_id']} recorded {call['status']}")
            if is_proxy_alive:
                answered = sum(t.http_status is not None for t in turns)
                if len(calls) != answered:
                    fail(f"{rid}/{aid}: {len(calls)} records for {answered} answered calls")
            interrupted = sum(c["status"] == "interrupted" for c in calls)
            if attempt["interrupted_calls"] != interrupted or attempt["is_complete"] is not (interrupted == 0):
                fail(f"{rid}/{aid}: GET says is_complete {attempt['is_complete']}, {interrupted} interrupted")
            if finish:
                done = client.post(f"{url}/rollout/{rid}/attempt/{aid}/finish", json={"status": "succeeded"})
                if done.status_code != 200:
                    fail(f"{rid}/{aid}: finish answered {done.status_code} {done.text}")
                elif done.json()["is_complete"] is not (interrupted == 0):
                    fail(f"{rid}/{aid}: finish says {done.json()}")
            counts["attempts"] += 1
            counts["calls"] += len(calls)
            counts["ok"] += sum(c["status"] == "ok" for c in calls)
            counts["interrupted"] += interrupted
            counts["incomplete_attempts"] += interrupted > 0
    return counts
