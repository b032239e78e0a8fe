"""Chat messages and reply text out of recorded request/response JSON, for every recorded route.

This module owns the knowledge of the four wire formats the proxy records
(`chat/completions`, `completions`, Anthropic `messages`, OpenAI `responses`): which field holds the
conversation, which holds the reply. The SFT export and re-tokenisation use it. It
never touches token IDs that the replica returned: those are always preferred.
"""

from __future__ import annotations

import json
from typing import Any

from shared.types import Route

__all__ = [
    "chat_messages",
    "flatten_content",
    "normalise_messages",
    "prompt_text",
    "reply_message",
    "reply_text",
]

CHAT = Route.CHAT.value
COMPLETIONS = Route.COMPLETIONS.value
MESSAGES = Route.MESSAGES.value
RESPONSES = Route.RESPONSES.value


def flatten_content(content: Any) -> str:
    """Text of an OpenAI or Anthropic `content` (a string, or a list of parts); non-text parts are skipped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_result":
                parts.append(flatten_content(part.get("content")))
        return "".join(parts)
    return str(content)


def _anthropic_to_openai(request: dict[str, Any]) -> list[dict[str, Any]]:
    # Anthropic keeps the system prompt beside the messages and tools inside content blocks;
    # OpenAI's shape (what chat templates and fine-tuning files expect) has them as messages.
    out: list[dict[str, Any]] = []
    system = request.get("system")
    if system:
        out.append({"role": "system", "content": flatten_content(system)})
    for msg in request.get("messages") or []:
        role = msg.get("role", "user")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        blocks = content if isinstance(content, list) else []
        text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        tool_uses = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        for res in results:
            out.append(
                {"role": "tool", "tool_call_id": res.get("tool_use_id"), "content": flatten_content(res.get("content"))}
            )
        if tool_uses:
            out.append({"role": role, "content": text, "tool_calls": [_tool_call(b) for b in tool_uses]})
        elif text or not results:
            out.append({"role": role, "content": text})
    return out


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})},
    }


def _response_call(item: dict[str, Any]) -> dict[str, Any]:
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}


def _responses_to_openai(request: dict[str, Any]) -> list[dict[str, Any]]:
    # Responses input is a list of items: messages (text parts), the model's earlier function
    # calls and their outputs. Chat's shape has calls on the assistant message, results as `tool`.
    out: list[dict[str, Any]] = []
    if isinstance(request.get("instructions"), str) and request["instructions"]:
        out.append({"role": "system", "content": request["instructions"]})
    items = request.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                out.append(last)
            last["tool_calls"].append(_response_call(item))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": flatten_content(item.get("output"))})
        elif kind == "message" and isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": flatten_content(item.get("content"))})
    return out


def _responses_reply(response: dict[str, Any]) -> dict[str, Any] | None:
    output = response.get("output")
    if not isinstance(output, list):
        return None
    text = "".join(flatten_content(i.get("content")) for i in output
                   if isinstance(i, dict) and i.get("type") == "message")
    calls = [_response_call(i) for i in output if isinstance(i, dict) and i.get("type") == "function_call"]
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = calls
    return out


def chat_messages(route: str, request: Any) -> list[dict[str, Any]] | None:
    """The conversation sent upstream, as OpenAI chat messages; None for raw-text `completions`."""
    if not isinstance(request, dict):
        return None
    if route == CHAT:
        messages = request.get("messages")
        return list(messages) if isinstance(messages, list) else None
    if route == MESSAGES:
        return _anthropic_to_openai(request)
    if route == RESPONSES:
        return _responses_to_openai(request)
    return None


def prompt_text(request: Any) -> str | list[int] | None:
    """The `prompt` of a `completions` request: text, or token IDs for token-in agents."""
    if not isinstance(request, dict):
        return None
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def reply_message(route: str, response: Any) -> dict[str, Any] | None:
    """The assistant message the model produced (first choice), in OpenAI's shape."""
    if not isinstance(response, dict):
        return None
    if route == CHAT:
        choices = response.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return None
        msg = choices[0].get("message") or {}
        out: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            out["tool_calls"] = msg["tool_calls"]
        return out
    if route == MESSAGES:
        blocks = response.get("content") or []
        text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        tool_uses = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
        out = {"role": "assistant", "content": text}
        if tool_uses:
            out["tool_calls"] = [_tool_call(b) for b in tool_uses]
        return out
    if route == RESPONSES:
        return _responses_reply(response)
    return None


def reply_text(route: str, response: Any) -> str | None:
    """The generated text of the first choice, or None when there is none (e.g. only tool calls)."""
    if not isinstance(response, dict):
        return None
    if route == COMPLETIONS:
        choices = response.get("choices") or []
        text = choices[0].get("text") if choices and isinstance(choices[0], dict) else None
        return text if isinstance(text, str) else None
    msg = reply_message(route, response)
    if msg is None:
        return None
    content = msg.get("content")
    return content if isinstance(content, str) and content else None


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages reduced to `{"role", "content"}` strings: one fixed shape for a parquet column."""
    return [{"role": str(m.get("role", "user")), "content": flatten_content(m.get("content"))} for m in messages]
