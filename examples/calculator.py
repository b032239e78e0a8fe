"""The task the framework examples share: add two numbers with an `add` tool, scored by a program.

Each example (`openai_tool_loop`, `langchain_agent`, `agents_sdk_agent`) is an ordinary agent of
its framework: the only Rolltap-specific thing is its base URL,
`http://PROXY/rollout/<rollout>/attempt/<attempt>/v1`. This module holds what they share: the
task, the tool, the reward, and running a GRPO group (several attempts of one task), each
attempt finished with its reward so the trainer can use it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

__all__ = ["ADD_TOOL", "FORCE_ADD", "Episode", "Task", "add", "answer_score", "base_url", "finish", "main_for",
           "run_group", "score", "valid_call"]

# The tool in OpenAI's chat-completions shape (the SDKs that take Python functions derive the same).
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
# `tool_choice` that makes the model call `add` (the replica constrains its output to the tool's
# arguments): the first turn of each example uses it, so even the tests' random tiny model calls the tool.
FORCE_ADD = {"type": "function", "function": {"name": "add"}}


@dataclass(frozen=True)
class Task:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}? Use the add tool, then answer with just the number."


def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


def score(task: Task, reply: str) -> float:
    """1.0 when the last number in the final answer is the sum, else 0.0."""
    numbers = re.findall(r"-?\d+", reply)
    return 1.0 if numbers and int(numbers[-1]) == task.a + task.b else 0.0


def answer_score(task: Task, reply: str) -> float:
    """The learning task's graded reward: 1.0 for just the sum ("579", "579."), 0.5 when the sum is
    the last number of a longer reply ("The sum is 579."), else 0.0. The half credit gives a group
    of a model that starts out chatty something to rank before it ever answers tersely."""
    if reply.strip().rstrip(".").strip() == str(task.a + task.b):
        return 1.0
    return 0.5 * score(task, reply)


def valid_call(task: Task, arguments: str) -> bool:
    """The tool call asked the question's numbers: `{"a": A, "b": B}` in either order."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    if not isinstance(args, dict) or set(args) != {"a", "b"}:
        return False
    return (args["a"], args["b"]) in ((task.a, task.b), (task.b, task.a))


@dataclass(frozen=True)
class Episode:
    """What one attempt did: its final answer, the model calls it made, and its tool calls' arguments."""

    answer: str
    calls: int
    tool_arguments: tuple[str, ...]
    reward: float = 0.0

    def valid_calls(self, task: Task) -> int:
        return sum(valid_call(task, a) for a in self.tool_arguments)


def base_url(proxy_url: str, rollout_id: str, attempt_id: str) -> str:
    """The templated base URL: the one thing an agent changes to be recorded."""
    return f"{proxy_url.rstrip('/')}/rollout/{rollout_id}/attempt/{attempt_id}/v1"


def finish(proxy_url: str, rollout_id: str, attempt_id: str, reward: float | None, api_key: str) -> None:
    """Report the reward and end the attempt (returns once its calls are durable). Without a
    reward the attempt is finished but never trained on (the trainer reads rewarded attempts)."""
    response = httpx.post(f"{proxy_url.rstrip('/')}/rollout/{rollout_id}/attempt/{attempt_id}/finish",
                          json={"status": "succeeded", "reward": reward},
                          headers={"authorization": f"Bearer {api_key}"}, timeout=120)
    response.raise_for_status()


def run_group(attempt: Callable[[str, str, str, Task, str], float], proxy_url: str, rollout_id: str, task: Task,
              *, size: int = 4, api_key: str = "none") -> list[float]:
    """Run `size` attempts of one task concurrently (one GRPO group); their rewards, in attempt order."""
    with ThreadPoolExecutor(max_workers=size) as pool:
        jobs = [pool.submit(attempt, proxy_url, rollout_id, f"a{i}", task, api_key) for i in range(size)]
        return [job.result() for job in jobs]


def main_for(attempt: Callable[[str, str, str, Task, str], float], name: str, description: str | None,
             argv: list[str] | None = None) -> None:
    """The examples' shared CLI: one group of attempts at "What is 3 + 4?" through `--proxy`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--proxy", default=os.environ.get("ROLLTAP_PROXY_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args(argv)
    rewards = run_group(attempt, args.proxy, f"{name}-{uuid.uuid4().hex[:8]}", Task(3, 4),
                        size=args.group_size, api_key=os.environ.get("ROLLTAP_AGENT_KEY") or "none")
    print(f"rewards: {rewards}")
