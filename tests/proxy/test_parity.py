"""Greedy responses through the proxy equal the replica's own; streamed chunks pass unchanged."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.formats import for_route, parse_events
from proxy.sse import iter_data
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

# What the proxy adds on recorded routes; the direct request asks for the same.
EXACT = {"return_token_ids": True, "logprobs": True}
PER_REQUEST = ("id", "created")  # vLLM stamps these anew on every request


def _stream_result(route: str, raw: bytes) -> dict[str, Any]:
    """Content, token IDs and logprobs of a stream. vLLM coalesces tokens into fewer chunks
    when its API server falls behind, so chunking differs between two identical requests."""
    events = list(iter_data(raw))
    assert events[-1] == b"[DONE]"
    return _strip(for_route(route).assemble(parse_events(events)))


def _strip(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in PER_REQUEST}


@pytest.mark.vllm
@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "Say something about dogs."}]}),
    ("completions", {"prompt": "Once upon a time", "logprobs": 0}),
])
def test_greedy_through_proxy_equals_direct(vllm_replica: Any, proxy_for: ProxyFactory, route: str,
                                            body: dict[str, Any]) -> None:
    request = {"model": "tiny", "max_tokens": 16, "temperature": 0, **EXACT, **body}
    if route == "completions":
        request["logprobs"] = 0
    with proxy_for([vllm_replica.url]) as proxy, httpx.Client(timeout=60) as http:
        direct = http.post(f"{vllm_replica.url}/v1/{route}", json=request)
        via = http.post(f"{proxy.base_url('p1', 'a1')}/{route}", json=request)
        assert direct.status_code == via.status_code == 200
        assert _strip(via.json()) == _strip(direct.json())

        direct_raw = http.post(f"{vllm_replica.url}/v1/{route}", json={**request, "stream": True}).content
        via_raw = http.post(f"{proxy.base_url('p1', 'a1')}/{route}", json={**request, "stream": True}).content
    assert _stream_result(route, via_raw) == _stream_result(route, direct_raw)
    assert via_raw.count(b"data: ") > 3


def test_stream_bytes_reach_client_unchanged(proxy_for: ProxyFactory) -> None:
    """Chunk boundaries that split events, lines and CRLFs: the client gets the same bytes."""
    chunks = ['data: {"id":"x","choices":[{"index":0,"delta":{"content":"he', 'llo"},"token_ids":[5]}],',
              '"prompt_token_ids":[1,2]}\r', '\n\r\n', ': keep-alive\n\n', 'data: {"choices":[{"index":0,',
              '"delta":{"content":" w\u00f6rld"},"token_ids":[6],"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n']
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy:
        body = {"model": "m", "messages": [], "stream": True, "fault": {"chunks": chunks}}
        with httpx.stream("POST", f"{proxy.base_url('b1', 'a1')}/chat/completions", json=body) as r:
            received = b"".join(r.iter_raw())
        attempt = httpx.get(f"{proxy.url}/rollout/b1/attempt/a1").json()
    assert received == "".join(chunks).encode()
    (call,) = attempt["calls"]
    assert call["response"]["choices"][0]["message"]["content"] == "hello w\u00f6rld"
    assert call["completion_token_ids"] == [5, 6] and call["prompt_token_ids"] == [1, 2]
    assert call["finish_reason"] == "stop"
