"""OpenAI's chat completions (`/v1/chat/completions`) as the proxy records it.

A choice's content streams as `delta`s (text, reasoning, refusal, tool call pieces), its
logprobs as `logprobs.content` entries, one per token; vLLM adds `token_ids` to each
choice and `prompt_token_ids` to the response on request (`return_token_ids`).

Logprobs the proxy asks for on its own (the client asked for none) come as token IDs only
(`proxy.formats.openai.mark_ids_only`): vLLM's front end builds neither the text nor the bytes
of every token. The record never kept those strings: the trainer reads token IDs and logprobs.
"""

from __future__ import annotations

from proxy.formats.base import Json
from proxy.formats.openai import OpenAIFormat, Pieces, append_text, joined_text, mark_ids_only
from shared.types import Route

__all__ = ["Chat"]


class Chat(OpenAIFormat):
    route = Route.CHAT
    object = "chat.completion"

    def _ask_for_logprobs(self, body: Json) -> None:
        if body.get("logprobs"):
            return  # the client's own: answered as it asked
        if body.get("top_logprobs") not in (None, 0) or body.get("logprob_token_ids"):
            # Options that need `logprobs`, without it: an error in OpenAI's API and vLLM's. Turned on
            # here, the agent would get an answer it cannot get anywhere else; left off, it gets vLLM's 400.
            return
        body["logprobs"] = True
        mark_ids_only(body)

    def empty_choice(self, index: int) -> Json:
        return {"index": index, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "token_ids": []}

    def merge_content(self, choice: Json, part: Json) -> None:
        delta = part.get("delta")
        if delta and type(delta) is dict:
            _merge_delta(choice["message"], delta)
        logprobs = part.get("logprobs")
        if logprobs and type(logprobs) is dict:
            content = logprobs.get("content")
            if content and type(content) is list:
                if choice["logprobs"] is None:
                    choice["logprobs"] = {"content": []}
                choice["logprobs"]["content"].extend(content)

    def joined(self, choice: Json) -> Json:
        message = choice["message"]
        calls = message.get("tool_calls")
        if not any(type(value) is Pieces for value in message.values()) and not calls:
            return choice
        message = {key: joined_text(value) for key, value in message.items()}
        if calls:
            message["tool_calls"] = [{**call, "function": {key: joined_text(value) for key, value in call["function"].items()}}
                                     for call in calls]
        return {**choice, "message": message}

    def _logprobs(self, logprobs: Json) -> list[float | None] | None:
        content = logprobs.get("content")
        return [entry.get("logprob") for entry in content] if isinstance(content, list) else None

    def token_logprobs(self, logprobs: Json) -> Json | None:
        content = logprobs.get("content")
        if not isinstance(content, list):
            return None
        return {"content": [{"logprob": e.get("logprob") if isinstance(e, dict) else None} for e in content]}


_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")


def _merge_delta(message: Json, delta: Json) -> None:
    for key in _TEXT_KEYS:
        piece = delta.get(key)
        if piece:
            append_text(message, key, piece)
    if delta.get("role"):
        message["role"] = delta["role"]
    calls = delta.get("tool_calls")
    if not calls or type(calls) is not list:
        return
    for call in calls:
        if type(call) is not dict:
            continue
        merged = message.setdefault("tool_calls", [])
        index = call.get("index", len(merged))
        if type(index) is not int or not 0 <= index < len(merged) + 1024:
            index = len(merged)  # not an index, or one that would make the record hold a thousand empty calls
        while len(merged) <= index:
            merged.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        target = merged[index]
        if call.get("id"):
            target["id"] = call["id"]
        function = call.get("function")
        if function and type(function) is dict:
            append_text(target["function"], "name", function.get("name"))
            append_text(target["function"], "arguments", function.get("arguments"))
