"""What OpenAI's chat and completions formats share: chunks of `choices` merged per index.

A stream is rebuilt into the non-streamed shape (content, token IDs and logprobs
concatenated per choice) by an `Assembly` that takes the chunks one by one; what
differs between the two APIs (a choice's empty shape, its content and logprobs) is
the subclass's (`proxy.formats.chat`, `proxy.formats.completions`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from proxy.formats.base import Extract, Format, Json, usage_of

__all__ = ["IDS_ONLY_XARG", "Assembly", "OpenAIFormat", "Pieces", "TokenAssembly", "append_text", "joined_text",
           "mark_ids_only"]

# The plugin's `vllm_xargs` key (rolltap_vllm.logprobs_wire.IDS_ONLY_XARG; a test holds the two together).
IDS_ONLY_XARG = "rolltap_ids_only"


def mark_ids_only(body: Json) -> None:
    """Logprobs the proxy asks for on its own (the agent asked for none) as token IDs: each position's
    `token` becomes `token_id:N`, and the mark has the replica's plugin skip decoding the call's tokens
    (`rolltap_vllm.logprobs_wire`). Not for a call with the agent's own prompt logprobs: vLLM decodes
    prompt and sampled logprobs in one processor, and those the agent wants as text."""
    if body.get("prompt_logprobs") is not None:
        return
    body["return_tokens_as_token_ids"] = True  # only ever changes the logprobs' `token` strings
    xargs = body.get("vllm_xargs")
    if xargs is None or type(xargs) is dict:  # anything else is the client's own mistake: vLLM says so
        body["vllm_xargs"] = {**(xargs or {}), IDS_ONLY_XARG: 1}


class OpenAIFormat(Format):
    """An OpenAI-shaped API: vLLM's `return_token_ids`, `choices`, `data: [DONE]` at the end."""

    object: str  # the non-streamed response's `object`
    choice_fields: tuple[str, ...] = ("n",)

    def ask_for_tokens(self, body: Json, *, logprobs: bool) -> None:
        body["return_token_ids"] = True
        if logprobs:
            self._ask_for_logprobs(body)

    @staticmethod
    def is_terminal(chunk: bytes) -> bool:
        return chunk.rstrip().endswith(b"data: [DONE]")  # only as the whole final data line

    def assemble(self, events: list[Json]) -> Json:
        assembly = Assembly(self)
        for chunk in events:
            assembly.add(chunk)
        return assembly.result()

    def _extract(self, response: Json) -> Extract:
        choices = response.get("choices") or []
        first: Json = choices[0] if choices and isinstance(choices[0], dict) else {}
        prompt_ids = response.get("prompt_token_ids")
        if prompt_ids is None:
            prompt_ids = first.get("prompt_token_ids")  # completions put it on the choice
        token_ids = first.get("token_ids")
        logprobs = first.get("logprobs")
        return Extract(
            prompt_token_ids=prompt_ids,
            completion_token_ids=token_ids,
            completion_logprobs=self._logprobs(logprobs) if isinstance(logprobs, dict) else None,
            finish_reason=first.get("finish_reason"),
            usage=response.get("usage") or usage_of(prompt_ids, token_ids),
            error=response.get("error"),
        )

    def tail(self) -> TokenAssembly:
        return TokenAssembly(self)

    @abstractmethod
    def _ask_for_logprobs(self, body: Json) -> None:
        """Ask for the sampled tokens' logprobs, unless the client asked for its own."""

    @abstractmethod
    def empty_choice(self, index: int) -> Json:
        """A choice before its first chunk, with the non-streamed choice's keys in its order."""

    @abstractmethod
    def merge_content(self, choice: Json, part: Json) -> None:
        """Merge a chunk's choice `part` into `choice`: its content and logprobs (the rest is shared);
        streamed text goes in as `Pieces` (`append_text`)."""

    @abstractmethod
    def joined(self, choice: Json) -> Json:
        """`choice` with its `Pieces` joined into text (itself when it has none)."""

    @abstractmethod
    def _logprobs(self, logprobs: Json) -> list[float | None] | None:
        """The sampled tokens' logprobs of a choice's `logprobs` object."""

    @abstractmethod
    def token_logprobs(self, logprobs: Json) -> Json | None:
        """What of a chunk choice's `logprobs` `_logprobs` reads (None: nothing), in the chunk's shape."""

    def token_part(self, chunk: Json) -> Json:
        """What of a chunk `extract` reads, in the chunk's shape."""
        part: Json = {key: chunk[key] for key in ("prompt_token_ids", "usage", "error") if key in chunk}
        if "choices" not in chunk:
            return part
        part["choices"] = []
        choices = chunk["choices"]
        if type(choices) is not list:
            return part  # no choice in it, as `Assembly.add` reads it
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            kept = {key: choice[key] for key in ("index", "token_ids", "prompt_token_ids", "finish_reason",
                                                 "stop_reason") if key in choice}
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                token_logprobs = self.token_logprobs(logprobs)
                if token_logprobs is not None:
                    kept["logprobs"] = token_logprobs
            part["choices"].append(kept)
        return part


