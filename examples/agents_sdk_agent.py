"""A tool-calling agent built with the OpenAI Agents SDK (`openai-agents`), on either of its models:
the Responses API (`OpenAIResponsesModel`, the SDK's default) or chat completions
(`OpenAIChatCompletionsModel`).

Rolltap sees it only through the client's base URL (`examples.calculator.base_url`). The
SDK's tracing is switched off: it would export traces to OpenAI's servers. The first turn
names the tool to call (`tool_choice="add"`; the SDK resets the choice after a tool ran).

``python -m examples.agents_sdk_agent --proxy URL [--api responses|chat] [--group-size 4]`` runs one group.
`play` is the same agent with its sampling settings and what the episode did (calls, tool
arguments): `scripts/learn.py --task calculator` trains it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import Callable
from typing import Any, Literal

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelResponse, ModelSettings,
                    OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, RunHooks, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI, BadRequestError
from openai.types.responses import ResponseFunctionToolCall

from examples.calculator import Episode, Task, add, base_url, finish, run_group, score

__all__ = ["INSTRUCTIONS", "play", "run_attempt"]

INSTRUCTIONS = "Answer arithmetic questions with the add tool."

Api = Literal["responses", "chat"]

set_tracing_disabled(True)

add_tool = function_tool(add)


class _Trace(RunHooks[Any]):
    """Counts the model calls of an episode and keeps its tool calls' arguments as the model wrote
    them, also for an episode that ends in an error."""

    def __init__(self) -> None:
        self.calls = 0
        self.arguments: list[str] = []

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any, input_items: Any) -> None:
        self.calls += 1

    async def on_llm_end(self, context: Any, agent: Any, response: ModelResponse) -> None:
        self.arguments += [str(item.arguments) for item in response.output if isinstance(item, ResponseFunctionToolCall)]


async def _run(client: AsyncOpenAI, api: Api, question: str, settings: ModelSettings) -> Episode:
    model = (OpenAIResponsesModel(model="policy", openai_client=client) if api == "responses"
             else OpenAIChatCompletionsModel(model="policy", openai_client=client))
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, model=model, tools=[add_tool],
                  model_settings=settings)
    trace = _Trace()
    try:
        result = await Runner.run(agent, question, max_turns=3, hooks=trace)
        answer = str(result.final_output or "")
    # A model that never stops calling the tool, calls it badly, or writes arguments so broken
    # that the replica refuses them when they come back in the next turn: the episode ends unanswered.
    except (MaxTurnsExceeded, ModelBehaviorError, BadRequestError):
        answer = ""
    finally:
        await client.close()
    return Episode(answer, trace.calls, tuple(trace.arguments))


def play(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, api_key: str = "none", *,
         api: Api = "chat", temperature: float | None = None, max_tokens: int = 200, seed: int | None = None,
         reward: Callable[[Task, str], float] | None = score) -> Episode:
    """One attempt: the agent answers `task`, the attempt is finished with `reward(task, answer)`
    (no reward with `reward=None`: a held-out evaluation, recorded but never trained on)."""
    client = AsyncOpenAI(base_url=base_url(proxy_url, rollout_id, attempt_id), api_key=api_key, max_retries=3)
    settings = ModelSettings(tool_choice="add", max_tokens=max_tokens, temperature=temperature,
                             extra_body=None if seed is None else {"seed": seed})
    episode = asyncio.run(_run(client, api, task.question, settings))
    value = None if reward is None else reward(task, episode.answer)
    finish(proxy_url, rollout_id, attempt_id, value, api_key)
    return Episode(episode.answer, episode.calls, episode.tool_arguments, value or 0.0)


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, api_key: str = "none",
                *, api: Api = "responses") -> float:
    return play(proxy_url, rollout_id, attempt_id, task, api_key, api=api).reward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--proxy", default=os.environ.get("ROLLTAP_PROXY_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api", choices=["responses", "chat"], default="responses")
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args(argv)

    def attempt(proxy: str, rollout: str, attempt_id: str, task: Task, key: str) -> float:
        return run_attempt(proxy, rollout, attempt_id, task, key, api=args.api)

    rewards = run_group(attempt, args.proxy, f"agents-sdk-{uuid.uuid4().hex[:8]}", Task(3, 4),
                        size=args.group_size, api_key=os.environ.get("ROLLTAP_AGENT_KEY") or "none")
    print(f"rewards: {rewards}")


if __name__ == "__main__":
    main()
