"""Each limit exceeded, through a real HTTP client: its status, OpenAI's error shape, records kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from tests.conftest import ProxyFactory

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body
    return body["error"]


def _calls(client: httpx.Client, rollout: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = client.get(f"/rollout/{rollout}/attempt/0").json()["calls"]
    return calls


def test_request_limits(proxy_for: ProxyFactory, replica: str) -> None:
    limits = {"max_body_bytes": 4096, "max_header_bytes": 8192, "max_headers": 40}
    with proxy_for([replica], limits=limits) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
        chat = "/rollout/lim/attempt/0/v1/chat/completions"
        assert client.post(chat, json=CHAT).status_code == 200
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        _error(client.post(chat, json=big), 413, "body_too_large")

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        _error(client.post(chat, content=chunked(), headers={"content-type": "application/json"}), 413,
               "body_too_large")
        _error(client.post("/rollouts", json={"rollout_id": "lim", "task": "z" * 5000}), 413, "body_too_large")
        _error(client.post("/rollouts", content=chunked(), headers={"content-type": "application/json"}), 413,
               "body_too_large")
        # Headers: too many, too large (one 100 KB value), on relayed and other routes alike.
        many = {f"x-h{i}": "v" for i in range(60)}
        _error(client.post(chat, json=CHAT, headers=many), 431, "headers_too_large")
        _error(client.get("/rollout/lim/attempt/0", headers=many), 431, "headers_too_large")
        _error(client.post(chat, json=CHAT, headers={"x-big": "h" * 100_000}), 431, "headers_too_large")
        # Ids: 1-128 characters.
        _error(client.post(f"/rollout/{'r' * 129}/attempt/0/v1/chat/completions", json=CHAT), 400, "invalid_id")
        # What was recorded stays: the good call, and the refused bodies as invalid requests.
        calls = _calls(client, "lim")
        assert [(c["status"], c["http_status"]) for c in calls] == [
            ("ok", 200), ("invalid_request", 413), ("invalid_request", 413)]


def test_call_timeout(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], limits={"call_timeout_s": 0.6}) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        chat = "/rollout/slow/attempt/0/v1/chat/completions"
        assert client.post(chat, json={**CHAT, "fault": {"sleep_s": 0.1}}).status_code == 200
        _error(client.post(chat, json={**CHAT, "fault": {"sleep_s": 3}}), 504, "call_timeout")
        # A stream past the limit ends with a final error event; what it sent is kept.
        body = {**CHAT, "stream": True, "max_tokens": 10, "fault": {"delay_s": 0.15}}
        streamed = client.post(chat, json=body)
        assert streamed.status_code == 200
        assert b'"error"' in streamed.content.strip().split(b"\n")[-1]
        calls = _calls(client, "slow")
        assert [(c["status"], c["http_status"]) for c in calls] == [("ok", 200), ("failed", 504), ("failed", 200)]
        assert 0 < len(calls[2]["completion_token_ids"] or []) < 10


def test_max_body_bytes_holds_for_whole_responses(proxy_for: ProxyFactory, replica: str) -> None:
    with proxy_for([replica], recorder={"max_body_bytes": 2048}) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        r = client.post("/rollout/big/attempt/0/v1/chat/completions", json={**CHAT, "fault": {"pad_bytes": 50_000}})
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 50_000  # client: whole
        (call,) = _calls(client, "big")
        assert call["response_truncated"] is True
        assert len(str(call["response"])) < 5000  # the record: cut
