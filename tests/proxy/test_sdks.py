"""Each SDK an agent is likely to use, against a closed proxy (agent key) in front of a real CPU vLLM.

The base URLs are the ones the README gives: `.../attempt/A/v1` for OpenAI-style clients,
`.../attempt/A` for the Anthropic SDK (it appends `/v1/messages` itself, and sends the key
as `x-api-key`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.support.servers import RunningProxy

pytestmark = pytest.mark.vllm

KEY = "rk-sdk-test-agent-key-00000000000000000000000000"
PROMPT = "Tell me about the quick brown fox."
# The tiny model samples its end token first now and then: an empty answer, which the SDKs read
# correctly but these tests could not tell from one they dropped. vLLM's `min_tokens`, passed the
# way each SDK passes fields of its own, rules that out (and the proxy relays it untouched).
NOT_EMPTY = {"min_tokens": 4}


@pytest.fixture
def proxy(vllm_replica: Any, proxy_for: ProxyFactory) -> Iterator[RunningProxy]:
    with proxy_for([vllm_replica.url], open_access=False, agent_key=KEY) as running:
        yield running


def _recorded(proxy: RunningProxy, rollout: str, routes: list[str], *, has_tokens: bool = True) -> list[dict[str, Any]]:
    r = httpx.get(f"{proxy.url}/rollout/{rollout}/attempt/0", headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    calls: list[dict[str, Any]] = r.json()["calls"]
    assert [c["route"] for c in calls] == routes
    for call in calls:
        assert call["status"] == "ok", call["error"]
        assert call["response"] and call["http_status"] == 200
        if has_tokens:
            assert call["completion_token_ids"] and call["prompt_token_ids"]
        assert KEY not in str(call["request"])
    return calls


def test_anthropic_sdk(proxy: RunningProxy) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=f"{proxy.url}/rollout/anth/attempt/0", api_key=KEY, max_retries=0)
    # Greedy: vLLM's Messages API has no `min_tokens`, and a sampled answer from the tiny model is
    # now and then its end token alone (an empty answer: this test flaked on it). The tiny model is
    # built from a fixed seed, so its greedy answer to PROMPT is fixed, and not empty.
    # (This SDK's `create` takes no `temperature`: it goes as a field of the body.)
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}],
                           "extra_body": {"temperature": 0.0}}
    message = client.messages.create(**ask)
    assert message.content[0].type == "text" and message.content[0].text and message.usage.output_tokens > 0
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == message.content[0].text
    calls = _recorded(proxy, "anth", ["messages", "messages"], has_tokens=False)  # vLLM's Messages API: no ids
    assert [c["request"]["temperature"] for c in calls] == [0.0, 0.0]  # relayed as the SDK sent it
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"{proxy.url}/rollout/anth/attempt/0", api_key="rk-wrong",
                            max_retries=0).messages.create(model="tiny", max_tokens=8,
                                                           messages=[{"role": "user", "content": PROMPT}])


def test_openai_sdk_sync(proxy: RunningProxy) -> None:
    import openai

    client = openai.OpenAI(base_url=proxy.base_url("oai", "0"), api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                          extra_body=NOT_EMPTY)
    assert chat.choices[0].message.content
    [call] = _recorded(proxy, "oai", ["chat/completions"])
    assert call["request"]["min_tokens"] == NOT_EMPTY["min_tokens"]  # relayed as the SDK sent it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.base_url("oai", "0"), api_key="rk-wrong", max_retries=0).models.list()


async def test_openai_sdk_async(proxy: RunningProxy) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=proxy.base_url("aoai", "0"), api_key=KEY, max_retries=0)
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=8, stream=True, extra_body=NOT_EMPTY)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    comp = await client.completions.create(model="tiny", prompt="The quick brown", max_tokens=8, extra_body=NOT_EMPTY)
    assert text and comp.choices[0].text
    await client.close()
    _recorded(proxy, "aoai", ["chat/completions", "completions"])


def test_litellm_sdk(proxy: RunningProxy) -> None:
    import litellm

    response = litellm.completion(model="openai/tiny", api_base=proxy.base_url("llm", "0"), api_key=KEY,
                                  messages=[{"role": "user", "content": PROMPT}], max_tokens=8, extra_body=NOT_EMPTY)
    assert response.choices[0].message.content
    _recorded(proxy, "llm", ["chat/completions"])


def test_langchain_chat_openai(proxy: RunningProxy) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=proxy.base_url("lc", "0"), api_key=KEY, max_tokens=8, max_retries=0,
                     extra_body=NOT_EMPTY)
    assert llm.invoke(PROMPT).content
    assert "".join(str(chunk.content) for chunk in llm.stream(PROMPT))
    _recorded(proxy, "lc", ["chat/completions", "chat/completions"])
