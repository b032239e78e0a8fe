"""Slow clients, through real sockets against a real proxy: how long a request may take to arrive.

A connection must bring its header block within `limits.header_timeout_s` and its body within
`limits.body_timeout_s`, and may sit idle `keep_alive_s`; a response is never cut by any of them.
Storage is involved only where a refused call is recorded (both databases); the rest runs on SQLite.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import ProxyFactory
from tests.support.servers import RunningProxy

AGENT_KEY = "rk-test-timeouts-agent-key-0000000000000000000000"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_PATH = "/rollout/{}/attempt/0/v1/chat/completions"
sqlite_only = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _connect(proxy: RunningProxy) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the proxy sends until it closes the connection, and the seconds that took."""
    started = time.monotonic()
    data = b""
    while True:
        left = limit_s - (time.monotonic() - started)
        if left <= 0:
            raise AssertionError(f"connection still open after {limit_s} s; received {data[:300]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started


def _drip(sock: socket.socket, data: bytes, interval_s: float, limit_s: float) -> tuple[bytes, float]:
    """Send `data` one byte every `interval_s` until the proxy answers or closes; what it sent, and
    the seconds from the first byte to the connection's end."""
    started = time.monotonic()
    for byte in data:
        readable, _, _ = select.select([sock], [], [], interval_s)
        if readable:
            break
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"connection still open after {limit_s} s of dripping")
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
    else:
        raise AssertionError("the whole request was dripped without an answer")
    answer, _ = _until_closed(sock, 10)
    return answer, time.monotonic() - started


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a `content-length` body, however the segments arrive."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the response's headers ended: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the response's body ended: {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def _head(method: str, path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: proxy", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_and_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return status, error


@sqlite_only
def test_unused_connection_closed_after_header_timeout(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], limits={"header_timeout_s": 0.5}) as proxy, _connect(proxy) as sock:
        answer, waited = _until_closed(sock, 5)
        assert answer == b"" and 0.3 < waited < 2.5, (answer, waited)  # nothing of a request came: no 408


@sqlite_only
def test_unused_connection_closed_after_keep_alive(proxy_for: ProxyFactory, replica: str) -> None:
    # Idle time counts from the connection's opening too, not only after a response.
    with proxy_for([replica], keep_alive_s=1, limits={"header_timeout_s": 60}) as proxy, _connect(proxy) as sock:
        answer, waited = _until_closed(sock, 5)
        assert answer == b"" and 0.8 < waited < 3.0, (answer, waited)


@sqlite_only
def test_dripped_header_block_closed_with_408(proxy_for: ProxyFactory, replica: str) -> None:
    # No key needed to hold a connection: the header block that would carry it never ends.
    with proxy_for([replica], open_access=False, agent_key=AGENT_KEY, limits={"header_timeout_s": 0.5}) as proxy:
        endless = _head("POST", CHAT_PATH.format("drip"), "content-type: application/json")[:-2] + b"x-pad: " + b"a" * 500
        with _connect(proxy) as sock:
            answer, waited = _drip(sock, endless, 0.05, 5)
        assert waited < 2.5, waited
        status, error = _status_and_error(answer)
        assert status == 408 and error["code"] == "header_timeout", answer
        assert b"connection: close" in answer.lower()
        # On a kept-alive connection the time runs from a request's first byte, not from the last response.
        with _connect(proxy) as sock:
            sock.sendall(_head("GET", "/healthz"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")  # whole: a late body would read as the answer
            time.sleep(0.8)  # idle longer than header_timeout_s: allowed (keep_alive_s)
            answer, waited = _drip(sock, endless, 0.05, 5)
        assert _status_and_error(answer)[0] == 408 and waited < 2.5, (answer, waited)


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_dripped_body_gets_408_and_holds_no_slot(proxy_for: ProxyFactory, replica: str) -> None:
    limits = {"max_calls_per_key": 1, "header_timeout_s": 0.5, "body_timeout_s": 2.0}
    auth = {"authorization": f"Bearer {AGENT_KEY}"}
    with proxy_for([replica], open_access=False, agent_key=AGENT_KEY, limits=limits) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30, headers=auth) as client:
        body = orjson.dumps(CHAT)
        head = _head("POST", CHAT_PATH.format("slow"), "content-type: application/json",
                     f"content-length: {len(body)}", f"authorization: Bearer {AGENT_KEY}")
        result: list[tuple[bytes, float]] = []
        with _connect(proxy) as sock:
            sock.sendall(head)
            dripper = threading.Thread(target=lambda: result.append(_drip(sock, body, 0.1, 10)))
            dripper.start()
            try:
                time.sleep(0.5)
                # The same key, limited to one call in flight, while the first call's body still drips.
                assert client.post(CHAT_PATH.format("fast"), json=CHAT).status_code == 200
            finally:
                dripper.join(15)
        ((answer, waited),) = result
        assert 1.5 < waited < 5, waited
        status, error = _status_and_error(answer)
        assert status == 408 and error["code"] == "body_timeout", answer
        assert b"connection: close" in answer.lower()
        # Recorded once, as the refusal it is; the key's slot was never taken, so it is free.
        calls = client.get("/rollout/slow/attempt/0").json()["calls"]
        assert [(c["status"], c["http_status"]) for c in calls] == [("invalid_request", 408)]
        assert client.post(CHAT_PATH.format("fast"), json=CHAT).status_code == 200


@sqlite_only
def test_dripped_body_of_other_routes(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], limits={"header_timeout_s": 0.5, "body_timeout_s": 1.0}) as proxy:
        body = orjson.dumps({"rollout_id": "r1", "task": "t" * 200})
        head = _head("POST", "/rollouts", "content-type: application/json", f"content-length: {len(body)}")
        with _connect(proxy) as sock:
            sock.sendall(head)
            answer, waited = _drip(sock, body, 0.1, 10)
        status, error = _status_and_error(answer)
        assert status == 408 and error["code"] == "body_timeout" and waited < 4, (answer, waited)
        # A route that answers without reading the body: the connection still ends body_timeout_s on.
        with _connect(proxy) as sock:
            sock.sendall(_head("GET", "/healthz", "content-length: 1000"))
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
            answer, waited = _drip(sock, b"x" * 1000, 0.1, 10)
        assert answer == b"" and waited < 3.5, (answer, waited)


