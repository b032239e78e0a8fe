"""`proxy/formats/openai.py`: a chat or completions stream rebuilt into one response equals its non-streamed twin.

`captures.py` holds real vLLM wire captures of both ways of asking one request.
"""

from __future__ import annotations

import orjson
import pytest

from proxy.formats import for_route, parse_events
from proxy.sse import iter_data
from shared.types import Route
from tests.proxy.formats.captures import INDEX, OPENAI_PAIRS, route_of, stream, whole


@pytest.mark.parametrize(("streamed", "nonstreamed"), OPENAI_PAIRS)
def test_openai_stream_assembles_to_its_twin(streamed: str, nonstreamed: str) -> None:
    route = route_of(streamed)
    format = for_route(route)
    events = stream(streamed)
    assert events[-1] == b"[DONE]"
    assembled = format.assemble(parse_events(events))
    expected = whole(nonstreamed)
    for key in ("id", "model", "object", "system_fingerprint"):
        if key == "id":
            assert assembled[key].split("-")[0] == expected[key].split("-")[0]  # ids differ per request
        else:
            assert assembled[key] == expected[key], key
    assert len(assembled["choices"]) == len(expected["choices"]) == INDEX[nonstreamed]["request"].get("n", 1)
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
    a, b = format.extract(assembled), format.extract(expected)
    assert a.prompt_token_ids == b.prompt_token_ids and a.prompt_token_ids
    assert a.completion_token_ids == b.completion_token_ids and a.completion_token_ids
    assert a.completion_logprobs == b.completion_logprobs
    assert a.completion_logprobs is not None and len(a.completion_logprobs) == len(a.completion_token_ids)
    assert a.finish_reason == b.finish_reason
    assert a.error is None and b.error is None
    assert a.usage is not None and b.usage is not None
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert a.usage[key] == b.usage[key], key  # from the stream's usage chunk, or counted from the ids


def test_error_event_mid_stream_is_kept() -> None:
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5], "finish_reason": None}]}
    error = {"message": "engine died", "type": "internal_error", "param": None, "code": 500}
    raw = b"data: " + orjson.dumps(first) + b"\n\ndata: " + orjson.dumps({"error": error}) + b"\n\n"
    chat = for_route(Route.CHAT)
    assembled = chat.assemble(parse_events(iter_data(raw)))
    assert assembled["choices"][0]["token_ids"] == [5]
    assert chat.extract(assembled).error == error
