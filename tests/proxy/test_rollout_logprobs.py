"""`proxy.rollout_logprobs`: what a recorded call asks the replica for (on, off, a sample of attempts).

Token IDs are always asked for; the sampled tokens' logprobs only as the setting says, and an
agent's own `logprobs` request is kept whatever it says.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from proxy.formats.openai import IDS_ONLY_XARG as PROXY_IDS_ONLY_XARG
from proxy.formats.responses import LOGPROBS_INCLUDE
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

MESSAGES = [{"role": "user", "content": "hi"}]


def _asked(body: dict[str, Any]) -> tuple[bool, Any]:
    return body.get("return_token_ids") is True, body.get("logprobs")


def test_off_asks_for_token_ids_only_and_keeps_the_agents_own_request(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url], rollout_logprobs="off") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-off", "a0"), api_key="k", max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True)  # type: ignore[arg-type]
        httpx.post(f"{proxy.base_url('r-off', 'a0')}/completions", json={"model": "m", "prompt": "x"}
                   ).raise_for_status()
        httpx.post(f"{proxy.base_url('r-off', 'a0')}/responses", json={"model": "m", "input": "x"}
                   ).raise_for_status()
        calls = httpx.get(f"{proxy.url}/rollout/r-off/attempt/a0").json()["calls"]
    chat, own, completion, response = replica.stats.bodies
    assert _asked(chat) == (True, None)
    assert _asked(own) == (True, True)  # the agent asked: kept
    assert _asked(completion) == (True, None)
    assert response["enable_response_messages"] is True and LOGPROBS_INCLUDE not in (response.get("include") or [])
    # The record holds what the replica was asked, so the trainer knows logprobs were not.
    assert [c["request"].get("logprobs") for c in calls[:3]] == [None, True, None]


def test_on_asks_every_route_for_logprobs(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url], rollout_logprobs="on") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-on", "a0"), api_key="k", max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        httpx.post(f"{proxy.base_url('r-on', 'a0')}/completions", json={"model": "m", "prompt": "x"}
                   ).raise_for_status()
        httpx.post(f"{proxy.base_url('r-on', 'a0')}/responses", json={"model": "m", "input": "x"}
                   ).raise_for_status()
    chat, completion, response = replica.stats.bodies
    assert _asked(chat) == (True, True)
    assert _asked(completion) == (True, 0)  # the sampled token's logprob, no alternatives
    assert LOGPROBS_INCLUDE in response["include"]


def test_sample_picks_whole_attempts_alike_on_every_proxy(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    attempts = [(f"r-s{i // 4}", f"a{i % 4}") for i in range(48)]
    picked: list[dict[tuple[str, str], bool]] = []
    with serve_in_thread(replica) as (url, _):
        for _proxy in range(2):  # two proxies one after the other, on the same ids
            replica.stats.bodies.clear()
            with proxy_for([url], rollout_logprobs="sample", rollout_logprobs_rate=0.5) as proxy, \
                    httpx.Client(timeout=60) as http:
                for rollout, attempt in attempts:
                    for _turn in range(2):
                        http.post(f"{proxy.base_url(rollout, attempt)}/chat/completions",
                                  json={"model": "m", "messages": MESSAGES}).raise_for_status()
            asked = [_asked(b)[1] is True for b in replica.stats.bodies]
            assert all(_asked(b)[0] for b in replica.stats.bodies)
            # Both calls of an attempt decide alike: the trainer merges them into one sample.
            assert asked[0::2] == asked[1::2]
            picked.append(dict(zip(attempts, asked[0::2], strict=True)))
    assert picked[0] == picked[1]
    share = sum(picked[0].values()) / len(attempts)
    assert 0.25 <= share <= 0.75, share


@pytest.mark.vllm
def test_off_records_token_ids_without_logprobs_on_a_real_replica(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    with proxy_for([vllm_replica.url], rollout_logprobs="off") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-real", "a0"), api_key="k")
        out = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        assert out.choices[0].logprobs is None  # the agent did not ask and gets none
        call = httpx.get(f"{proxy.url}/rollout/r-real/attempt/a0").json()["calls"][0]
    assert call["status"] == "ok"
    assert call["completion_token_ids"] and call["prompt_token_ids"]
    assert call["completion_logprobs"] is None


def test_the_rate_is_a_share() -> None:
    from pydantic import ValidationError

    from shared.settings import ProxySettings

    with pytest.raises(ValidationError):
        ProxySettings(rollout_logprobs="sample", rollout_logprobs_rate=1.5)
    with pytest.raises(ValidationError):
        ProxySettings(rollout_logprobs="sometimes")  # type: ignore[arg-type]


@pytest.mark.vllm
def test_logprobs_the_proxy_asks_for_are_token_ids_only_and_the_same_values(vllm_replica: Any,
                                                                             proxy_for: ProxyFactory) -> None:
    """An agent that asks for no logprobs gets the proxy's undecoded (`token_id:N`, no bytes: the replica's
    plugin skipped decoding), and the record holds the logprobs a direct call asking for decoded ones gets."""
    from rolltap_vllm.logprobs_wire import IDS_ONLY_XARG

    assert IDS_ONLY_XARG == PROXY_IDS_ONLY_XARG  # the plugin and the proxy read one mark
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with proxy_for([vllm_replica.url]) as proxy, httpx.Client(timeout=60) as http:
        direct = http.post(f"{vllm_replica.url}/v1/chat/completions",
                           json={**request, "logprobs": True, "return_token_ids": True}).json()
        via = http.post(f"{proxy.base_url('r-ids', 'a0')}/chat/completions", json=request).json()
        streamed = http.post(f"{proxy.base_url('r-ids', 'a0')}/chat/completions", json={**request, "stream": True})
        own = http.post(f"{proxy.base_url('r-ids', 'a0')}/chat/completions", json={**request, "logprobs": True}).json()
        # vLLM decodes prompt and sampled logprobs in one processor: a call with the agent's own prompt
        # logprobs is not marked, so its prompt tokens keep their text.
        prompted = http.post(f"{proxy.base_url('r-ids', 'a0')}/chat/completions",
                             json={**request, "prompt_logprobs": 0}).json()
        calls = http.get(f"{proxy.url}/rollout/r-ids/attempt/a0").json()["calls"]
    (choice,) = direct["choices"]
    tokens, values = choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
    assert all(e["token"] and not e["token"].startswith("token_id:") and e["bytes"] is not None
               for e in choice["logprobs"]["content"])
    entries = via["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in tokens]
    assert all(e["bytes"] is None for e in entries)  # nothing decoded on the replica
    assert streamed.status_code == 200 and b'"bytes":null' in streamed.content
    assert [e["token"] for e in own["choices"][0]["logprobs"]["content"]] == [
        e["token"] for e in choice["logprobs"]["content"]]  # the agent's own ask: decoded, as vLLM answers it
    prompt_entries = [entry for position in prompted["prompt_logprobs"] if position for entry in position.values()]
    assert prompt_entries and all(entry["decoded_token"] is not None for entry in prompt_entries)
    assert len(calls) == 4
    for call in calls:
        assert call["completion_token_ids"] == tokens
        assert call["completion_logprobs"] == pytest.approx(values, abs=1e-5)


def test_completions_logprobs_the_proxy_asks_for_are_token_ids_only(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    """The same on the completions route: placeholders to the agent that asked for none, a decoding direct
    call's values in the record."""
    request = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    with proxy_for([vllm_replica.url]) as proxy, httpx.Client(timeout=60) as http:
        direct = http.post(f"{vllm_replica.url}/v1/completions",
                           json={**request, "logprobs": 0, "return_token_ids": True}).json()
        via = http.post(f"{proxy.base_url('r-cids', 'a0')}/completions", json=request).json()
        streamed = http.post(f"{proxy.base_url('r-cids', 'a0')}/completions", json={**request, "stream": True})
        calls = http.get(f"{proxy.url}/rollout/r-cids/attempt/a0").json()["calls"]
        # An echoed prompt: vLLM answers its text as "" once asked for token IDs, so the proxy asks nothing.
        echoed = http.post(f"{proxy.base_url('r-cids', 'a1')}/completions", json={**request, "echo": True})
        (echo_call,) = http.get(f"{proxy.url}/rollout/r-cids/attempt/a1").json()["calls"]
    (choice,) = direct["choices"]
    tokens, values = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert tokens and not any(token.startswith("token_id:") for token in choice["logprobs"]["tokens"])
    assert via["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in tokens]
    assert streamed.status_code == 200 and b'"token_id:' in streamed.content
    assert len(calls) == 2
    for call in calls:
        assert call["completion_token_ids"] == tokens
        assert call["completion_logprobs"] == pytest.approx(values, abs=1e-5)
    assert echoed.json()["choices"][0]["text"] == request["prompt"] + choice["text"]
    assert echo_call["status"] == "ok" and echo_call["completion_token_ids"] is None


@pytest.mark.vllm
def test_logprob_options_without_logprobs_get_the_replicas_error(vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    """`top_logprobs` (or `logprob_token_ids`) without `logprobs` is refused by OpenAI and vLLM alike; the
    proxy's own ask for logprobs must not turn it into an answer the agent cannot get directly."""
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with proxy_for([vllm_replica.url]) as proxy, httpx.Client(timeout=60) as http:
        for extra in ({"top_logprobs": 2}, {"logprob_token_ids": [5]}):
            direct = http.post(f"{vllm_replica.url}/v1/chat/completions", json={**request, **extra})
            via = http.post(f"{proxy.base_url('r-opt', 'a0')}/chat/completions", json={**request, **extra})
            assert direct.status_code == via.status_code == 400, (direct.text, via.text)
            assert via.json()["error"]["message"] == direct.json()["error"]["message"]
        # top_logprobs 0 needs no logprobs: answered, and recorded with the proxy's own logprobs.
        zero = http.post(f"{proxy.base_url('r-opt', 'a0')}/chat/completions", json={**request, "top_logprobs": 0})
        assert zero.status_code == 200, zero.text
        calls = http.get(f"{proxy.url}/rollout/r-opt/attempt/a0").json()["calls"]
    assert [c["http_status"] for c in calls] == [400, 400, 200]
    assert calls[2]["completion_logprobs"] and len(calls[2]["completion_logprobs"]) == len(calls[2]["completion_token_ids"])
