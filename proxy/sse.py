"""Incremental Server-Sent Events parsing, for reading a relayed stream after the fact.

The relay forwards raw bytes untouched; this module only turns the bytes it kept into
the `data:` payloads of each event. Lines may end in LF, CRLF or CR, and a chunk may
split anywhere, including inside a CRLF or a multi-byte character.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["SseParser", "iter_data"]


class SseParser:
    """Feed bytes, get the `data` field of each completed event (multi-line data joined by LF)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        if not chunk:
            return []  # keeps `_pending_cr`: an empty chunk between CR and LF must not split the CRLF
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = chunk.endswith(b"\r")
        buf = self._buf + chunk
        lines = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buf = lines.pop()  # the last piece has no line ending yet
        events: list[str] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode("utf-8", "replace"))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line (a cut stream)."""
        events = self.feed(b"\n\n") if (self._buf or self._data) else []
        self._buf = b""
        return events


def iter_data(raw: bytes) -> Iterator[str]:
    parser = SseParser()
    yield from parser.feed(raw)
    yield from parser.close()
