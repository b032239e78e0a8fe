"""A model declared in LiteLLM's model_list, served through LiteLLM's Router and recorded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ProxyFactory

pytestmark = [
    pytest.mark.vllm,
    # litellm's own import emits deprecation warnings from its dependencies; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_litellm_routed_model_is_served_and_recorded(vllm_replica: Any, proxy_for: ProxyFactory,
                                                      tmp_path: Path) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list fetched at import
    config = tmp_path / "litellm.yaml"
    # "any OpenAI-compatible server": here the vLLM replica itself, reached through LiteLLM.
    config.write_text(
        "model_list:\n"
        "  - model_name: hosted-tiny\n"
        "    litellm_params:\n"
        "      model: openai/tiny\n"
        f"      api_base: {vllm_replica.url}/v1\n"
        "      api_key: none\n"
    )
    with proxy_for([vllm_replica.url], litellm_config=str(config)) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("h1", "a1"), api_key="x")
        whole = client.chat.completions.create(model="hosted-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0)
        stream = client.chat.completions.create(model="hosted-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        # The same attempt can mix hosted and replica calls.
        local = client.chat.completions.create(model="whatever", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0)
        calls = httpx.get(f"{proxy.url}/rollout/h1/attempt/a1").json()["calls"]
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    assert [c["replica"] for c in calls] == ["litellm:hosted-tiny", "litellm:hosted-tiny", vllm_replica.url]
    assert [c["status"] for c in calls] == ["ok", "ok", "ok"]
    assert calls[0]["requested_model"] == "hosted-tiny" and calls[0]["served_model"] == "hosted-tiny"
    assert calls[0]["response"]["choices"][0]["message"]["content"] == whole.choices[0].message.content
    assert calls[1]["response"]["choices"][0]["message"]["content"] == streamed
    assert calls[1]["is_streaming"] is True
    assert calls[2]["completion_token_ids"] and local.choices[0].message.content == whole.choices[0].message.content
