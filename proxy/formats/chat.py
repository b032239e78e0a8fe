"""OpenAI's chat completions (`/v1/chat/completions`) as the proxy records it.

A choice's content streams as `delta`s (text, reasoning, refusal, tool call pieces), its
logprobs as `logprobs.content` entries, one per token; vLLM adds `token_ids` to each
choice and `prompt_token_ids` to the response on request (`return_token_ids`).
"""

from __future__ import annotations

from proxy.formats.base import Json
from proxy.formats.openai import OpenAIFormat
from shared.types import Route

__all__ = ["Chat"]


class Chat(OpenAIFormat):
    route = Route.CHAT
    object = "chat.completion"

    def _ask_for_logprobs(self, body: Json) -> None:
        if not body.get("logprobs"):
            body["logprobs"] = True

    def empty_choice(self, index: int) -> Json:
        return {"index": index, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "token_ids": []}

    def merge_content(self, choice: Json, part: Json) -> None:
        _merge_delta(choice["message"], part.get("delta") or {})
        logprobs = part.get("logprobs")
        if logprobs and logprobs.get("content"):
            choice["logprobs"] = choice["logprobs"] or {"content": []}
            choice["logprobs"]["content"].extend(logprobs["content"])

    def _logprobs(self, logprobs: Json) -> list[float | None] | None:
        content = logprobs.get("content")
        return [entry.get("logprob") for entry in content] if isinstance(content, list) else None

    def token_logprobs(self, logprobs: Json) -> Json | None:
        content = logprobs.get("content")
        if not isinstance(content, list):
            return None
        return {"content": [{"logprob": e.get("logprob") if isinstance(e, dict) else None} for e in content]}


def _merge_delta(message: Json, delta: Json) -> None:
    for key in ("content", "reasoning_content", "reasoning", "refusal"):
        if delta.get(key):
            message[key] = (message.get(key) or "") + delta[key]
    if delta.get("role"):
        message["role"] = delta["role"]
    for call in delta.get("tool_calls") or ():
        calls = message.setdefault("tool_calls", [])
        index = call.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        target = calls[index]
        if call.get("id"):
            target["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            target["function"]["name"] += function["name"]
        if function.get("arguments"):
            target["function"]["arguments"] += function["arguments"]