@sqlite_only
def test_keep_alive_idle_after_a_response(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], keep_alive_s=2, limits={"header_timeout_s": 0.5}) as proxy, _connect(proxy) as sock:
        sock.sendall(_head("GET", "/healthz"))
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # past header_timeout_s, within keep_alive_s: the connection is still usable
        sock.sendall(_head("GET", "/healthz"))
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        answer, waited = _until_closed(sock, 6)
        assert answer == b"" and 1.5 < waited < 4, (answer, waited)


@sqlite_only
def test_http10_chunked_refused(proxy_for: ProxyFactory, replica: str) -> None:
    body = orjson.dumps(CHAT)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with proxy_for([replica]) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
        for path in (CHAT_PATH.format("old"), "/rollouts"):
            with _connect(proxy) as sock:
                sock.sendall(_head("POST", path, "content-type: application/json", "transfer-encoding: chunked",
                                   version="1.0") + chunked)
                answer, _ = _until_closed(sock, 10)
            status, error = _status_and_error(answer)
            assert status == 400 and error["code"] == "chunked_http10", answer
        assert client.get("/rollout/old/attempt/0").status_code == 404  # refused before the relay: no record
        # HTTP/1.0 with a length is served.
        with _connect(proxy) as sock:
            sock.sendall(_head("POST", CHAT_PATH.format("old"), "content-type: application/json",
                               f"content-length: {len(body)}", version="1.0") + body)
            answer, _ = _until_closed(sock, 10)
        assert answer.startswith(b"HTTP/1.1 200"), answer


@sqlite_only
def test_long_responses_are_not_cut(proxy_for: ProxyFactory, replica: str) -> None:
    # Every limit far shorter than the responses: they apply to receiving requests only.
    limits = {"header_timeout_s": 0.5, "body_timeout_s": 1.0}
    with proxy_for([replica], keep_alive_s=1, limits=limits) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        streamed = {**CHAT, "stream": True, "max_tokens": 10, "fault": {"delay_s": 0.3}}
        started = time.monotonic()
        with client.stream("POST", CHAT_PATH.format("long"), json=streamed) as r:
            assert r.status_code == 200
            raw = r.read()
        assert time.monotonic() - started > 2.5 and raw.rstrip().endswith(b"data: [DONE]")
        r = client.post(CHAT_PATH.format("long"), json={**CHAT, "fault": {"sleep_s": 2.5}})
        assert r.status_code == 200 and r.json()["choices"]
        calls = client.get("/rollout/long/attempt/0").json()["calls"]
        assert [(c["status"], c["http_status"]) for c in calls] == [("ok", 200), ("ok", 200)]
