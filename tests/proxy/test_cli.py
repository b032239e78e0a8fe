"""The real `rolltap-proxy` console script: flags, their environment twins, SIGTERM, bad config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from shared.db.engine import sync_url
from shared.settings import ProxySettings
from tests.support.proxy_process import ROOT
from tests.support.servers import free_port

SCRIPT = Path(sys.executable).parent / "rolltap-proxy"
AGENT_KEY = "rk-cli-test-agent-key-0123456789abcdef0123456789"  # configured through ROLLTAP_PROXY__AGENT_KEY
AUTH = {"authorization": f"Bearer {AGENT_KEY}"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLTAP_")}
    return {**env, "PYTHONUNBUFFERED": "1", "ROLLTAP_PROXY__AGENT_KEY": AGENT_KEY, **extra}


@contextmanager
def running(args: list[str], cwd: Path, port: int, **env: str) -> Iterator[subprocess.Popen[str]]:
    """Start the script, wait until it answers `/healthz`, and make sure it is gone afterwards."""
    log = open(cwd / "proxy.log", "w+")  # a file, not a pipe: a full pipe would stall the proxy
    proc = subprocess.Popen([str(SCRIPT), *args], cwd=cwd, env=_env(**env), stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"rolltap-proxy exited {proc.returncode}:\n{(cwd / 'proxy.log').read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("rolltap-proxy did not start:\n" + (cwd / "proxy.log").read_text())
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _rows(db_url: str) -> list[Any]:
    engine = create_engine(sync_url(db_url))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(
                "SELECT call_id, rollout_id, seq, status, is_streaming, completion_token_ids, finish_reason "
                "FROM calls ORDER BY started_at")).all())
    finally:
        engine.dispose()


def _chat(port: int, rollout: str, **body: Any) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/rollout/{rollout}/attempt/0/v1/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, headers=AUTH,
                      timeout=30)


def test_flags_then_sigterm_lets_a_stream_finish(replica: str, tmp_path: Path) -> None:
    port, db_url = free_port(), f"sqlite:///{tmp_path / 'cli.db'}"
    args = ["--replica", replica, "--db", db_url, "--host", "127.0.0.1", "--port", str(port)]
    with running(args, tmp_path, port) as proc:
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        first = _chat(port, "cli", max_tokens=2)
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == "ok"

        # A slow stream: 10 chunks, 0.2 s apart. SIGTERM arrives while it runs.
        chunks: list[bytes] = []
        first_chunk = threading.Event()
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                body = {"model": "m", "messages": [], "stream": True, "max_tokens": 10, "fault": {"delay_s": 0.2}}
                with httpx.stream("POST", f"http://127.0.0.1:{port}/rollout/cli/attempt/0/v1/chat/completions",
                                  json=body, headers=AUTH, timeout=30) as response:
                    assert response.status_code == 200
                    for chunk in response.iter_raw():
                        chunks.append(chunk)
                        first_chunk.set()
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                failure.append(exc)
                first_chunk.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: no new relayed call, but the proxy still answers while the stream goes on.
        assert proc.poll() is None and client.is_alive()
        refused = _chat(port, "cli-late", max_tokens=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "proxy_draining"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        client.join(timeout=30)
        assert proc.wait(timeout=30) == 0, (tmp_path / "proxy.log").read_text()

    assert not failure, failure
    raw = b"".join(chunks)
    events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert len(events) == 11 and events[-1] == b"data: [DONE]"  # the whole stream, to the end

    rows = _rows(db_url)
    assert [(r.rollout_id, r.seq, r.status, r.is_streaming) for r in rows] == [
        ("cli", 0, "ok", False), ("cli", 1, "ok", True), ("cli-late", 0, "failed", False)]  # refused: recorded
    streamed = rows[1]
    assert streamed.finish_reason == "length"
    assert json.loads(streamed.completion_token_ids) == list(range(100, 110))  # SQLite hands JSON back as text


def test_environment_equivalents(replica: str, tmp_path: Path) -> None:
    port, db_url = free_port(), f"sqlite:///{tmp_path / 'env.db'}"
    env = {"ROLLTAP_PROXY__REPLICAS": f"{replica}/v1", "ROLLTAP_DB__URL": db_url, "ROLLTAP_PROXY__PORT": str(port),
           "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(tmp_path / "spool")}
    with running([], tmp_path, port, **env) as proc:
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
        assert _chat(port, "env", max_tokens=2).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert [(r.rollout_id, r.status) for r in _rows(db_url)] == [("env", "ok")]


def test_flags_win_over_environment(replica: str, tmp_path: Path) -> None:
    port, env_port = free_port(), free_port()
    db_url = f"sqlite:///{tmp_path / 'flag.db'}"
    env = {"ROLLTAP_PROXY__REPLICAS": "http://127.0.0.1:9", "ROLLTAP_DB__URL": f"sqlite:///{tmp_path / 'env.db'}",
           "ROLLTAP_PROXY__PORT": str(env_port)}
    args = ["--replica", replica, "--db", db_url, "--port", str(port)]
    with running(args, tmp_path, port, **env) as proc:
        assert _chat(port, "flag", max_tokens=2).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert len(_rows(db_url)) == 1
    assert not (tmp_path / "env.db").exists()


def test_no_replica_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run([str(SCRIPT), "--db", f"sqlite:///{tmp_path / 'x.db'}"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "no replica configured" in out.stderr and "--replica" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "x.db").exists()  # refused before touching anything


def test_bad_replica_url_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run([str(SCRIPT), "--replica", "localhost:8000"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "replica URL must start with http" in out.stderr


@pytest.fixture
def pg_url_with_password() -> Iterator[tuple[str, str]]:
    """A PostgreSQL database owned by a role with a password, and a URL that carries it."""
    import uuid

    import psycopg

    from tests.support.databases import PG_ADMIN_DSN, postgres_database

    role, password = "rolltap_pw_" + uuid.uuid4().hex[:8], "pw-" + uuid.uuid4().hex
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    try:
        with postgres_database() as url:  # dropped (WITH FORCE) before the role that owns its tables
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
                admin.execute(f'ALTER DATABASE "{url.rsplit("/", 1)[1]}" OWNER TO {role}')
            yield f"postgresql://{role}:{password}@{url.split('@', 1)[1]}", password
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")


def test_no_secret_in_any_log(replica: str, tmp_path: Path, pg_url_with_password: tuple[str, str]) -> None:
    """A whole session at DEBUG (keys CLI, proxy, trainer CLI, a refused DB): no password, token or key logged."""
    db_url, password = pg_url_with_password
    admin_token = "adm-" + os.urandom(16).hex()
    created = subprocess.run([str(SCRIPT), "keys", "--db", db_url, "create", "--rollout-prefix", "sec-"],
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    scoped_key = created.stdout.split("key: ", 1)[1].split()[0]
    port = free_port()
    args = ["--replica", replica, "--db", db_url, "--port", str(port), "--log-level", "debug"]
    with running(args, tmp_path, port, ROLLTAP_PROXY__ADMIN_TOKEN=admin_token,
                 ROLLTAP_PROXY__KEYS_REFRESH_S="0.2") as proc:
        base = f"http://127.0.0.1:{port}"
        time.sleep(1.1)  # the key created above is past the once-a-second reload on an unknown key
        scoped = {"authorization": f"Bearer {scoped_key}"}
        assert _chat(port, "sec-1").status_code == 200
        r = httpx.post(f"{base}/rollout/sec-1/attempt/0/v1/chat/completions", headers=scoped, timeout=30,
                       json={"model": "m", "messages": [], "stream": True, "max_tokens": 3})
        assert r.status_code == 200
        assert httpx.post(f"{base}/rollout/other/attempt/0/finish", headers=scoped, json={}).status_code == 403
        assert httpx.post(f"{base}/rollout/sec-1/attempt/0/finish", headers={"x-api-key": scoped_key},
                          json={"reward": 1}).status_code == 200
        assert httpx.get(f"{base}/rollout/sec-1/attempt/0", headers=scoped).status_code == 200
        assert httpx.get(f"{base}/admin/replicas", headers={"authorization": f"Bearer {admin_token}"}).status_code == 200
        assert httpx.get(f"{base}/admin/replicas", headers=scoped).status_code == 401
        assert httpx.post(f"{base}/v1/chat/completions", headers={"authorization": "Bearer rk-nope"},
                          json={}).status_code == 401
        metrics = httpx.get(f"{base}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    proxy_log = (tmp_path / "proxy.log").read_text()
    assert '"log_level":"debug"' in proxy_log and "***@" in proxy_log  # at DEBUG, settings logged (masked)
    # The trainer CLI at DEBUG on the same database, and both CLIs against a database that refuses them.
    stats = subprocess.run([sys.executable, "-m", "trainer.main", "--db", db_url, "--log-level", "debug", "stats"],
                           env=_env(), capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0, stats.stderr
    down_url = db_url.replace("@127.0.0.1:5432", "@127.0.0.1:9").replace("@localhost:5432", "@127.0.0.1:9")
    assert down_url != db_url
    refused = subprocess.run([str(SCRIPT), "--replica", replica, "--db", down_url, "--log-level", "debug",
                              "--port", str(free_port())], env=_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    texts = {"proxy": proxy_log, "metrics": metrics, "keys cli stderr": created.stderr,
             "trainer": stats.stdout + stats.stderr, "refused db": refused.stdout + refused.stderr}
    for secret in (password, admin_token, AGENT_KEY, scoped_key):
        for name, output in texts.items():
            assert secret not in output, f"a secret is in the {name} output"


def _get_healthz(sock: socket.socket) -> bytes:
    """One `GET /healthz` on an open connection: the whole response (head and body) as it came."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: proxy\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < _content_length(got):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {got!r}"
        got += chunk
    return got


