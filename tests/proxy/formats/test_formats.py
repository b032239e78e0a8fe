"""`proxy/formats`: every recorded route has its format; any other route is read as it always was."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.formats import FORMATS, for_route, parse_events
from proxy.sse import iter_data
from shared.types import Route
from tests.proxy.formats.captures import INDEX, OPENAI_PAIRS, route_of, stream

# The last event of each recorded API's stream, as its replica sends it.
ENDS = {
    Route.CHAT: b"data: [DONE]\n\n",
    Route.COMPLETIONS: b"data: [DONE]\n\n",
    Route.MESSAGES: b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    Route.RESPONSES: b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
}


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


def test_every_recorded_route_has_its_format() -> None:
    assert set(FORMATS) == set(Route)
    for route in Route:
        assert for_route(route) is FORMATS[route] and for_route(route).route == route
        assert for_route(route.value) is FORMATS[route]  # looked up by the path's plain string
        assert for_route(route).is_terminal(ENDS[route])


@pytest.mark.parametrize("streamed", [s for s, _ in OPENAI_PAIRS] + ["messages_stream"])
def test_only_the_last_chunk_of_a_capture_is_terminal(streamed: str) -> None:
    raw = b"".join(b"data: " + e + b"\n\n" for e in stream(streamed))
    format = for_route(route_of(streamed))
    events = raw.split(b"\n\n")[:-1]
    assert [format.is_terminal(e + b"\n\n") for e in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize(("route", "logprobs", "body", "asked"), [
    (Route.CHAT, True, {}, {"return_token_ids": True, "logprobs": True, "return_tokens_as_token_ids": True,
                            "vllm_xargs": {"rolltap_ids_only": 1}}),
    (Route.CHAT, True, {"vllm_xargs": {"a": "b"}}, {"return_token_ids": True, "logprobs": True,
                                                    "return_tokens_as_token_ids": True,
                                                    "vllm_xargs": {"a": "b", "rolltap_ids_only": 1}}),
    (Route.CHAT, True, {"vllm_xargs": "x"}, {"return_token_ids": True, "logprobs": True,
                                             "return_tokens_as_token_ids": True, "vllm_xargs": "x"}),
    (Route.CHAT, True, {"logprobs": True, "top_logprobs": 2}, {"return_token_ids": True, "logprobs": True,
                                                               "top_logprobs": 2}),
    (Route.CHAT, True, {"prompt_logprobs": 0}, {"return_token_ids": True, "logprobs": True, "prompt_logprobs": 0}),
    (Route.CHAT, True, {"top_logprobs": 2}, {"return_token_ids": True, "top_logprobs": 2}),  # vLLM's 400 stands
    (Route.CHAT, True, {"logprob_token_ids": [5]}, {"return_token_ids": True, "logprob_token_ids": [5]}),
    (Route.CHAT, True, {"top_logprobs": 0}, {"return_token_ids": True, "top_logprobs": 0, "logprobs": True,
                                             "return_tokens_as_token_ids": True, "vllm_xargs": {"rolltap_ids_only": 1}}),
    (Route.CHAT, False, {}, {"return_token_ids": True}),
    (Route.COMPLETIONS, True, {}, {"return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True,
                                   "vllm_xargs": {"rolltap_ids_only": 1}}),
    (Route.COMPLETIONS, True, {"prompt_logprobs": 1}, {"return_token_ids": True, "logprobs": 0,
                                                       "prompt_logprobs": 1}),
    (Route.COMPLETIONS, True, {"logprobs": 3}, {"return_token_ids": True, "logprobs": 3}),
    (Route.COMPLETIONS, False, {}, {"return_token_ids": True}),
    (Route.COMPLETIONS, True, {"echo": True}, {"echo": True}),
    (Route.COMPLETIONS, True, {"echo": True, "return_token_ids": True}, {"echo": True, "return_token_ids": True,
                                                                          "logprobs": 0, "return_tokens_as_token_ids": True,
                                                                          "vllm_xargs": {"rolltap_ids_only": 1}}),
    (Route.MESSAGES, True, {}, {"return_token_ids": True}),
    (Route.RESPONSES, False, {}, {"enable_response_messages": True}),
])
def test_ask_for_tokens(route: Route, logprobs: bool, body: dict[str, Any], asked: dict[str, Any]) -> None:
    for_route(route).ask_for_tokens(body, logprobs=logprobs)
    assert body == asked


def test_choice_fields() -> None:
    assert {route: for_route(route).choice_fields for route in Route} == {
        Route.CHAT: ("n",), Route.COMPLETIONS: ("n", "best_of"), Route.MESSAGES: (), Route.RESPONSES: ()}


def test_an_unrecorded_route_is_read_as_openai_completions() -> None:
    # `/v1/embeddings` (relayed untracked): read the way OpenAI responses are, never refused, asked
    # for token IDs only, and a stream ends at any recorded API's end marker.
    other = for_route("embeddings")
    assert other not in FORMATS.values() and for_route("anything/else") is other
    assert other.choice_fields == ()
    body: dict[str, Any] = {"input": "x", "n": 2}
    other.ask_for_tokens(body, logprobs=True)
    assert body == {"input": "x", "n": 2, "return_token_ids": True}
    assert all(other.is_terminal(end) for end in ENDS.values())
    assert not other.is_terminal(b'data: {"object":"list"}\n\n')
    usage = {"prompt_tokens": 2, "total_tokens": 2}
    fields = other.extract({"object": "list", "data": [{"embedding": [0.5]}], "usage": usage})
    assert fields.usage == usage and fields.completion_token_ids is None and fields.error is None
    assert other.extract({"error": {"message": "no"}}).error == {"message": "no"}
    assert other.extract([1]).usage is None
    chunk = {"id": "x", "choices": [{"index": 0, "text": "a", "token_ids": [3],
                                     "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"}]}
    raw = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    assembled = other.assemble(parse_events(iter_data(raw)))
    assert assembled == {"id": "x", "object": "text_completion", "choices": [
        {"index": 0, "text": "a", "logprobs": {"tokens": [], "token_logprobs": [-1.0], "top_logprobs": [],
                                               "text_offset": []}, "finish_reason": "stop", "token_ids": [3]}]}
    assert other.extract(assembled).completion_logprobs == [-1.0]
