"""Anthropic's messages (`/v1/messages`) as the proxy records it.

A stream is a sequence of typed events: `message_start` (the message without content),
content blocks started and extended by deltas (text, or tool input as JSON text),
`message_delta` (stop reason, usage), `message_stop`. vLLM's Anthropic route returns
token IDs on request (`return_token_ids`) but no logprobs.
"""

from __future__ import annotations

from proxy.formats.base import Extract, Format, Json, KeptEvents, loads
from shared.types import Route

__all__ = ["Messages"]


class Messages(Format):
    route = Route.MESSAGES

    def ask_for_tokens(self, body: Json, *, logprobs: bool) -> None:
        body["return_token_ids"] = True  # logprobs: the route has none to give

    @staticmethod
    def is_terminal(chunk: bytes) -> bool:
        return b'{"type":"message_stop"' in chunk

    def assemble(self, events: list[Json]) -> Json:
        out: Json = {"type": "message", "role": "assistant", "content": []}
        for event in events:
            kind = event.get("type")
            if kind == "message_start":
                out.update({k: v for k, v in (event.get("message") or {}).items() if k != "content"})
            elif kind == "content_block_start":
                out["content"].append(dict(event.get("content_block") or {}))
            elif kind == "content_block_delta" and out["content"]:
                block, delta = out["content"][-1], event.get("delta") or {}
                if "text" in delta:
                    block["text"] = block.get("text", "") + delta["text"]
                if "partial_json" in delta:
                    block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
            elif kind == "message_delta":
                out.update(event.get("delta") or {})
                if event.get("usage"):
                    out["usage"] = {**(out.get("usage") or {}), **event["usage"]}
            elif kind == "error" or "error" in event:
                out["error"] = event.get("error", event)
        for block in out["content"]:
            # Tool input streams as JSON text; the non-streamed twin carries the parsed object.
            # A stream cut mid-input keeps the text it got under `partial_json`.
            if "partial_json" in block:
                parsed = loads(block["partial_json"] or "{}")
                if isinstance(parsed, dict):
                    block["input"] = parsed
                    del block["partial_json"]
        return out

    def _extract(self, response: Json) -> Extract:
        return Extract(
            prompt_token_ids=response.get("prompt_token_ids"),
            completion_token_ids=response.get("token_ids"),
            finish_reason=response.get("stop_reason"),
            usage=response.get("usage"),
            error=response.get("error"),
        )

    def tail(self) -> KeptEvents:
        return KeptEvents(_token_event, self.assemble)


def _token_event(event: Json) -> Json | None:
    """What of an event `extract` reads: the message's start without content, its deltas, errors."""
    kind = event.get("type")
    if kind == "message_start" and isinstance(event.get("message"), dict):
        return {"type": kind, "message": {k: v for k, v in event["message"].items() if k != "content"}}
    if kind == "message_delta" or kind == "error" or "error" in event:
        return event
    return None
