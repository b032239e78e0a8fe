"""A small multi-turn agent that knows nothing of Rolltap: the plain `openai` SDK.

Point it at `http://PROXY/rollout/<rollout>/attempt/<attempt>/v1`, with an agent key as its
API key (`rolltap-proxy keys create`), and every call is recorded. Its task is a toy with a programmatic reward, so the demo has something to
score: answer "what is A + B" with the number. (The demo's tiny random model will not
manage it; a real one does, and the trainer has room to make it better.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx
import openai

__all__ = ["Task", "run_attempt", "score"]


@dataclass(frozen=True)
class Task:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}? Answer with just the number."


def score(task: Task, reply: str) -> float:
    """1.0 when the first number in the reply is the sum, else 0.0."""
    match = re.search(r"-?\d+", reply)
    return 1.0 if match and int(match.group()) == task.a + task.b else 0.0


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, *, api_key: str, turns: int = 2,
                max_tokens: int = 16, stream: bool = True) -> float:
    """Ask, then ask again to double-check; report the reward and finish the attempt (both with the agent key)."""
    client = openai.OpenAI(base_url=f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", api_key=api_key)
    messages: list[dict[str, str]] = [{"role": "user", "content": task.question}]
    reply = ""
    for turn in range(turns):
        if stream:
            chunks = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=max_tokens, stream=True)
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            out = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=max_tokens)
            reply = out.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        if turn + 1 < turns:
            messages.append({"role": "user", "content": "Are you sure? Give just the number."})
    reward = score(task, reply)
    finished = httpx.post(f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/finish",
                          json={"status": "succeeded", "reward": reward},
                          headers={"authorization": f"Bearer {api_key}"}, timeout=120)
    finished.raise_for_status()
    return reward
