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


def _sse(objects: list[Any]) -> list[bytes]:
    raw = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objects) + b"data: [DONE]\n\n"
    return iter_data(raw)


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


def test_a_hostile_stream_assembles_what_it_can_and_never_raises() -> None:
    # A replica (or anything posing as one) may send any JSON: what is not a choice, a delta or a
    # tool call is skipped, an index that is not one opens the next call, and nothing makes the
    # record hold a billion empty tool calls.
    events = parse_events(_sse([
        {"choices": [1, "x", None, {"index": "0", "delta": "text", "logprobs": [1]}]},
        {"choices": {"index": 0}},
        {"choices": [{"index": 0, "delta": {"content": 5, "tool_calls": [7, {"index": 10**9, "function": "f"}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "ok", "tool_calls": [{"index": -1, "function": {"name": "g"}}]},
                      "token_ids": "12", "logprobs": {"content": "x"}}]},
    ]))
    assembled = CHAT.assemble(events)
    (choice,) = assembled["choices"]
    assert choice["message"]["content"] == "ok"
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["", "g"]
    assert choice["token_ids"] == [] and choice["logprobs"] is None
    assert CHAT.extract(assembled).completion_token_ids == []


def test_long_answers_assemble_in_linear_time() -> None:
    # Text pieces are joined once: 32 times the tokens may take at most ~32 times as long (with
    # room for noise), where concatenating piece by piece took ~400 times on the development machine.
    import time

    def seconds(n: int) -> float:
        chunks = [{"choices": [{"index": 0, "delta": {"content": "abcdefghij" * 2,
                                                      "tool_calls": [{"index": 0, "function": {"arguments": "x" * 20}}]},
                                "token_ids": [i]}]} for i in range(n)]
        started = time.perf_counter()
        CHAT.assemble(chunks)
        return time.perf_counter() - started

    small = min(seconds(500) for _ in range(5))
    large = min(seconds(16_000) for _ in range(2))
    assert large < small * 32 * 4
