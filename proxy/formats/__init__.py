"""The wire formats of the recorded APIs: all the proxy knows of each, one module per API.

    chat.py          /v1/chat/completions     (openai.py: what chat and completions share)
    completions.py   /v1/completions
    messages.py      /v1/messages (Anthropic)
    responses.py     /v1/responses

A `Format` says what to add to a recorded call's request so the replica returns exact
tokens, which request fields ask for several choices, when a stream is done, how a
stream is rebuilt into its non-streamed twin (so a record looks the same whichever way
the client asked), and where the record's token fields (token IDs, logprobs, finish
reason, usage, error) sit in a response. A stream longer than its record keeps is read
past the cut by a `StreamTail` (`tail.py`). The relay looks its call's format up once
(`for_route`); nothing here runs on the relay's critical path but `is_terminal`.

Adding an API: a module with its `Format`, and an entry in `_FORMATS`.
"""

from __future__ import annotations

from proxy.formats.base import Extract, Format, Json, parse_events
from proxy.formats.chat import Chat
from proxy.formats.completions import Completions
from proxy.formats.messages import Messages
from proxy.formats.responses import Responses
from proxy.formats.tail import StreamTail

__all__ = ["FORMATS", "Extract", "Format", "StreamTail", "for_route", "parse_events"]

FORMATS: dict[str, Format] = {f.route: f for f in (Chat(), Completions(), Messages(), Responses())}


class _Unrecorded(Completions):
    """Any other route (`/v1/embeddings`, relayed untracked): read the way OpenAI's responses are
    (top-level `usage` and `error`), asked for nothing but token IDs, never refused for its
    choices, and ended by whichever API's end marker its stream carries."""

    route = "other"
    choice_fields = ()

    def _ask_for_logprobs(self, body: Json) -> None:
        pass

    @staticmethod
    def is_terminal(chunk: bytes) -> bool:
        return any(f.is_terminal(chunk) for f in FORMATS.values())


_UNRECORDED = _Unrecorded()


def for_route(route: str) -> Format:
    """The format of a route (`shared.types.Route`'s values); any other route's reads as OpenAI's."""
    return FORMATS.get(route, _UNRECORDED)
