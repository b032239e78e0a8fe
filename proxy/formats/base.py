"""What every recorded API's format provides (`Format`), and what they all read with.

A format is stateless and built once at import: the relay looks its call's up once
(`proxy.formats.for_route`) and calls it. Only `is_terminal` runs per streamed chunk;
everything else runs once per call, after its last byte reached the client.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from shared.verbatim import ExactJsonError, loads_exact

__all__ = ["Extract", "Format", "Json", "KeptEvents", "TailAssembly", "loads", "parse_events", "usage_of"]

Json = dict[str, Any]


@dataclass(slots=True)
class Extract:
    """A call's token-level record fields, read from its (possibly assembled) response."""

    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    usage: Json | None = None
    error: Json | None = None


class TailAssembly(Protocol):
    """What a `StreamTail` keeps of a cut stream's events: only what `Format.extract` reads."""

    def add(self, event: Json) -> None: ...

    def result(self) -> Json:
        """The response of the events added so far, in the shape `Format.extract` reads."""
        ...


class Format(ABC):
    """One recorded API's wire format (`route`, as in `shared.types.Route`)."""

    route: str
    # Request fields that ask for several choices: refused on recorded calls (`proxy.sampling`).
    choice_fields: tuple[str, ...] = ()

    @abstractmethod
    def ask_for_tokens(self, body: Json, *, logprobs: bool) -> None:
        """Add to a recorded call's body (in place) what makes the replica return exact prompt and
        completion token IDs and, with `logprobs`, the sampled tokens' logprobs; a client's own
        settings are kept."""

    @staticmethod
    @abstractmethod
    def is_terminal(chunk: bytes) -> bool:
        """Does this streamed chunk end the stream? Runs on every chunk relayed: a byte scan, no parsing.

        Markers must be safe from false positives: inside a JSON string, generated text has its
        quotes escaped.
        """

    @abstractmethod
    def assemble(self, events: list[Json]) -> Json:
        """Rebuild a stream's non-streamed twin from its events' JSON objects (`parse_events`)."""

    def extract(self, response: Any) -> Extract:
        """The record's token-level fields of a (possibly assembled) response; none of what is not an object."""
        return self._extract(response) if isinstance(response, dict) else Extract()

    @abstractmethod
    def _extract(self, response: Json) -> Extract: ...

    @abstractmethod
    def tail(self) -> TailAssembly:
        """A fresh assembly for a `StreamTail`, keeping only what `extract` reads of each event."""


def loads(data: bytes | str) -> Any:
    """The JSON value of `data`, or None when it is not JSON. Bytes that are not UTF-8 are read as
    their text with U+FFFD for each bad byte, as a client decoding the stream would see them."""
    if isinstance(data, bytes):
        try:
            return orjson.loads(data)  # the common case; orjson refuses all that is not UTF-8
        except orjson.JSONDecodeError:
            data = data.decode("utf-8", "replace")
    try:
        return loads_exact(data)  # lone surrogate escapes too: a model can emit them
    except ExactJsonError:
        return None


def parse_events(data: Iterable[bytes]) -> list[Json]:
    """The JSON objects of a stream's `data:` payloads (`proxy.sse`), in order; `[DONE]` and
    anything else that is not a JSON object are skipped."""
    payloads = [e for e in data if e != b"[DONE]"]
    try:
        events = [orjson.loads(e) for e in payloads]  # every event plain JSON: the common case, in one pass
    except orjson.JSONDecodeError:
        events = [loads(e) for e in payloads]
    return [event for event in events if isinstance(event, dict)]


def usage_of(prompt_ids: Any, token_ids: Any) -> Json | None:
    """Usage counted from the token IDs: streams carry usage only when the client asked for it."""
    if not isinstance(prompt_ids, list) or not isinstance(token_ids, list):
        return None
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
        "total_tokens": len(prompt_ids) + len(token_ids),
    }


class KeptEvents:
    """A tail for formats whose token fields sit in a few events: those are kept (as `keep` makes
    them, None to drop one) and assembled when asked."""

    def __init__(self, keep: Callable[[Json], Json | None], assemble: Callable[[list[Json]], Json]) -> None:
        self._keep = keep
        self._assemble = assemble
        self._events: list[Json] = []

    def add(self, event: Json) -> None:
        kept = self._keep(event)
        if kept is not None:
            self._events.append(kept)

    def result(self) -> Json:
        return self._assemble(self._events)
