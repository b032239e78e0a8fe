"""The OpenAI Responses API (`/v1/responses`) as the proxy records it.

This module owns what the proxy knows of that wire format: what to add to a tracked
request so the replica returns exact tokens, how a stream of Responses events becomes
the non-streamed response object, and where the token-level fields sit in it.

vLLM returns raw token IDs on request (`"enable_response_messages": true`): the
response's `input_messages[].tokens` are the prompt as the model saw it, its
`output_messages[].tokens` what it generated. Per-token logprobs come with
`"include": ["message.output_text.logprobs"]`, on each `output_text` part. Both are
added to the upstream request only; what reaches the client is the replica's answer as
sent (as for chat, where `return_token_ids` and `logprobs` are added the same way).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOGPROBS_INCLUDE", "ask_for_tokens", "assemble_stream", "extract_fields"]

Json = dict[str, Any]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The events that end a Responses stream, each carrying the whole response object.
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_START_EVENTS = frozenset({"response.created", "response.in_progress"})


def ask_for_tokens(body: Json, *, logprobs: bool) -> None:
    """Ask the replica for prompt and output token IDs and, with `logprobs`, the output's logprobs
    (a client's own `include` entries are kept)."""
    body["enable_response_messages"] = True
    if not logprobs:
        return
    include = body.get("include")
    include = list(include) if isinstance(include, list) else []
    if LOGPROBS_INCLUDE not in include:
        include.append(LOGPROBS_INCLUDE)
    body["include"] = include


def assemble_stream(events: list[Json]) -> Json:
    """The response object of a stream: the final event's, else what the deltas built (a cut stream)."""
    out: Json | None = None
    texts: dict[tuple[int, int], str] = {}
    logprobs: dict[tuple[int, int], list[Any]] = {}
    error: Any = None
    for event in events:
        kind = event.get("type")
        if kind in _FINAL_EVENTS and isinstance(event.get("response"), dict):
            return dict(event["response"])
        if kind in _START_EVENTS and isinstance(event.get("response"), dict):
            out = dict(event["response"])
        elif kind == "response.output_text.delta":
            key = (int(event.get("output_index") or 0), int(event.get("content_index") or 0))
            texts[key] = texts.get(key, "") + (event.get("delta") or "")
            logprobs.setdefault(key, []).extend(event.get("logprobs") or [])
        elif kind == "error" or (kind is None and "error" in event):
            error = event.get("error", event)
    out = out or {"object": "response"}
    if texts:
        # Cut before the end: keep the text generated so far, in the non-streamed shape.
        items: dict[int, Json] = {}
        for (item, part), text in sorted(texts.items()):
            message = items.setdefault(item, {"type": "message", "role": "assistant", "content": []})
            message["content"].append({"type": "output_text", "text": text, "logprobs": logprobs.get((item, part))})
        out["output"] = [items[i] for i in sorted(items)]
    if error is not None:
        out["error"] = error
    return out


def _tokens(messages: Any) -> list[int] | None:
    """The token IDs of vLLM's raw `input_messages`/`output_messages`, joined in order."""
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for message in messages:
        tokens = message.get("tokens") if isinstance(message, dict) else None
        if not isinstance(tokens, list):
            return None
        ids.extend(tokens)
    return ids


def _logprobs(output: Any) -> list[float | None]:
    values: list[float | None] = []
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                values.extend(entry.get("logprob") if isinstance(entry, dict) else None for entry in part["logprobs"])
    return values


def _finish_reason(response: Json) -> str | None:
    status = response.get("status")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason == "max_output_tokens" else (reason or "incomplete")
    if status == "completed":
        calls = [i for i in response.get("output") or () if isinstance(i, dict) and i.get("type") == "function_call"]
        return "tool_calls" if calls else "stop"
    return status if isinstance(status, str) else None


def extract_fields(response: Json) -> tuple[list[int] | None, list[int] | None, list[float | None] | None,
                                            str | None, Json | None]:
    """(prompt token IDs, completion token IDs, completion logprobs, finish reason, usage) of a response.

    Logprobs are kept only when there is one per generated token: text parsed into tool calls
    has none, and a list that cannot be aligned with the tokens would mislead the trainer.
    """
    prompt = _tokens(response.get("input_messages"))
    completion = _tokens(response.get("output_messages"))
    logprobs: list[float | None] | None = _logprobs(response.get("output"))
    if completion is None or len(logprobs or ()) != len(completion):
        logprobs = None
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    return prompt, completion, logprobs, _finish_reason(response), usage
