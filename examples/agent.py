"""A small multi-turn agent that knows nothing of Rolltap: the plain `openai` SDK.

Point it at `http://PROXY/rollout/<rollout>/attempt/<attempt>/v1`, with an agent key as its
API key (`rolltap-proxy keys create`), and every call is recorded. Its task is a toy with a programmatic reward, so the demo has something to
score: answer "what is A + B" with the number. (The demo's tiny random model will not
manage it; a real one does, and the trainer has room to make it better.)

As a program (the compose `cpu` profile's `agent` service) it runs GRPO groups in rounds:
``python -m examples.agent --proxy URL [--groups 2] [--group-size 4] [--rounds 0]``; the agent key
comes from ``ROLLTAP_AGENT_KEY`` and is sent as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai

__all__ = ["Task", "main", "run_attempt", "score"]


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
    """Ask, then ask again to double-check; report the reward and finish the attempt.

    `api_key` (an agent key) goes out as `Authorization: Bearer <key>` on every call, `finish` included.
    """
    client = openai.OpenAI(base_url=f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", api_key=api_key)
    messages: list[dict[str, str]] = [{"role": "user", "content": task.question}]
    reply = ""
    for turn in range(turns):
        if stream:
            chunks = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=max_tokens, stream=True)
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[union-attr]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run GRPO groups of the arithmetic task through a Rolltap proxy.")
    parser.add_argument("--proxy", default=os.environ.get("ROLLTAP_PROXY_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--groups", type=int, default=2, help="tasks per round (one rollout each)")
    parser.add_argument("--group-size", type=int, default=4, help="attempts per task (a GRPO group)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds to run; 0 runs until stopped")
    parser.add_argument("--pause-s", type=float, default=2.0, help="pause between rounds")
    args = parser.parse_args(argv)
    api_key = os.environ.get("ROLLTAP_AGENT_KEY") or "none"
    print(f"agent: {args.groups} group(s) of {args.group_size} attempts per round through {args.proxy}", flush=True)
    if os.environ.get("ROLLTAP_WHERE_TO_LOOK"):  # set by docker-compose.yml: where a user sees the loop
        print(os.environ["ROLLTAP_WHERE_TO_LOOK"], flush=True)
    run = uuid.uuid4().hex[:8]
    rng = random.Random()
    done = 0
    with ThreadPoolExecutor(max_workers=args.groups * args.group_size) as pool:
        while args.rounds == 0 or done < args.rounds:
            jobs = []
            for g in range(args.groups):
                task = Task(rng.randint(1, 20), rng.randint(1, 20))
                rollout = f"agent-{run}-r{done}-g{g}"
                jobs += [pool.submit(run_attempt, args.proxy, rollout, f"a{i}", task, api_key=api_key)
                         for i in range(args.group_size)]
            rewards = [job.result() for job in jobs]
            done += 1
            print(f"round {done}: {len(rewards)} attempts, mean reward {sum(rewards) / len(rewards):.2f}", flush=True)
            time.sleep(args.pause_s)


if __name__ == "__main__":
    main()
