"""The token fields of a stream longer than its record keeps (`recorder.max_body_bytes`).

The record's body stays cut; its token fields are those of the whole answer, read here
as the stream passes, past the cut. What is kept of each event is the format's business
(`Format.tail`); this module only parses the bytes into events.
"""

from __future__ import annotations

from proxy.formats.base import Extract, Format, loads
from proxy.sse import SseParser

__all__ = ["StreamTail"]


class StreamTail:
    """The token fields of a whole stream whose record keeps only its first bytes.

    Fed every byte of the stream, from the first, once the record's copy is cut (never
    before: an uncut stream costs nothing here). Each event is parsed as it completes and
    only what `extract` reads is kept: token IDs, logprobs, finish reasons, usage, errors;
    text, tool calls and alternative tokens are dropped. Memory grows with the tokens, not
    the bytes (the Responses API, which carries its tokens only in its final event, keeps
    that event whole: it holds the answer once). Only complete events count (a stream
    sealed before its last bytes is read again: `is_stale`).
    """

    def __init__(self, format: Format) -> None:
        self._format = format
        self._parser = SseParser()
        self._pieces: list[bytes] = []  # bytes of one line still without its end (a long final event)
        self._assembly = format.tail()
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
            value = loads(event) if event != b"[DONE]" else None
            if isinstance(value, dict):
                self._assembly.add(value)

    @property
    def is_stale(self) -> bool:
        """Whether events were read since `fields` last ran."""
        return self._read != self._read_at_fields

    def fields(self) -> Extract:
        """The record's token fields from every complete event read so far."""
        self._read_at_fields = self._read
        fields = self._format.extract(self._assembly.result())
        if fields.completion_token_ids is not None:  # may be the assembly's own list, which later events extend
            fields.completion_token_ids = list(fields.completion_token_ids)
        return fields
