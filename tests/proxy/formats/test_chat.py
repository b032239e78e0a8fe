"""`proxy/formats/chat.py`: what only chat streams carry (tool call deltas, the EOS token) assembles whole.

Tool calls are hand-written in the shapes OpenAI documents, since the tiny model emits none.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.formats import for_route, parse_events
from proxy.sse import iter_data
from shared.types import Route
from tests.proxy.formats.captures import stream

CHAT = for_route(Route.CHAT)


def test_eos_is_kept_in_token_ids() -> None:
    # The EOS token (<|im_end|> = 2) ends the greedy answer: it is in the ids and logprobs, not the text.
    fields = CHAT.extract(CHAT.assemble(parse_events(stream("chat_eos_bias_stream"))))
    assert fields.finish_reason == "stop"
    assert fields.completion_token_ids is not None and fields.completion_token_ids[-1] == 2
    assert fields.completion_logprobs is not None
    assert len(fields.completion_logprobs) == len(fields.completion_token_ids)


def _sse(objects: list[Any]) -> list[str]:
    raw = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objects) + b"data: [DONE]\n\n"
    return list(iter_data(raw))


def _tool_delta(choice: int, token: int, calls: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": choice, "delta": {"tool_calls": calls}, "finish_reason": finish,
                         "token_ids": [token], "logprobs": {"content": [{"token": str(token), "logprob": -0.5}]}}]}


def test_chat_tool_call_deltas_merge_per_call_and_choice() -> None:
    # Two choices; choice 0 makes two parallel calls whose argument deltas interleave.
    chunks = [
        {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "prompt_token_ids": [1, 2], "choices": [{"index": i, "delta": {"role": "assistant", "content": None},
                                                  "finish_reason": None} for i in (0, 1)]},
        _tool_delta(0, 10, [{"index": 0, "id": "call_a", "type": "function",
                             "function": {"name": "get_weather", "arguments": ""}}]),
        _tool_delta(1, 20, [{"index": 0, "id": "call_c", "type": "function",
                             "function": {"name": "get_time", "arguments": '{"tz": '}}]),
        _tool_delta(0, 11, [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]),
        _tool_delta(0, 12, [{"index": 1, "id": "call_b", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city"'}}]),
        _tool_delta(0, 13, [{"index": 0, "function": {"arguments": 'ris"}'}}]),
        _tool_delta(1, 21, [{"index": 0, "function": {"arguments": '"UTC"}'}}], finish="tool_calls"),
        _tool_delta(0, 14, [{"index": 1, "function": {"arguments": ': "Oslo"}'}}], finish="tool_calls"),
    ]
    assembled = CHAT.assemble(parse_events(_sse(chunks)))
    first, second = assembled["choices"]
    assert first["message"]["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]
    assert second["message"]["tool_calls"] == [
        {"id": "call_c", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
    ]
    assert [c["finish_reason"] for c in (first, second)] == ["tool_calls", "tool_calls"]
    assert first["token_ids"] == [10, 11, 12, 13, 14] and second["token_ids"] == [20, 21]
    assert [e["logprob"] for e in first["logprobs"]["content"]] == [-0.5] * 5
    for choice in (first, second):
        for call in choice["message"]["tool_calls"]:
            json.loads(call["function"]["arguments"])  # the pieces join into valid JSON
    fields = CHAT.extract(assembled)
    assert (fields.prompt_token_ids, fields.completion_token_ids) == ([1, 2], [10, 11, 12, 13, 14])
