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
        content = out["content"]
        # The last block's streamed text, in pieces: joined once it is done (concatenating piece by
        # piece copies the text so far for every token).
        pieces: dict[str, list[str]] = {}
        for event in events:
            kind = event.get("type")
            if kind == "message_start":
                out.update({k: v for k, v in (event.get("message") or {}).items() if k != "content"})
            elif kind == "content_block_start":
                _join_pieces(content, pieces)
                content.append(dict(event.get("content_block") or {}))
            elif kind == "content_block_delta" and content:
                delta = event.get("delta") or {}
                for key in ("text", "partial_json"):
                    if isinstance(delta.get(key), str):
                        if key not in pieces:
                            start = content[-1].get(key)
                            pieces[key] = [start if isinstance(start, str) else ""]
                        pieces[key].append(delta[key])
            elif kind == "message_delta":
                out.update(event.get("delta") or {})
                if event.get("usage"):
                    out["usage"] = {**(out.get("usage") or {}), **event["usage"]}
            elif kind == "error" or "error" in event:
                out["error"] = event.get("error", event)
        _join_pieces(content, pieces)
        for block in content:
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


def _join_pieces(content: list[Json], pieces: dict[str, list[str]]) -> None:
    """The last block's text pieces, joined into it."""
    for key, parts in pieces.items():
        content[-1][key] = "".join(parts)
    pieces.clear()


def _token_event(event: Json) -> Json | None:
    """What of an event `extract` reads: the message's start without content, its deltas, errors."""
    kind = event.get("type")
    if kind == "message_start" and isinstance(event.get("message"), dict):
        return {"type": kind, "message": {k: v for k, v in event["message"].items() if k != "content"}}
    if kind == "message_delta" or kind == "error" or "error" in event:
        return event
    return None
