"""Each framework example runs a group of attempts against a real CPU replica; every recorded call carries tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from examples import agents_sdk_agent, langchain_agent, openai_tool_loop
from examples.calculator import Task, run_group
from tests.conftest import ProxyFactory

pytestmark = pytest.mark.vllm

GROUP = 2


def _agents_sdk(api: agents_sdk_agent.Api) -> Callable[..., float]:
    def attempt(proxy: str, rollout: str, attempt_id: str, task: Task, key: str) -> float:
        return agents_sdk_agent.run_attempt(proxy, rollout, attempt_id, task, key, api=api)

    return attempt


EXAMPLES: dict[str, tuple[Callable[..., float], str]] = {
    "openai_tool_loop": (openai_tool_loop.run_attempt, "chat/completions"),
    "langchain": (langchain_agent.run_attempt, "chat/completions"),
    "agents_sdk_responses": (_agents_sdk("responses"), "responses"),
    "agents_sdk_chat": (_agents_sdk("chat"), "chat/completions"),
}


def _tool_calls(call: dict[str, Any]) -> list[Any]:
    response = call["response"] or {}
    if call["route"] == "responses":
        return [i for i in response.get("output") or () if i.get("type") == "function_call"]
    return response["choices"][0]["message"].get("tool_calls") or []


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_group_is_recorded_with_tokens(name: str, vllm_replica: Any, proxy_for: ProxyFactory) -> None:
    attempt, route = EXAMPLES[name]
    with proxy_for([vllm_replica.url]) as proxy:
        rewards = run_group(attempt, proxy.url, f"ex-{name}", Task(3, 4), size=GROUP)
        attempts = [httpx.get(f"{proxy.url}/rollout/ex-{name}/attempt/a{i}", timeout=60).json() for i in range(GROUP)]
    assert len(rewards) == GROUP and all(r in (0.0, 1.0) for r in rewards)
    for recorded, reward in zip(attempts, rewards, strict=True):
        assert recorded["status"] == "succeeded"
        assert [r["value"] for r in recorded["rewards"]] == [reward]
        calls = recorded["calls"]
        assert calls and {c["route"] for c in calls} == {route}
        for call in calls:
            assert call["status"] == "ok", call["error"]
            assert call["prompt_token_ids"] and call["completion_token_ids"], call["call_id"]
            assert call["policy_version"] == 0 and call["served_model"] == "tiny"
        # The first turn names the tool: the replica returned a tool call, and the agent sent
        # the tool's result back in the next call.
        assert _tool_calls(calls[0]), calls[0]["response"]
        assert len(calls) >= 2
