"""OpenAI's Responses API (`/v1/responses`) as the proxy records it.

vLLM returns raw token IDs on request (`"enable_response_messages": true`): the
response's `input_messages[].tokens` are the prompt as the model saw it, its
`output_messages[].tokens` what it generated. Per-token logprobs come with
`"include": ["message.output_text.logprobs"]`, on each `output_text` part. Both are
added to the upstream request only; what reaches the client is the replica's answer as
sent (as for chat, where `return_token_ids` and `logprobs` are added the same way).

A stream ends with one final event (`response.completed`, `.incomplete` or `.failed`)
carrying the whole response object: the record is built from it, or, for a stream cut
before it, from the text deltas it got.
"""

from __future__ import annotations

from typing import Any

from proxy.formats.base import Extract, Format, Json, KeptEvents, usage_of
from shared.types import Route

__all__ = ["LOGPROBS_INCLUDE", "Responses"]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The events that end a Responses stream, each carrying the whole response object.
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_START_EVENTS = frozenset({"response.created", "response.in_progress"})


class Responses(Format):
    route = Route.RESPONSES

    def ask_for_tokens(self, body: Json, *, logprobs: bool) -> None:
        body["enable_response_messages"] = True
        if not logprobs:
            return
        include = body.get("include")
        include = list(include) if isinstance(include, list) else []  # a client's own entries are kept
        if LOGPROBS_INCLUDE not in include:
            include.append(LOGPROBS_INCLUDE)
        body["include"] = include

    @staticmethod
    def is_terminal(chunk: bytes) -> bool:
        # Three scans rather than `any()` over a generator: it costs more than the scans.
        return (b'"type":"response.completed"' in chunk or b'"type":"response.incomplete"' in chunk
                or b'"type":"response.failed"' in chunk)

    def assemble(self, events: list[Json]) -> Json:
        """The final event's response object, else what the deltas built (a cut stream)."""
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
                message["content"].append({"type": "output_text", "text": text,
                                           "logprobs": logprobs.get((item, part))})
            out["output"] = [items[i] for i in sorted(items)]
        if error is not None:
            out["error"] = error
        return out

    def _extract(self, response: Json) -> Extract:
        """Logprobs are kept only when there is one per generated token: text parsed into tool calls
        has none, and a list that cannot be aligned with the tokens would mislead the trainer."""
        prompt = _tokens(response.get("input_messages"))
        completion = _tokens(response.get("output_messages"))
        logprobs: list[float | None] | None = _logprobs(response.get("output"))
        if completion is None or len(logprobs or ()) != len(completion):
            logprobs = None
        usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
        return Extract(prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=logprobs,
                       finish_reason=_finish_reason(response), usage=usage or usage_of(prompt, completion),
                       error=response.get("error"))

    def tail(self) -> KeptEvents:
        return KeptEvents(_token_event, self.assemble)


def _token_event(event: Json) -> Json | None:
    """The events `extract` reads: the final one (kept whole: it holds the answer once) and errors."""
    kind = event.get("type")
    if kind in _FINAL_EVENTS or kind == "error" or ("type" not in event and "error" in event):
        return event
    return None


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
