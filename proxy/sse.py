"""Incremental Server-Sent Events parsing, for reading a relayed stream after the fact.

The relay forwards raw bytes untouched; this module only turns the bytes it kept into
the `data:` payloads of each event, as bytes (JSON is parsed from bytes: decoding each
event to text first would only be undone by the parser). Lines may end in LF, CRLF or CR,
and a chunk may split anywhere, including inside a CRLF or a multi-byte character.
"""

from __future__ import annotations

__all__ = ["SseParser", "iter_data"]


class SseParser:
    """Feed bytes, get the `data` field of each completed event (multi-line data joined by LF)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[bytes]:
        if not chunk:
            return []  # keeps `_pending_cr`: an empty chunk between CR and LF must not split the CRLF
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = chunk.endswith(b"\r")
        buf = self._buf + chunk
        lines = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buf = lines.pop()  # the last piece has no line ending yet
        events: list[bytes] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def close(self) -> list[bytes]:
        """Events left when the stream ends without a final blank line (a cut stream)."""
        events = self.feed(b"\n\n") if (self._buf or self._data) else []
        self._buf = b""
        return events


def iter_data(raw: bytes) -> list[bytes]:
    """The `data` of every event of a whole stream, as `SseParser` reads it fed at once and closed.

    Streams end their lines in LF and their events in one `data: ` line (every replica and
    hosted model the proxy relays): those events are cut out with one `split` rather than line
    by line. Any other event (several lines, comments, other fields, a stray LF) and any stream
    with a CR take the parser.
    """
    if b"\r" in raw:
        parser = SseParser()
        return parser.feed(raw) + parser.close()
    events: list[bytes] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: ") and b"\n" not in block:
            events.append(block[6:])
        elif block:
            parser = SseParser()  # a blank line ends every block: its event is complete
            events += parser.feed(block) + parser.close()
    return events