class Pieces(list[str]):
    """A text streamed in pieces (content, tool call arguments), joined once the response is taken:
    concatenating piece by piece copies the text so far for every token, quadratic in the answer."""


def joined_text(text: Any) -> Any:
    return "".join(text) if type(text) is Pieces else text


def append_text(target: Json, key: str, piece: Any) -> None:
    """Add a streamed `piece` of text to `target[key]` (pieces that are not text are not text: skipped)."""
    if not piece or type(piece) is not str:
        return
    text = target.get(key)
    if type(text) is Pieces:
        text.append(piece)
    else:
        target[key] = Pieces((text, piece) if text else (piece,))


class Assembly:
    """A chat or completions stream rebuilt chunk by chunk into its non-streamed shape."""

    def __init__(self, format: OpenAIFormat) -> None:
        self._format = format
        self._out: Json = {}
        self._choices: dict[int, Json] = {}

    def add(self, chunk: Json) -> None:
        out = self._out
        if "error" in chunk and "choices" not in chunk:
            out["error"] = chunk["error"]
            return
        for key in _HEAD_KEYS:  # the response's own, from the first chunk that has each
            if key in chunk and key not in out:
                out[key] = chunk[key]
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids is not None:
            out["prompt_token_ids"] = prompt_ids
        usage = chunk.get("usage")
        if usage:
            out["usage"] = usage
        parts = chunk.get("choices")
        if not parts or type(parts) is not list:
            return
        format, choices = self._format, self._choices
        for part in parts:
            if type(part) is not dict:
                continue  # not a choice: nothing of it can be merged
            index = part.get("index", 0)
            if type(index) is not int:
                index = 0
            choice = choices.get(index)
            if choice is None:
                choice = choices[index] = format.empty_choice(index)
            token_ids = part.get("token_ids")
            if token_ids and type(token_ids) is list:
                choice["token_ids"].extend(token_ids)
            for key in _CHOICE_KEYS:  # a later chunk's value replaces
                if part.get(key) is not None:
                    choice[key] = part[key]
            format.merge_content(choice, part)

    def result(self) -> Json:
        """The response so far, its texts joined; its token ID lists are the assembly's own (later chunks
        extend them)."""
        out = dict(self._out)
        out["object"] = self._format.object
        out["choices"] = [self._format.joined(self._choices[i]) for i in sorted(self._choices)]
        return out


_HEAD_KEYS = ("id", "created", "model", "system_fingerprint")
_CHOICE_KEYS = ("prompt_token_ids", "finish_reason", "stop_reason")


class TokenAssembly(Assembly):
    """An `Assembly` of only what `extract` reads of each chunk (a `StreamTail`'s): no text, no alternatives."""

    def add(self, chunk: Json) -> None:
        super().add(self._format.token_part(chunk))
