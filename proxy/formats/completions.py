"""OpenAI's (legacy) completions (`/v1/completions`) as the proxy records it.

A choice's `text` streams in pieces, its logprobs as parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`); vLLM adds `token_ids` and the prompt's
`prompt_token_ids` to each choice on request (`return_token_ids`). `best_of` asks for
several choices as `n` does. Logprobs the proxy asks for on its own come as token IDs only, as
on chat (`proxy.formats.openai.mark_ids_only`); their `text_offset`s then count the placeholders.
"""

from __future__ import annotations

from proxy.formats.base import Json
from proxy.formats.openai import OpenAIFormat, Pieces, append_text, joined_text, mark_ids_only
from shared.types import Route

__all__ = ["Completions"]

_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class Completions(OpenAIFormat):
    route: str = Route.COMPLETIONS
    object = "text_completion"
    choice_fields: tuple[str, ...] = ("n", "best_of")

    def ask_for_tokens(self, body: Json, *, logprobs: bool) -> None:
        if body.get("echo") and not body.get("return_token_ids"):
            # vLLM answers an echoed prompt's text as "" once asked for token IDs (it sends them apart):
            # the agent's answer comes first, so such a call (scoring, not sampling) is relayed as asked
            # and recorded without token IDs, which the trainer skips.
            return
        super().ask_for_tokens(body, logprobs=logprobs)

    def _ask_for_logprobs(self, body: Json) -> None:
        if body.get("logprobs") is None:
            body["logprobs"] = 0  # the sampled token's logprob, no alternatives
            mark_ids_only(body)

    def empty_choice(self, index: int) -> Json:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None, "token_ids": []}

    def merge_content(self, choice: Json, part: Json) -> None:
        append_text(choice, "text", part.get("text"))
        logprobs = part.get("logprobs")
        if logprobs and type(logprobs) is dict:
            merged = choice["logprobs"] or {key: [] for key in _LOGPROB_LISTS}
            for key in _LOGPROB_LISTS:
                merged[key].extend(logprobs.get(key) or [])
            choice["logprobs"] = merged

    def joined(self, choice: Json) -> Json:
        return {**choice, "text": joined_text(choice["text"])} if type(choice["text"]) is Pieces else choice

    def _logprobs(self, logprobs: Json) -> list[float | None] | None:
        values = logprobs.get("token_logprobs")
        return list(values) if isinstance(values, list) else None

    def token_logprobs(self, logprobs: Json) -> Json | None:
        return {"token_logprobs": logprobs.get("token_logprobs")}
