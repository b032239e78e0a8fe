"""Sampling on recorded routes: pinned parameters (override / reject) and one choice per call, via the OpenAI SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread

MESSAGES = [{"role": "user", "content": "hi"}]
SHAPE = {"message", "type", "param", "code"}


def test_n_above_one_is_refused_in_openais_shape_and_recorded(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    with serve_in_thread(replica) as (url, _), proxy_for([url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-n", "a0"), api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES, n=2)  # type: ignore[arg-type]
        error = caught.value.body
        assert isinstance(error, dict) and set(error) == SHAPE
        assert (error["param"], error["code"]) == ("n", "multiple_choices_not_supported")
        r = httpx.post(f"{proxy.base_url('r-n', 'a0')}/completions", json={"model": "m", "prompt": "x", "best_of": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        # n=1 is fine, and untracked evaluation traffic is not checked.
        assert client.chat.completions.create(model="m", messages=MESSAGES, n=1).choices  # type: ignore[arg-type]
        assert httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 2}
                          ).status_code == 200
        calls = httpx.get(f"{proxy.url}/rollout/r-n/attempt/a0").json()["calls"]
    assert replica.stats.requests == 2  # the refused calls never reached the replica
    assert [c["status"] for c in calls] == ["invalid_request", "invalid_request", "ok"]
    assert calls[0]["request"]["n"] == 2  # recorded with the body the agent sent


def test_pinned_sampling_overrides_and_is_recorded(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    pin = {"pinned": {"temperature": 1.0, "top_p": 1.0}}
    with serve_in_thread(replica) as (url, _), proxy_for([url], sampling=pin) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-pin", "a0"), api_key="k", max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=0.3)  # type: ignore[arg-type]
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        calls = httpx.get(f"{proxy.url}/rollout/r-pin/attempt/a0").json()["calls"]
    assert [(b["temperature"], b["top_p"]) for b in replica.stats.bodies] == [(1.0, 1.0), (1.0, 1.0)]
    assert [(c["request"]["temperature"], c["request"]["top_p"]) for c in calls] == [(1.0, 1.0), (1.0, 1.0)]


def test_pinned_sampling_rejects_a_different_value(proxy_for: ProxyFactory) -> None:
    replica = FaultReplica()
    pin = {"pinned": {"temperature": 0.7}, "policy": "reject"}
    with serve_in_thread(replica) as (url, _), proxy_for([url], sampling=pin) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r-rej", "a0"), api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0)  # type: ignore[arg-type]
        assert isinstance(caught.value.body, dict)
        assert (caught.value.body["param"], caught.value.body["code"]) == ("temperature", "sampling_pinned")
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=0.7)  # type: ignore[arg-type]
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    assert [b["temperature"] for b in replica.stats.bodies] == [0.7, 0.7]


def test_unknown_pinned_parameter_is_a_settings_error() -> None:
    from pydantic import ValidationError

    from shared.settings import SamplingSettings

    with pytest.raises(ValidationError, match="cannot pin"):
        SamplingSettings(pinned={"n": 2})
