"""The replicas' HTTP client (`proxy.http1` behind `proxy.upstream`) on real sockets: what aiohttp
gave and the relay counts on, each where it can break.

A real uvicorn server (the fault replica) for the common paths; raw asyncio servers for bytes
no well-behaved server sends (a close-delimited body, an interim 1xx, garbage, a reset mid-body,
a keep-alive connection closed under a request, a handshake that never ends).
"""

from __future__ import annotations

import asyncio
import datetime
import base64
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proxy.http1 import HIGH_WATER, BadURL, Pool, Target
from proxy.upstream import Upstream
from shared.errors import UpstreamDisconnected, UpstreamTimeout, UpstreamUnavailable
from shared.settings import ProxySettings
from tests.support.fault_replica import FaultReplica
from tests.support.servers import free_port, serve_in_thread



Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Each test on both loops: the proxy serves on uvloop (uvicorn's choice when installed), whose
    transports are not asyncio's classes; tools and tests use asyncio's."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def run(test: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(test)
    return run


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def upstream(**settings: Any) -> Upstream:
    return Upstream(ProxySettings(**settings))


def body(request: dict[str, Any]) -> bytes:
    return orjson.dumps(request)


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on loopback running `handler` per connection; yields its URL and a list that
    counts connections (one entry per connection accepted)."""
    accepted: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the test ended: the server's part is over
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's header block and content-length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


ANSWER = b'{"ok": true}'
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n" + ANSWER


# The common path, on a real server

def test_whole_and_streamed_answers_and_keep_alive(run: Run) -> None:
    run(_whole_and_streamed_answers_and_keep_alive())


async def _whole_and_streamed_answers_and_keep_alive() -> None:
    replica = FaultReplica()
    client = upstream()
    with serve_in_thread(replica) as (url, _):
        try:
            whole = await client.post(url, "/v1/chat/completions", body({**CHAT, "fault": {"pad_bytes": 300_000}}))
            assert whole.status == 200 and whole.content_type == "application/json"
            answer = orjson.loads(await whole.read())
            assert answer["choices"][0]["message"]["content"] == "x" * 300_000
            assert client.pool.in_use == 0 and client.pool.idle == 1

            streamed = await client.post(url, "/v1/chat/completions", body({**CHAT, "stream": True, "max_tokens": 5}))
            assert streamed.is_stream
            got = b"".join([chunk async for chunk in streamed.aiter()])
            streamed.release()
            assert got.count(b"data: ") == 6 and got.endswith(b"data: [DONE]\n\n")
            # A stream read to its end leaves its connection for the next call, as a whole answer does.
            assert client.pool.in_use == 0 and client.pool.idle == 1

            status, models, content_type = await client.get(url, "/v1/models")
            assert status == 200 and b"fault-model" in models and content_type == "application/json"
            error = await client.post(url, "/v1/chat/completions", body({**CHAT, "fault": {"status": 400}}))
            assert error.status == 400 and b"injected" in await error.read()
        finally:
            await client.close()
    assert replica.stats.requests == 3
    # Sent as asked: no compression, our content type, a content-length.
    sent = replica.stats.headers[0]
    assert sent["accept-encoding"] == "identity" and sent["content-type"] == "application/json"
    assert int(sent["content-length"]) == len(body({**CHAT, "fault": {"pad_bytes": 300_000}}))


def test_one_connection_serves_calls_one_after_another(run: Run) -> None:
    run(_one_connection_serves_calls_one_after_another())


async def _one_connection_serves_calls_one_after_another() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    client = upstream()
    async with raw_server(serve) as (url, accepted):
        try:
            for _ in range(5):
                response = await client.post(url, "/v1/x", b"{}")
                assert await response.read() == ANSWER
        finally:
            await client.close()
    assert len(accepted) == 1


def test_idle_connections_expire(run: Run) -> None:
    run(_idle_connections_expire())


async def _idle_connections_expire() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    pool = Pool(limit=4, keepalive_s=0.2, connect_timeout_s=2)
    async with raw_server(serve) as (url, accepted):
        target = Target(url)
        for pause in (0.0, 0.4):
            await asyncio.sleep(pause)
            connection = await pool.connection(target)
            connection.send(target.request(b"GET", "/x", {}, None), 5, 5)
            await connection.response_head()
            assert await connection.body_part() == ANSWER and await connection.body_part() == b""
            pool.release(connection)
        pool.close()
    assert len(accepted) == 2  # the second call found its idle connection past `keepalive_s`: a new one


def test_credentials_in_the_url_are_sent_as_basic_auth(run: Run) -> None:
    run(_credentials_in_the_url_are_sent_as_basic_auth())


async def _credentials_in_the_url_are_sent_as_basic_auth() -> None:
    replica = FaultReplica()
    client = upstream()
    with serve_in_thread(replica) as (url, _):
        try:
            with_user = url.replace("http://", "http://rolltap:p%40ss%3Aw0rd@")
            assert (await client.post(with_user, "/v1/chat/completions", body(CHAT))).status == 200
            assert (await client.post(url, "/v1/chat/completions", body(CHAT))).status == 200
        finally:
            await client.close()
    first, second = replica.stats.headers
    assert base64.b64decode(first["authorization"].removeprefix("Basic ")) == b"rolltap:p@ss:w0rd"
    assert "authorization" not in second and first["host"] == second["host"] == url.removeprefix("http://")


# The connection cap

def test_calls_past_the_cap_wait_their_turn(run: Run) -> None:
    run(_calls_past_the_cap_wait_their_turn())


async def _calls_past_the_cap_wait_their_turn() -> None:
    open_now = 0
    most = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        while True:
            await read_request(reader)
            open_now += 1
            most = max(most, open_now)
            await asyncio.sleep(0.1)
            open_now -= 1
            writer.write(OK)

    client = upstream(max_connections=2)
    async with raw_server(serve) as (url, accepted):
        try:
            async def call() -> bytes:
                return await (await client.post(url, "/v1/x", b"{}")).read()

            assert await asyncio.gather(*[call() for _ in range(7)]) == [ANSWER] * 7
            # A waiter cancelled, while waiting or just as a slot was handed to it, hands its turn on.
            holder = await client.post(url, "/v1/x", b"{}")
            other = await client.post(url, "/v1/x", b"{}")
            waiting = [asyncio.ensure_future(call()) for _ in range(3)]
            await asyncio.sleep(0.05)
            waiting[0].cancel()
            assert await holder.read() == ANSWER  # hands its slot to waiting[0]... which was cancelled
            waiting[1].cancel()
            assert await other.read() == ANSWER
            assert await waiting[2] == ANSWER
            await asyncio.gather(*waiting[:2], return_exceptions=True)
            assert client.pool.in_use == 0
        finally:
            await client.close()
    assert most == 2 and len(accepted) == 2


# Bodies no well-behaved server sends

def test_body_ended_by_the_connection_and_interim_answers(run: Run) -> None:
    run(_body_ended_by_the_connection_and_interim_answers())


async def _body_ended_by_the_connection_and_interim_answers() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\n\r\n" + ANSWER[:5])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(ANSWER[5:])

    client = upstream()
    async with raw_server(close_delimited) as (url, accepted):
        try:
            for _ in range(2):
                response = await client.post(url, "/v1/x", b"{}")
                assert response.status == 200 and response.content_type == "application/json"
                assert await response.read() == ANSWER
            assert client.pool.idle == 0
        finally:
            await client.close()
    assert len(accepted) == 2  # never kept: the body's end was the connection's


def test_garbage_and_resets_map_to_our_errors(run: Run) -> None:
    run(_garbage_and_resets_map_to_our_errors())


async def _garbage_and_resets_map_to_our_errors() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    async def cut_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"f\r\ndata: {\"a\":1}\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.transport.abort()

    client = upstream()
    try:
        async with raw_server(garbage) as (url, _):
            with pytest.raises(UpstreamUnavailable, match="BadResponse"):
                await client.post(url, "/v1/x", b"{}")
        async with raw_server(silent) as (url, _):
            with pytest.raises(UpstreamUnavailable, match="before answering"):
                await client.post(url, "/v1/x", b"{}")
        async with raw_server(cut_mid_body) as (url, _):
            response = await client.post(url, "/v1/x", b"{}")
            chunks = response.aiter()
            assert await chunks.__anext__() == b'data: {"a":1}\n\n'
            with pytest.raises(UpstreamDisconnected, match="mid-response"):
                await chunks.__anext__()
            response.release()
        with pytest.raises(UpstreamUnavailable, match="unreachable"):
            await client.post(f"http://127.0.0.1:{free_port()}", "/v1/x", b"{}")
        with pytest.raises(UpstreamUnavailable, match="not an http"):
            await client.post("ftp://u:secret@127.0.0.1:21", "/v1/x", b"{}")
        assert client.pool.in_use == 0
    finally:
        await client.close()


def test_a_kept_connection_closed_under_a_request_is_retried_once(run: Run) -> None:
    run(_a_kept_connection_closed_under_a_request_is_retried_once())


async def _a_kept_connection_closed_under_a_request_is_retried_once() -> None:
    # The race keep-alive expiry keeps rare: the replica closes an idle connection just as a request
    # is sent on it. The request reached nothing that answers, so it goes again on a new connection.
    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)  # the second request on this connection: closed unanswered

    client = upstream()
    async with raw_server(once_then_close) as (url, accepted):
        try:
            for _ in range(3):
                assert await (await client.post(url, "/v1/x", b"{}")).read() == ANSWER
        finally:
            await client.close()
    assert len(accepted) == 3  # the second and third calls each found theirs closed and went on a new one


# Time limits

def test_silence_and_slowness_time_out(run: Run) -> None:
    run(_silence_and_slowness_time_out())


async def _silence_and_slowness_time_out() -> None:
    async def headers_then_silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        await asyncio.sleep(5)

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(50):
            writer.write(b"6\r\ndata: \r\n")
            await asyncio.sleep(0.1)

    async def no_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    client = upstream(read_timeout_s=0.3, limits={"call_timeout_s": 1.0})
    try:
        async with raw_server(no_answer) as (url, _):
            with pytest.raises(UpstreamTimeout, match=r"proxy.read_timeout_s"):
                await client.post(url, "/v1/x", b"{}")
        async with raw_server(headers_then_silence) as (url, _):
            response = await client.post(url, "/v1/x", b"{}")
            with pytest.raises(UpstreamTimeout, match=r"sent nothing for 0.3 s"):
                await response.read()
        async with raw_server(drip) as (url, _):  # never silent for 0.3 s, never done within 1 s
            response = await client.post(url, "/v1/x", b"{}")
            started = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout, match=r"proxy.limits.call_timeout_s"):
                async for _ in response.aiter():
                    pass
            assert 0.7 < asyncio.get_running_loop().time() - started < 1.5
            response.release()
        assert client.pool.in_use == 0
    finally:
        await client.close()


def test_handshake_that_never_ends_is_a_connect_timeout(run: Run) -> None:
    run(_handshake_that_never_ends_is_a_connect_timeout())


async def _handshake_that_never_ends_is_a_connect_timeout() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    client = upstream(connect_timeout_s=0.3)
    try:
        async with raw_server(mute) as (url, _):
            with pytest.raises(UpstreamUnavailable, match=r"proxy.connect_timeout_s"):
                await client.post(url.replace("http://", "https://"), "/v1/x", b"{}")
    finally:
        await client.close()


# Back-pressure

def test_a_slow_reader_pauses_the_socket_and_loses_nothing(run: Run) -> None:
    run(_a_slow_reader_pauses_the_socket_and_loses_nothing())


async def _a_slow_reader_pauses_the_socket_and_loses_nothing() -> None:
    size = 32 * HIGH_WATER
    payload = bytes(range(256)) * (size // 256)

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: " + str(size).encode() + b"\r\n\r\n")
        for start in range(0, size, 1 << 16):
            writer.write(payload[start:start + (1 << 16)])
            await writer.drain()

    pool = Pool(limit=2, keepalive_s=4, connect_timeout_s=2)
    async with raw_server(flood) as (url, _):
        target = Target(url)
        connection = await pool.connection(target)
        connection.send(target.request(b"GET", "/x", {}, None), 30, 0.3)
        await connection.response_head()
        got = []
        while part := await connection.body_part():
            got.append(part)
            # A consumer slower than the read timeout: reading is paused meanwhile, which is not silence.
            await asyncio.sleep(0.5) if len(got) == 2 else None
            assert len(part) <= HIGH_WATER + (1 << 18)  # one more socket read at most
        pool.release(connection)
        pool.close()
    assert b"".join(got) == payload


# TLS

def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rolltap test replica")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_replica_verified_against_the_trusted_roots(run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(_https_replica_verified_against_the_trusted_roots(tmp_path, monkeypatch))


async def _https_replica_verified_against_the_trusted_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    replica = FaultReplica()
    port = free_port()
    config = uvicorn.Config(replica, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            ssl_certfile=str(cert_file), ssl_keyfile=str(key_file))
    with serve_in_thread(replica, config=config):
        url = f"https://127.0.0.1:{port}"
        untrusted = upstream()
        try:
            with pytest.raises(UpstreamUnavailable, match="SSLCertVerificationError"):
                await untrusted.post(url, "/v1/chat/completions", body(CHAT))
        finally:
            await untrusted.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))  # OpenSSL's default roots, as a deployment sets them
        trusted = upstream()
        try:
            response = await trusted.post(url, "/v1/chat/completions", body({**CHAT, "stream": True}))
            assert (b"".join([chunk async for chunk in response.aiter()])).endswith(b"data: [DONE]\n\n")
            response.release()
        finally:
            await trusted.close()
    assert replica.stats.requests == 1


# Replica URLs

def test_replica_urls_parsed_once_into_requests() -> None:
    ipv6 = Target("http://[::1]:8000/base/")
    assert ipv6.key == ("::1", 8000, False)
    assert ipv6.request(b"GET", "/v1/models", {}, None) == (
        b"GET /base/v1/models HTTP/1.1\r\nhost: [::1]:8000\r\naccept-encoding: identity\r\n\r\n")
    assert Target("https://bücher.example").key == ("bücher.example", 443, True)
    assert Target("https://bücher.example").fixed.startswith(b"host: xn--bcher-kva.example\r\n")
    posted = Target("http://u:pw@h").request(b"POST", "/v1/x", {"content-type": "application/json"}, b"{}")
    assert posted == (b"POST /v1/x HTTP/1.1\r\nhost: h\r\naccept-encoding: identity\r\nauthorization: Basic dTpwdw==\r\n"
                      b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    for bad in ("ftp://h", "http://h:99999", "http://", "h:8000"):
        with pytest.raises(BadURL):
            Target(bad)


def test_the_call_limit_while_reading_is_paused(run: Run) -> None:
    run(_the_call_limit_while_reading_is_paused())


async def _the_call_limit_while_reading_is_paused() -> None:
    # A consumer slow enough that the whole-call limit passes while reading is paused (a pause stops
    # the silence clock, not the call's): the limit drops the connection; what had come is handed
    # on, then our timeout.
    async def flood_then_hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 16)
        for _ in range(256):
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()
        await asyncio.sleep(5)

    client = upstream(limits={"call_timeout_s": 0.5})
    async with raw_server(flood_then_hold) as (url, _):
        try:
            response = await client.post(url, "/v1/x", b"{}")
            chunks = response.aiter()
            got = len(await chunks.__anext__())
            await asyncio.sleep(0.8)  # paused past HIGH_WATER, and past the call's limit
            with pytest.raises(UpstreamTimeout, match="proxy.limits.call_timeout_s"):
                async for part in chunks:
                    got += len(part)
            assert HIGH_WATER <= got < 256 << 16
            response.release()
            assert client.pool.in_use == 0
        finally:
            await client.close()
