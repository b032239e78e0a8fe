"""A task a tiny model made on the spot can learn on CPU: write text full of one letter.

The reward is programmatic and dense: the share of the reply's non-space characters that
are the target letter (about 0.11 for "e" from a random tiny model). Every sample scores
differently, so GRPO gets a signal from the first step. Several attempts per task form a
group: `/rollout/<task>/attempt/<k>`.

The agent is the plain `openai` SDK pointed at the proxy's templated URL, with an agent key
as its API key.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai

__all__ = ["LetterTask", "run_attempt", "score"]


@dataclass(frozen=True)
class LetterTask:
    letter: str = "e"
    topic: str = "the sea"

    @property
    def prompt(self) -> str:
        return f"Write a few words about {self.topic}, using the letter {self.letter} as often as you can."


def score(task: LetterTask, reply: str) -> float:
    chars = [c for c in reply if not c.isspace()]
    return sum(c == task.letter for c in chars) / len(chars) if chars else 0.0


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: LetterTask, *, api_key: str,
                max_tokens: int = 16, http: httpx.Client | None = None, temperature: float = 1.0,
                seed: int | None = None) -> float:
    """One attempt: ask, score, report the reward with `finish` (both with the agent key). Returns the reward."""
    base_url = f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    # openai takes an httpx.Client at run time; its annotations name its vendored client's type.
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=3,
                           http_client=http if http is not None else None)  # type: ignore[arg-type]
    extra = {} if seed is None else {"seed": seed}
    out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}],
                                         max_tokens=max_tokens, temperature=temperature,
                                         **extra)  # type: ignore[call-overload]  # `seed` only when given
    reward = score(task, out.choices[0].message.content or "")
    poster = http or httpx.Client(timeout=120)
    try:
        poster.post(f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/finish",
                    json={"status": "succeeded", "reward": reward},
                    headers={"authorization": f"Bearer {api_key}"}).raise_for_status()
    finally:
        if http is None:
            poster.close()
    return reward
