"""A tool-calling agent built with the OpenAI Agents SDK (`openai-agents`), on either of its models:
the Responses API (`OpenAIResponsesModel`, the SDK's default) or chat completions
(`OpenAIChatCompletionsModel`).

Rolltap sees it only through the client's base URL (`examples.calculator.base_url`). The
SDK's tracing is switched off: it would export traces to OpenAI's servers. The first turn
names the tool to call (`tool_choice="add"`; the SDK resets the choice after a tool ran).

``python -m examples.agents_sdk_agent --proxy URL [--api responses|chat] [--group-size 4]`` runs one group.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from typing import Literal

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, OpenAIChatCompletionsModel,
                    OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

from examples.calculator import Task, add, base_url, finish, run_group, score

__all__ = ["run_attempt"]

Api = Literal["responses", "chat"]

set_tracing_disabled(True)

add_tool = function_tool(add)


async def _run(client: AsyncOpenAI, api: Api, question: str) -> str:
    model = (OpenAIResponsesModel(model="policy", openai_client=client) if api == "responses"
             else OpenAIChatCompletionsModel(model="policy", openai_client=client))
    agent = Agent(name="calculator", instructions="Answer arithmetic questions with the add tool.", model=model,
                  tools=[add_tool], model_settings=ModelSettings(tool_choice="add", max_tokens=200))
    try:
        result = await Runner.run(agent, question, max_turns=3)
    except (MaxTurnsExceeded, ModelBehaviorError):  # a model that never stops calling, or calls badly
        return ""
    finally:
        await client.close()
    return str(result.final_output or "")


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, api_key: str = "none",
                *, api: Api = "responses") -> float:
    client = AsyncOpenAI(base_url=base_url(proxy_url, rollout_id, attempt_id), api_key=api_key)
    answer = asyncio.run(_run(client, api, task.question))
    reward = score(task, answer)
    finish(proxy_url, rollout_id, attempt_id, reward, api_key)
    return reward


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