def _content_length(response: bytes) -> int:
    head = response.partition(b"\r\n\r\n")[0].lower()
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:"))


def test_idle_client_connections_outlive_the_clients_pools(replica: str, tmp_path: Path) -> None:
    # The default outlasts the idle expiry of httpx's pool (5 s) and aiohttp's (15 s): the client,
    # not the proxy, closes an idle connection, so no call is sent on one the proxy is closing.
    assert ProxySettings().keep_alive_s > max(httpx.Limits().keepalive_expiry or 0, 15)
    port, db_url = free_port(), f"sqlite:///{tmp_path / 'ka.db'}"
    args = ["--replica", replica, "--db", db_url, "--host", "127.0.0.1", "--port", str(port)]
    with running(args, tmp_path, port, ROLLTAP_PROXY__KEEP_ALIVE_S="2"), \
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert _get_healthz(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # idle for less than keep_alive_s: the same connection still serves
        assert _get_healthz(sock).startswith(b"HTTP/1.1 200")
        time.sleep(3.0)  # idle for longer: the proxy has closed it
        assert sock.recv(65536) == b""


def test_help_lists_the_subcommands() -> None:
    """A new user's `rolltap-proxy --help` names every subcommand with a line each; `serve` is the default."""
    shown = subprocess.run([sys.executable, "-m", "proxy.main", "--help"], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout
    listed = {line.split()[0] for line in shown.split("subcommands:", 1)[1].splitlines() if line.strip()}
    assert listed == {"serve", "keys", "spool"}
    explicit = subprocess.run([sys.executable, "-m", "proxy.main", "serve", "--help"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout
    assert explicit == shown
