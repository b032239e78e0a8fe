"""A tool-calling agent written against the plain `openai` SDK: call the model, run the tools it asks
for, send the results back, until it answers.

Rolltap sees it only through its base URL (`examples.calculator.base_url`). The first turn
names the tool it must call (`tool_choice`), the usual way to make an agent use its tools;
later turns leave the choice to the model.

``python -m examples.openai_tool_loop --proxy URL [--group-size 4]`` runs one group.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from examples.calculator import ADD_TOOL, FORCE_ADD, Task, add, base_url, finish, main_for, score

__all__ = ["run_attempt"]


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, api_key: str = "none",
                *, max_turns: int = 3) -> float:
    client = openai.OpenAI(base_url=base_url(proxy_url, rollout_id, attempt_id), api_key=api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    answer = ""
    for turn in range(max_turns):
        out = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL],  # type: ignore[list-item]
                                             tool_choice=FORCE_ADD if turn == 0 else "auto", max_tokens=200)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments)))  # type: ignore[union-attr]
            except (TypeError, ValueError) as exc:  # a model's malformed call is an answer too
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    reward = score(task, answer)
    finish(proxy_url, rollout_id, attempt_id, reward, api_key)
    return reward


def main(argv: list[str] | None = None) -> None:
    main_for(run_attempt, "tool-loop", __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    main()
