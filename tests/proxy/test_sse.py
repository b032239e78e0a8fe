"""`proxy/sse.py`: a stream split anywhere parses like the whole, and parse(render(x)) == x."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse import SseParser, iter_data

# A data line cannot hold a line break; everything else goes, multi-byte UTF-8 included.
line_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\r\n"), max_size=12)
event_data = st.lists(line_text, min_size=1, max_size=3).map("\n".join)
newlines = st.sampled_from(["\n", "\r\n", "\r"])


@dataclass
class Rendering:
    raw: bytes
    events: list[str]


@st.composite
def renderings(draw: st.DrawFn) -> Rendering:
    """Events rendered the way servers write them, with the noise the parser must skip."""
    events = draw(st.lists(event_data, max_size=6))
    mixed = draw(st.booleans())  # one ending for the whole stream, or a different one per line
    fixed = draw(newlines)
    out: list[str] = []

    def line(text: str) -> None:
        ending = draw(newlines) if mixed else fixed
        if not text and out and out[-1].endswith("\r") and ending == "\n":
            ending = "\r"  # CR then LF is one CRLF in any SSE reader: that blank line would vanish
        out.append(text + ending)

    for data in events:
        if draw(st.booleans()):
            line(": " + draw(line_text))  # comment / keep-alive
        if draw(st.booleans()):
            line("event: " + draw(st.sampled_from(["message", "content_block_delta"])))
        for part in data.split("\n"):
            # The one space after the colon is optional and not part of the value.
            line(("data:" if draw(st.booleans()) and not part.startswith(" ") else "data: ") + part)
        if draw(st.booleans()):
            line("id: " + str(draw(st.integers(0, 99))))
        line("")  # the blank line that ends the event
    if draw(st.booleans()):
        line(":keep-alive")  # a comment alone is no event
    return Rendering("".join(out).encode("utf-8"), events)


def parse_chunks(chunks: list[bytes]) -> list[str]:
    """The events of a stream fed in these chunks, as text (a client decodes them)."""
    parser = SseParser()
    events: list[bytes] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return [event.decode("utf-8", "replace") for event in events + parser.close()]


def split(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]  # a repeated cut: an empty chunk


@settings(max_examples=300, deadline=None)
@given(renderings())
def test_parse_render_roundtrip(rendering: Rendering) -> None:
    assert iter_data(rendering.raw) == [event.encode() for event in rendering.events]


def cuts_in(raw: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=0, max_value=len(raw)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(renderings(), st.data())
def test_split_anywhere_gives_the_same_events(rendering: Rendering, data: st.DataObject) -> None:
    cuts = data.draw(cuts_in(rendering.raw), label="cuts")
    assert parse_chunks(split(rendering.raw, cuts)) == rendering.events


@settings(max_examples=100, deadline=None)
@given(renderings())
def test_byte_by_byte(rendering: Rendering) -> None:
    raw = rendering.raw
    assert parse_chunks([raw[i:i + 1] for i in range(len(raw))]) == rendering.events


@settings(max_examples=200, deadline=None)
@given(st.lists(event_data, min_size=1, max_size=4), newlines, st.data())
def test_cut_stream_keeps_its_last_event(events: list[str], newline: str, data: st.DataObject) -> None:
    # A replica that dies before the final blank line: close() still hands over the last event.
    raw = "".join(
        "".join(f"data: {part}{newline}" for part in data.split("\n")) + newline for data in events
    ).encode()
    raw = raw[: -len(newline)]
    assert parse_chunks(split(raw, data.draw(cuts_in(raw), label="cuts"))) == events


def test_examples() -> None:
    raw = "data: {\"a\": 1}\r\n\r\n: ping\r\ndata: héllo\rdata: wörld\r\rdata: [DONE]\n\n".encode()
    assert iter_data(raw) == [b'{"a": 1}', "héllo\nwörld".encode(), b"[DONE]"]
    parser = SseParser()
    # A CRLF split between chunks is one line ending, not two (which would end the event early).
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"") == []
    assert parser.feed(b"\ndata: b\r") == []
    assert parser.feed(b"\n\r\n") == [b"a\nb"]
    # A multi-byte character split between chunks comes out whole.
    euro = "€".encode()
    assert parser.feed(b"data: " + euro[:1]) == []
    assert parser.feed(euro[1:] + b"\n\n") == [euro]


# Any bytes inside a data line (invalid UTF-8 included), except the line breaks that end it.
raw_line = st.binary(max_size=24).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@settings(max_examples=300, deadline=None)
@given(st.lists(raw_line, min_size=1, max_size=5), st.data())
def test_invalid_utf8_and_split_characters_parse_the_same_whole_or_split(lines: list[bytes],
                                                                         data: st.DataObject) -> None:
    # Each event decodes as its whole data would: a character split between chunks comes out
    # whole, and a byte that is not UTF-8 becomes U+FFFD the same way wherever the cut falls.
    raw = b"".join(b"data: " + line + b"\n\n" for line in lines)
    # `data: ` gives the one space the field strips; a line's own leading space is data.
    expected = [line.decode("utf-8", "replace") for line in lines]
    assert parse_chunks(split(raw, data.draw(cuts_in(raw), label="cuts"))) == expected


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=20), st.data())
def test_multibyte_text_split_across_chunks_assembles_whole(text: str, data: st.DataObject) -> None:
    from proxy.formats import for_route, parse_events

    chunks = [f'data: {{"choices":[{{"index":0,"delta":{{"content":{json.dumps(ch, ensure_ascii=False)}}}}}]}}\n\n'
              for ch in text]
    raw = ("".join(chunks) + "data: [DONE]\n\n").encode("utf-8")
    events = parse_chunks(split(raw, data.draw(cuts_in(raw), label="cuts")))
    content = for_route("chat/completions").assemble(parse_events(e.encode() for e in events))["choices"]
    assert (content[0]["message"]["content"] if content else "") == text


# Pieces of what a stream holds, put together in any order: the whole-stream reader's fast path
# (one `data: ` line per event, LF only) must read anything exactly as the line parser does.
sse_pieces = st.sampled_from([b"data: ", b"data:", b"data:  ", b"\n", b"\n\n", b"\r", b"\r\n", b":", b": ping",
                              b"event: e", b"id: 1", b'{"a":1}', b"x", b" ", b"\xe2\x82", b"\xac"])


@settings(max_examples=500, deadline=None)
@given(st.lists(sse_pieces, max_size=40).map(b"".join))
def test_the_whole_stream_reader_reads_any_bytes_as_the_line_parser_does(raw: bytes) -> None:
    parser = SseParser()
    assert iter_data(raw) == parser.feed(raw) + parser.close()
