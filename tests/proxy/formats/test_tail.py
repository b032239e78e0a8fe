"""`proxy/formats/tail.py`: a cut stream read as it passes gives the token fields of the whole stream."""

from __future__ import annotations

import orjson
import pytest

from proxy.formats import StreamTail, for_route, parse_events
from proxy.sse import iter_data
from shared.types import Route
from tests.proxy.formats.captures import OPENAI_PAIRS, raw, route_of, stream


@pytest.mark.parametrize("streamed", [s for s, _ in OPENAI_PAIRS] + ["messages_stream"])
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_stream_tail_reads_the_fields_of_the_whole_stream(streamed: str, step: int) -> None:
    # A stream cut for storage is read by a `StreamTail` in whatever pieces it arrives: its
    # fields are those of the whole stream assembled at once (one byte at a time splits every
    # event, CRLF and multi-byte character).
    route = route_of(streamed)
    format = for_route(route)
    data = raw(streamed)
    tail = StreamTail(format)
    for i in range(0, len(data), step):
        tail.feed(data[i:i + step])
    fields = tail.fields()
    assert fields == format.extract(format.assemble(parse_events(iter_data(data))))
    assert fields.finish_reason is not None and not tail.is_stale
    if route != Route.MESSAGES:  # vLLM's Anthropic route returns no token IDs
        assert fields.completion_token_ids and fields.completion_logprobs


def test_stream_tail_keeps_no_text() -> None:
    # Only what the token fields need is kept: the text of a cut stream is not held twice.
    chat = for_route(Route.CHAT)
    tail = StreamTail(chat)
    tail.feed(raw("chat_stream"))
    kept = orjson.dumps(tail._assembly.result())
    assert chat.assemble(parse_events(stream("chat_stream")))["choices"][0]["message"]["content"]
    assert b'"content":""' in kept and b'"token"' not in kept and b'"top_logprobs"' not in kept
