"""Turn what a replica sent into the record's fields.

Streamed responses are rebuilt into the shape of their non-streamed twin (content,
token IDs and logprobs concatenated per choice), so a record looks the same whichever
way the client asked. Extraction then reads token IDs, logprobs, finish reason and
usage from that shape. Runs after the last byte reached the client: never on the
relay's critical path.

A stream longer than the record keeps (`recorder.max_body_bytes`) is also read as it
passes, past the cut, by a `StreamTail`: it keeps only what extraction reads, so the
record's token fields are those of the whole answer while its body stays cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy import responses
from proxy.sse import SseParser
from shared.types import Route
from shared.verbatim import ExactJsonError, loads_exact

__all__ = ["Extract", "StreamTail", "assemble_stream", "extract"]

Json = dict[str, Any]


@dataclass(slots=True)
class Extract:
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    usage: Json | None = None
    error: Json | None = None


def _loads(data: str) -> Any:
    try:
        return loads_exact(data)  # lone surrogate escapes too: a model can emit them
    except ExactJsonError:
        return None


def assemble_stream(route: str, events: list[str]) -> Json:
    """Rebuild one response object from the `data:` payloads of a stream."""
    objects = [obj for obj in (_loads(e) for e in events if e != "[DONE]") if isinstance(obj, dict)]
    if route == Route.MESSAGES:
        return _assemble_messages(objects)
    if route == Route.RESPONSES:
        return responses.assemble_stream(objects)
    return _assemble_openai(route, objects)


def _assemble_openai(route: str, chunks: list[Json]) -> Json:
    assembly = _OpenAIAssembly(route)
    for chunk in chunks:
        assembly.add(chunk)
    return assembly.result()


class _OpenAIAssembly:
    """A chat or completions stream rebuilt chunk by chunk into its non-streamed shape."""

    def __init__(self, route: str) -> None:
        self._route = route
        self._out: Json = {}
        self._choices: dict[int, Json] = {}

    def add(self, chunk: Json) -> None:
        out = self._out
        if "error" in chunk and "choices" not in chunk:
            out["error"] = chunk["error"]
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in out:
                out[key] = chunk[key]
        if chunk.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for part in chunk.get("choices") or ():
            index = part.get("index", 0)
            choice = self._choices.setdefault(index, _empty_choice(self._route, index))
            _merge_choice(self._route, choice, part)

    def result(self) -> Json:
        """The response so far; its choices are the assembly's own (later chunks extend them)."""
        out = dict(self._out)
        out["object"] = "chat.completion" if self._route == Route.CHAT else "text_completion"
        out["choices"] = [self._choices[i] for i in sorted(self._choices)]
        return out


def _empty_choice(route: str, index: int) -> Json:
    if route == Route.CHAT:
        return {"index": index, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "token_ids": []}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None, "token_ids": []}


def _merge_choice(route: str, choice: Json, part: Json) -> None:
    if part.get("token_ids"):
        choice["token_ids"].extend(part["token_ids"])
    if part.get("prompt_token_ids") is not None:
        choice["prompt_token_ids"] = part["prompt_token_ids"]
    if part.get("finish_reason") is not None:
        choice["finish_reason"] = part["finish_reason"]
    if part.get("stop_reason") is not None:
        choice["stop_reason"] = part["stop_reason"]
    logprobs = part.get("logprobs")
    if route == Route.CHAT:
        _merge_delta(choice["message"], part.get("delta") or {})
        if logprobs and logprobs.get("content"):
            choice["logprobs"] = choice["logprobs"] or {"content": []}
            choice["logprobs"]["content"].extend(logprobs["content"])
        return
    choice["text"] += part.get("text") or ""
    if logprobs:
        merged = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            merged[key].extend(logprobs.get(key) or [])
        choice["logprobs"] = merged


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


def _assemble_messages(events: list[Json]) -> Json:
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
            parsed = _loads(block["partial_json"] or "{}")
            if isinstance(parsed, dict):
                block["input"] = parsed
                del block["partial_json"]
    return out


def extract(route: str, response: Any) -> Extract:
    """Read the record's token-level fields out of a (possibly assembled) response."""
    if not isinstance(response, dict):
        return Extract()
    if route == Route.MESSAGES:
        return Extract(
            prompt_token_ids=response.get("prompt_token_ids"),
            completion_token_ids=response.get("token_ids"),
            finish_reason=response.get("stop_reason"),
            usage=response.get("usage"),
            error=response.get("error"),
        )
    if route == Route.RESPONSES:
        prompt, completion, logprobs, finish, usage = responses.extract_fields(response)
        return Extract(prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=logprobs,
                       finish_reason=finish, usage=usage or _usage(prompt, completion), error=response.get("error"))
    choices = response.get("choices") or []
    first: Json = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt_ids = response.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = first.get("prompt_token_ids")  # completions put it on the choice
    token_ids = first.get("token_ids")
    return Extract(
        prompt_token_ids=prompt_ids,
        completion_token_ids=token_ids if token_ids is not None else None,
        completion_logprobs=_logprobs(route, first.get("logprobs")),
        finish_reason=first.get("finish_reason"),
        usage=response.get("usage") or _usage(prompt_ids, token_ids),
        error=response.get("error"),
    )


