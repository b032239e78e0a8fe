"""`proxy/formats/responses.py`: what the proxy asks the Responses API for, a stream rebuilt, token fields extracted."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.formats import StreamTail, for_route, parse_events
from shared.types import Route

RESPONSES = for_route(Route.RESPONSES)
ask_for_tokens, extract, is_terminal = RESPONSES.ask_for_tokens, RESPONSES.extract, RESPONSES.is_terminal


def _assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    return RESPONSES.assemble(parse_events(orjson.dumps(e).decode() for e in events))


def _final(status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": [{"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "ab", "logprobs": [{"token": "a", "logprob": -0.5},
                                                                    {"token": "b", "logprob": -0.25}]}]}],
            "input_messages": [{"message": "p", "tokens": [1, 2, 3], "type": "raw_message_tokens"}],
            "output_messages": [{"message": "ab", "tokens": [7, 8], "type": "raw_message_tokens"}]}


def test_ask_for_tokens_keeps_the_clients_include() -> None:
    body = {"input": "x", "include": ["reasoning.encrypted_content"]}
    ask_for_tokens(body, logprobs=True)
    assert body["enable_response_messages"] is True
    assert body["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    ask_for_tokens(body, logprobs=True)  # idempotent
    assert body["include"].count("message.output_text.logprobs") == 1
    plain = {"input": "x", "include": ["reasoning.encrypted_content"]}
    ask_for_tokens(plain, logprobs=False)  # `proxy.rollout_logprobs` off: token IDs only
    assert plain == {"input": "x", "include": ["reasoning.encrypted_content"], "enable_response_messages": True}


def test_whole_and_streamed_responses_extract_the_same_fields() -> None:
    whole = extract(_final("incomplete"))
    assert (whole.prompt_token_ids, whole.completion_token_ids) == ([1, 2, 3], [7, 8])
    assert whole.completion_logprobs == [-0.5, -0.25] and whole.finish_reason == "length"
    assert whole.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = [{"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
              {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "a"},
              {"type": "response.completed", "response": _final()}]
    streamed = extract(_assemble(events))
    assert streamed.completion_token_ids == [7, 8] and streamed.finish_reason == "stop"
    assert is_terminal(b"event: response.completed\ndata: " + orjson.dumps(events[-1]) + b"\n\n")
    assert not is_terminal(b"event: response.output_text.delta\ndata: " + orjson.dumps(events[1]) + b"\n\n")


def test_a_cut_stream_keeps_its_text_and_a_tool_call_leaves_logprobs_unknown() -> None:
    events = [{"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
              {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "a",
               "logprobs": [{"token": "a", "logprob": -0.5}]}]
    cut = _assemble(events)
    assert cut["output"][0]["content"][0]["text"] == "a" and cut["id"] == "resp_1"
    assert extract(cut).completion_token_ids is None  # no final event: no token IDs
    called = _final()
    called["output"] = [{"type": "function_call", "name": "add", "arguments": "{}", "call_id": "c1"}]
    fields = extract(called)
    assert fields.completion_token_ids == [7, 8] and fields.completion_logprobs is None
    assert fields.finish_reason == "tool_calls"


def test_stream_tail_reads_the_final_event_once_it_is_whole() -> None:
    # A cut Responses stream is sealed when a chunk shows its final event's type, which may be
    # before the rest of that event (it carries the whole answer) arrived: the tail then says
    # it is stale, and the record is built again from the whole event.
    events = [{"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
              *({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": c,
                 "logprobs": [{"token": c, "logprob": -0.5}]} for c in "ab"),
              {"type": "response.completed", "response": _final()}]
    raw = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)
    split = raw.index(b'"response.completed"') + 40
    assert is_terminal(raw[:split]) and not raw[:split].endswith(b"\n\n")
    tail = StreamTail(RESPONSES)
    tail.feed(raw[:split])
    early = tail.fields()
    assert early.completion_token_ids is None and not tail.is_stale
    for i in range(split, len(raw), 16):
        tail.feed(raw[i:i + 16])
    assert tail.is_stale
    fields = tail.fields()
    assert fields == extract(_final()) and fields.completion_token_ids == [7, 8]
    assert fields.completion_logprobs == [-0.5, -0.25] and fields.finish_reason == "stop" and not tail.is_stale
