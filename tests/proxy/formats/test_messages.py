"""`proxy/formats/messages.py`: an Anthropic stream rebuilt into one message equals its non-streamed twin.

Tool use is hand-written in the shapes Anthropic documents, since the tiny model emits none.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.formats import for_route, parse_events
from proxy.sse import iter_data
from shared.types import Route
from tests.proxy.formats.captures import stream, whole

MESSAGES = for_route(Route.MESSAGES)


def test_messages_stream_assembles_to_its_twin() -> None:
    assembled = MESSAGES.assemble(parse_events(stream("messages_stream")))
    expected = whole("messages_nonstream")
    for key in ("type", "role", "model", "content", "stop_reason", "usage"):
        assert assembled[key] == expected[key], key
    a, b = MESSAGES.extract(assembled), MESSAGES.extract(expected)
    assert (a.finish_reason, a.usage) == (b.finish_reason, b.usage) == ("max_tokens", expected["usage"])


def test_messages_tool_use_assembles_to_its_twin() -> None:
    # Anthropic streams tool input as `input_json_delta` pieces; the non-streamed twin has the object.
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                              "model": "m", "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": 9, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "check."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"city": '}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 7}},
        {"type": "message_stop"},
    ]
    raw = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)
    assembled = MESSAGES.assemble(parse_events(iter_data(raw)))
    twin = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
            "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 7}}
    assert assembled == twin
    # Cut mid-input: what arrived is kept as text rather than lost or half-parsed.
    cut = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events[:8])
    block = MESSAGES.assemble(parse_events(iter_data(cut)))["content"][1]
    assert block["partial_json"] == '{"city": ' and block["input"] == {}
