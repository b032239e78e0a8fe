"""The official openai SDK against the proxy in front of a real CPU vLLM replica."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def _check_calls(attempt: dict[str, Any], tokenizer: Any, texts: list[str], routes: list[str]) -> None:
    calls = attempt["calls"]
    assert [c["seq"] for c in calls] == list(range(len(texts)))
    assert [c["route"] for c in calls] == routes
    for call, text in zip(calls, texts, strict=True):
        assert call["status"] == "ok", call["error"]
        assert call["prompt_token_ids"] and all(isinstance(t, int) for t in call["prompt_token_ids"])
        ids = call["completion_token_ids"]
        assert ids, call
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert len(call["completion_logprobs"]) == len(ids)
        assert all(isinstance(lp, float) and lp <= 0 for lp in call["completion_logprobs"])
        assert call["replica"] and call["policy_version"] == 0 and call["served_model"] == "tiny"
        assert call["started_at"] <= call["first_byte_at"] <= call["ended_at"]


def test_sync_sdk_chat_completions_models(vllm_replica: Any, proxy_for: ProxyFactory, tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r1", "a1"), api_key="unused")
        models = client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        texts = []
        chat = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=12, temperature=0)
        texts.append(chat.choices[0].message.content)
        stream = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=12,
                                                temperature=0, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        comp = client.completions.create(model="anything", prompt="The quick brown", max_tokens=10, temperature=0)
        texts.append(comp.choices[0].text)
        stream = client.completions.create(model="anything", prompt="The quick brown", max_tokens=10,
                                           temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in stream if c.choices))
        attempt = httpx.get(f"{proxy.url}/rollout/r1/attempt/a1").json()
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: streamed equals whole
    _check_calls(attempt, tokenizer, texts,
                 ["chat/completions", "chat/completions", "completions", "completions"])
    assert [c["is_streaming"] for c in attempt["calls"]] == [False, True, False, True]
    assert attempt["calls"][0]["requested_model"] == "anything"


async def test_async_sdk_chat_completions_models(vllm_replica: Any, proxy_for: ProxyFactory, tokenizer: Any) -> None:
    with proxy_for([vllm_replica.url]) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.base_url("r2", "a1"), api_key="unused")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        texts = []
        chat = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
        texts.append(chat.choices[0].message.content)
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8,
                                                      temperature=0, stream=True)
        texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
        comp = await client.completions.create(model="m", prompt="A lazy dog", max_tokens=8, temperature=0)
        texts.append(comp.choices[0].text)
        stream = await client.completions.create(model="m", prompt="A lazy dog", max_tokens=8, temperature=0,
                                                 stream=True)
        texts.append("".join([c.choices[0].text async for c in stream if c.choices]))
        async with httpx.AsyncClient() as http:
            attempt = (await http.get(f"{proxy.url}/rollout/r2/attempt/a1")).json()
        await client.close()
    _check_calls(attempt, tokenizer, texts,
                 ["chat/completions", "chat/completions", "completions", "completions"])


def test_messages_route_is_recorded(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    """Anthropic Messages through vLLM: recorded with its text (vLLM gives no token IDs there)."""
    with proxy_for([vllm_replica.url]) as proxy:
        for stream in (False, True):
            body = {"model": "x", "max_tokens": 6, "messages": MESSAGES, "stream": stream, "temperature": 0}
            r = httpx.post(f"{proxy.base_url('r3', 'a1')}/messages", json=body)
            assert r.status_code == 200, r.text
        attempt = httpx.get(f"{proxy.url}/rollout/r3/attempt/a1").json()
    whole, streamed = attempt["calls"]
    assert whole["route"] == streamed["route"] == "messages"
    assert whole["status"] == streamed["status"] == "ok"
    text = whole["response"]["content"][0]["text"]
    assert text and streamed["response"]["content"][0]["text"] == text
    assert streamed["response"]["usage"]["output_tokens"] == 6
