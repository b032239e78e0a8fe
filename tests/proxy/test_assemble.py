"""`proxy/assemble.py`: a stream rebuilt into one response equals its non-streamed twin.

`data/` holds real vLLM 0.27.1 wire captures (the tiny test model, greedy or seeded, so
the streamed and non-streamed answers to one request are the same tokens); `index.json`
there records each capture's request. Tool calls and Anthropic tool use are hand-written
in the shapes OpenAI/Anthropic document, since the tiny model emits neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.assemble import StreamTail, assemble_stream, extract
from proxy.sse import iter_data
from shared.types import Route

DATA = Path(__file__).parent / "data"
INDEX: dict[str, Any] = json.loads((DATA / "index.json").read_text())

# (streamed capture, non-streamed capture of the same request)
OPENAI_PAIRS = [
    ("chat_stream", "chat_nonstream"),
    ("chat_stream_usage", "chat_nonstream"),
    ("chat_eos_bias_stream", "chat_eos_bias_nonstream"),  # ends on EOS: finish_reason "stop"
    ("chat_special_bias_stream", "chat_special_bias_nonstream"),  # special tokens: in ids, not in text
    ("chat_n2_sampled_stream", "chat_n2_sampled_nonstream"),  # n=2, interleaved choices, seeded
    ("completions_str_logprobs1_stream", "completions_str_logprobs1_nonstream"),
    ("completions_ids_logprobs1_stream", "completions_ids_logprobs1_nonstream"),
]


def _route(name: str) -> str:
    return str(INDEX[name]["path"]).removeprefix("/v1/")


def _stream(name: str) -> list[str]:
    return list(iter_data((DATA / INDEX[name]["file"]).read_bytes()))


def _whole(name: str) -> dict[str, Any]:
    value = json.loads((DATA / INDEX[name]["file"]).read_text())
    assert isinstance(value, dict)
    return value


@pytest.mark.parametrize(("streamed", "whole"), OPENAI_PAIRS + [("messages_stream", "messages_nonstream")])
def test_captures_are_twins(streamed: str, whole: str) -> None:
    a, b = INDEX[streamed], INDEX[whole]
    assert a["status"] == b["status"] == 200
    assert a["content_type"].startswith("text/event-stream") and b["content_type"] == "application/json"
    assert a["path"] == b["path"]
    assert a["request"]["stream"] is True and "stream" not in b["request"]
    same = {k: v for k, v in a["request"].items() if k not in ("stream", "stream_options")}
    assert same == b["request"]
    assert same.get("temperature") == 0 or "seed" in same  # deterministic: both answers are the same tokens


@pytest.mark.parametrize(("streamed", "whole"), OPENAI_PAIRS)
def test_openai_stream_assembles_to_its_twin(streamed: str, whole: str) -> None:
    route = _route(streamed)
    events = _stream(streamed)
    assert events[-1] == "[DONE]"
    assembled = assemble_stream(route, events)
    expected = _whole(whole)

    for key in ("id", "model", "object", "system_fingerprint"):
        if key == "id":
            assert assembled[key].split("-")[0] == expected[key].split("-")[0]  # ids differ per request
        else:
            assert assembled[key] == expected[key], key
    assert len(assembled["choices"]) == len(expected["choices"]) == INDEX[whole]["request"].get("n", 1)
    for got, want in zip(assembled["choices"], expected["choices"], strict=True):
        assert got["index"] == want["index"]
        assert got["token_ids"] == want["token_ids"]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["logprobs"] == want["logprobs"]  # every entry: token, logprob, bytes / offsets
        if route == Route.CHAT:
            assert got["message"]["role"] == want["message"]["role"]
            assert got["message"]["content"] == want["message"]["content"]
            assert "tool_calls" not in got["message"]
        else:
            assert got["text"] == want["text"]
            assert got["prompt_token_ids"] == want["prompt_token_ids"]

    # What the record keeps: identical whichever way the client asked.
    a, b = extract(route, assembled), extract(route, expected)
    assert a.prompt_token_ids == b.prompt_token_ids and a.prompt_token_ids
    assert a.completion_token_ids == b.completion_token_ids and a.completion_token_ids
    assert a.completion_logprobs == b.completion_logprobs
    assert a.completion_logprobs is not None and len(a.completion_logprobs) == len(a.completion_token_ids)
    assert a.finish_reason == b.finish_reason
    assert a.error is None and b.error is None
    assert a.usage is not None and b.usage is not None
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert a.usage[key] == b.usage[key], key  # from the stream's usage chunk, or counted from the ids


@pytest.mark.parametrize("streamed", [s for s, _ in OPENAI_PAIRS] + ["messages_stream"])
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_stream_tail_reads_the_fields_of_the_whole_stream(streamed: str, step: int) -> None:
    # A stream cut for storage is read by a `StreamTail` in whatever pieces it arrives: its
    # fields are those of the whole stream assembled at once (one byte at a time splits every
    # event, CRLF and multi-byte character).
    route = _route(streamed)
    raw = (DATA / INDEX[streamed]["file"]).read_bytes()
    tail = StreamTail(route)
    for i in range(0, len(raw), step):
        tail.feed(raw[i:i + step])
    fields = tail.fields()
    assert fields == extract(route, assemble_stream(route, list(iter_data(raw))))
    assert fields.finish_reason is not None and not tail.is_stale
    if route != Route.MESSAGES:  # vLLM's Anthropic route returns no token IDs
        assert fields.completion_token_ids and fields.completion_logprobs


def test_stream_tail_keeps_no_text() -> None:
    # Only what the token fields need is kept: the text of a cut stream is not held twice.
    raw = (DATA / INDEX["chat_stream"]["file"]).read_bytes()
    tail = StreamTail(Route.CHAT)
    tail.feed(raw)
    kept = orjson.dumps(tail._assembly.result() if tail._assembly else None)
    assert assemble_stream(Route.CHAT, _stream("chat_stream"))["choices"][0]["message"]["content"]
    assert b'"content":""' in kept and b'"token"' not in kept and b'"top_logprobs"' not in kept


def test_eos_is_kept_in_token_ids() -> None:
    # The EOS token (<|im_end|> = 2) ends the greedy answer: it is in the ids and logprobs, not the text.
    fields = extract(Route.CHAT, assemble_stream(Route.CHAT, _stream("chat_eos_bias_stream")))
    assert fields.finish_reason == "stop"
    assert fields.completion_token_ids is not None and fields.completion_token_ids[-1] == 2
    assert fields.completion_logprobs is not None
    assert len(fields.completion_logprobs) == len(fields.completion_token_ids)


def test_messages_stream_assembles_to_its_twin() -> None:
    assembled = assemble_stream(Route.MESSAGES, _stream("messages_stream"))
    expected = _whole("messages_nonstream")
    for key in ("type", "role", "model", "content", "stop_reason", "usage"):
        assert assembled[key] == expected[key], key
    a, b = extract(Route.MESSAGES, assembled), extract(Route.MESSAGES, expected)
    assert (a.finish_reason, a.usage) == (b.finish_reason, b.usage) == ("max_tokens", expected["usage"])


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
    assembled = assemble_stream(Route.CHAT, _sse(chunks))
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
    fields = extract(Route.CHAT, assembled)
    assert (fields.prompt_token_ids, fields.completion_token_ids) == ([1, 2], [10, 11, 12, 13, 14])


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
    assembled = assemble_stream(Route.MESSAGES, list(iter_data(raw)))
    twin = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
            "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 7}}
    assert assembled == twin
    # Cut mid-input: what arrived is kept as text rather than lost or half-parsed.
    cut = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events[:8])
    block = assemble_stream(Route.MESSAGES, list(iter_data(cut)))["content"][1]
    assert block["partial_json"] == '{"city": ' and block["input"] == {}


def test_error_event_mid_stream_is_kept() -> None:
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5], "finish_reason": None}]}
    error = {"message": "engine died", "type": "internal_error", "param": None, "code": 500}
    raw = b"data: " + orjson.dumps(first) + b"\n\ndata: " + orjson.dumps({"error": error}) + b"\n\n"
    assembled = assemble_stream(Route.CHAT, list(iter_data(raw)))
    assert assembled["choices"][0]["token_ids"] == [5]
    assert extract(Route.CHAT, assembled).error == error
