"""A tool-calling agent built with LangChain's `ChatOpenAI`: the model bound to a Python tool, its
tool calls run and answered with `ToolMessage`s until it replies in text.

Rolltap sees it only through `base_url` (`examples.calculator.base_url`). The first turn
names the tool to call (`tool_choice="add"`), later turns leave the choice to the model.

``python -m examples.langchain_agent --proxy URL [--group-size 4]`` runs one group.
"""

from __future__ import annotations

from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from examples.calculator import Task, add, base_url, finish, main_for, score

__all__ = ["run_attempt"]

add_tool = tool(add)


def run_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: Task, api_key: str = "none",
                *, max_turns: int = 3) -> float:
    llm = ChatOpenAI(model="policy", base_url=base_url(proxy_url, rollout_id, attempt_id), api_key=api_key,
                     max_tokens=200, max_retries=0)
    messages: list[BaseMessage] = [HumanMessage(task.question)]
    answer = ""
    for turn in range(max_turns):
        reply = llm.bind_tools([add_tool], tool_choice="add" if turn == 0 else "auto").invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:  # type: ignore[attr-defined]
            answer = str(reply.content)
            break
        for call in reply.tool_calls:  # type: ignore[attr-defined]
            try:
                result = str(add_tool.invoke(call["args"]))
            except Exception as exc:  # noqa: BLE001 - a model's malformed call is answered, not fatal
                result = f"error: {exc}"
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    reward = score(task, answer)
    finish(proxy_url, rollout_id, attempt_id, reward, api_key)
    return reward


def main(argv: list[str] | None = None) -> None:
    main_for(run_attempt, "langchain", __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    main()
