"""Each limit exceeded, through a real HTTP client: its status, OpenAI's error shape, records kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from proxy.formats import for_route
from shared.types import Route
from tests.conftest import ProxyFactory
from tests.support.fault_replica import MODEL, chat_chunk

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


def _pieces(raw: bytes, size: int = 100) -> list[str]:
    return [raw[i:i + size].decode() for i in range(0, len(raw), size)]


def test_a_response_cut_for_storage_keeps_its_whole_token_fields(proxy_for: ProxyFactory, replica: str) -> None:
    # Whole, streamed (cut inside an event) and a Responses stream (whose tokens come only in the
    # final event, split across chunks after the chunk that shows its type): each body is cut at
    # max_body_bytes, each record has the token IDs, logprobs and finish reason of the whole answer.
    n = 300
    ids, logprobs = [100 + i for i in range(n)], [-0.5 - i / 100 for i in range(n)]
    entries = [{"token": f"t{i} ", "logprob": logprobs[i], "bytes": [], "top_logprobs": []} for i in range(n)]
    text = "".join(e["token"] for e in entries)
    answer = {"id": "chatcmpl-big", "object": "chat.completion", "created": 1, "model": MODEL,
              "prompt_token_ids": [1, 2, 3],
              "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length",
                           "token_ids": ids, "logprobs": {"content": entries}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
    stream = b"".join(chat_chunk(i, first=i == 0, last=i == n - 1) for i in range(n)) + b"data: [DONE]\n\n"
    final = {"id": "resp_big", "object": "response", "status": "completed",
             "output": [{"type": "message", "role": "assistant",
                         "content": [{"type": "output_text", "text": text, "logprobs": entries}]}],
             "input_messages": [{"message": "hi", "tokens": [1, 2, 3], "type": "raw_message_tokens"}],
             "output_messages": [{"message": text, "tokens": ids, "type": "raw_message_tokens"}]}
    events = [{"type": "response.created", "response": {"id": "resp_big", "status": "in_progress"}},
              *({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": e["token"],
                 "logprobs": [e]} for e in entries[:10]),
              {"type": "response.completed", "response": final}]
    sse = [b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events]
    responses = _pieces(b"".join(sse[:-1])) + _pieces(sse[-1])
    assert for_route(Route.RESPONSES).is_terminal(responses[-len(_pieces(sse[-1]))].encode())  # the record is sealed before the rest
    with proxy_for([replica], recorder={"max_body_bytes": 1024}) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        chat = "/rollout/cut/attempt/0/v1/chat/completions"
        whole = client.post(chat, json={**CHAT, "fault": {"answer": answer}})
        assert whole.status_code == 200 and whole.json() == answer  # the client gets it all
        # Spaced out, so the proxy reads the pieces one by one (it keeps whole reads up to the limit).
        streamed = client.post(chat, json={**CHAT, "stream": True,
                                           "fault": {"chunks": _pieces(stream, 150), "delay_s": 0.002}})
        assert streamed.status_code == 200 and streamed.content == stream
        # One piece: the proxy's first read is already past the limit, so nothing is kept.
        at_once = client.post(chat, json={**CHAT, "stream": True, "fault": {"chunks": [stream.decode()]}})
        assert at_once.status_code == 200 and at_once.content == stream
        resp = client.post("/rollout/cut/attempt/0/v1/responses",
                           json={"model": "m", "input": "hi", "stream": True,
                                 "fault": {"chunks": responses, "delay_s": 0.002}})
        assert resp.status_code == 200 and resp.content == "".join(responses).encode()
        calls = _calls(client, "cut")
    assert [c["route"] for c in calls] == ["chat/completions"] * 3 + ["responses"]
    for call, got in zip(calls, (whole, streamed, at_once, resp), strict=True):
        assert call["status"] == "ok" and call["response_truncated"] is True
        body = (call["response_body"] or "").encode()
        assert len(body) <= 1024 and got.content.startswith(body)  # the stored body: cut
        assert body or call is calls[2]
        assert call["prompt_token_ids"] == [1, 2, 3]
        assert call["completion_token_ids"] == ids and call["completion_logprobs"] == logprobs
        assert call["usage"]["completion_tokens"] == n
    assert [c["finish_reason"] for c in calls] == ["length", "length", "length", "stop"]
    # `response` is parsed from the bytes kept: a cut whole body cannot be, so its start is kept as
    # text; a cut stream assembles the events kept (the event across the cut is left out).
    assert calls[0]["response"] == {"raw": calls[0]["response_body"]}
    assert not calls[1]["response_body"].endswith("\n\n")
    kept_ids = calls[1]["response"]["choices"][0]["token_ids"]
    assert 0 < len(kept_ids) < n and kept_ids == ids[:len(kept_ids)]