def _logprobs(route: str, logprobs: Any) -> list[float | None] | None:
    if not isinstance(logprobs, dict):
        return None
    if route == Route.CHAT:
        content = logprobs.get("content")
        return [entry.get("logprob") for entry in content] if isinstance(content, list) else None
    values = logprobs.get("token_logprobs")
    return list(values) if isinstance(values, list) else None


def _usage(prompt_ids: Any, token_ids: Any) -> Json | None:
    # Streams carry usage only when the client asked for it; the token IDs tell the same.
    if not isinstance(prompt_ids, list) or not isinstance(token_ids, list):
        return None
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
        "total_tokens": len(prompt_ids) + len(token_ids),
    }


_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class StreamTail:
    """The token fields of a whole stream whose record keeps only its first bytes.

    Fed every byte of the stream, from the first, once the record's copy is cut (never
    before: an uncut stream costs nothing here). Each event is parsed as it completes and
    only what `extract` reads is kept: token IDs, logprobs, finish reasons, usage, errors;
    text, tool calls and alternative tokens are dropped. Memory grows with the tokens, not
    the bytes. The Responses API carries its tokens only in the final event, which is kept
    whole (it holds the answer once). Only complete events count (a stream sealed before
    its last bytes is read again: `is_stale`).
    """

    def __init__(self, route: str) -> None:
        self._route = route
        self._parser = SseParser()
        self._pieces: list[bytes] = []  # bytes of one line still without its end (a long final event)
        self._assembly = _OpenAIAssembly(route) if route not in (Route.MESSAGES, Route.RESPONSES) else None
        self._events: list[Json] = []  # `messages` and `responses`: the few events that carry token fields
        self._read = 0  # events read
        self._read_at_fields = -1

    def feed(self, data: bytes) -> None:
        if b"\n" not in data and b"\r" not in data:
            # Joined once the line ends: the parser copies its pending bytes on every feed.
            self._pieces.append(data)
            return
        if self._pieces:
            data = b"".join([*self._pieces, data])
            self._pieces.clear()
        for event in self._parser.feed(data):
            self._read += 1
            value = _loads(event) if event != "[DONE]" else None
            if isinstance(value, dict):
                self._add(value)

    def _add(self, event: Json) -> None:
        if self._assembly is not None:
            self._assembly.add(_token_part(self._route, event))
        elif self._route == Route.MESSAGES:
            kind = event.get("type")
            if kind == "message_start" and isinstance(event.get("message"), dict):
                message = {k: v for k, v in event["message"].items() if k != "content"}
                self._events.append({"type": kind, "message": message})
            elif kind == "message_delta" or kind == "error" or "error" in event:
                self._events.append(event)
        elif event.get("type") in _FINAL_RESPONSE_EVENTS or event.get("type") == "error" or (
                "type" not in event and "error" in event):
            self._events.append(event)

    @property
    def is_stale(self) -> bool:
        """Whether events were read since `fields` last ran."""
        return self._read != self._read_at_fields

    def fields(self) -> Extract:
        """The record's token fields from every complete event read so far."""
        self._read_at_fields = self._read
        if self._assembly is not None:
            response = self._assembly.result()
        elif self._route == Route.MESSAGES:
            response = _assemble_messages(self._events)
        else:
            response = responses.assemble_stream(self._events)
        fields = extract(self._route, response)
        if fields.completion_token_ids is not None:  # the assembly's own list, which later chunks extend
            fields.completion_token_ids = list(fields.completion_token_ids)
        return fields


def _token_part(route: str, chunk: Json) -> Json:
    """What of a chat or completions chunk `extract` reads, in the chunk's shape."""
    part: Json = {key: chunk[key] for key in ("prompt_token_ids", "usage", "error") if key in chunk}
    if "choices" not in chunk:
        return part
    part["choices"] = []
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        kept = {key: choice[key] for key in ("index", "token_ids", "prompt_token_ids", "finish_reason", "stop_reason")
                if key in choice}
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            content = logprobs.get("content")
            if route == Route.CHAT and isinstance(content, list):
                kept["logprobs"] = {"content": [{"logprob": e.get("logprob") if isinstance(e, dict) else None}
                                                for e in content]}
            elif route != Route.CHAT:
                kept["logprobs"] = {"token_logprobs": logprobs.get("token_logprobs")}
        part["choices"].append(kept)
    return part
