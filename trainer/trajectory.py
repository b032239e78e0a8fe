"""Token-exact trajectories: an attempt's calls turned into (prompt, response, mask, logprobs) triplets.

This module owns the merge rule and the drop reasons. Calls are taken in `seq` order;
a call whose prompt token IDs start with the current triplet's prompt + response
extends that triplet: the tokens between (tool results, user turns, template glue)
join the response with `response_mask` 0, the new completion with mask 1. Anything else
starts a new triplet. Token IDs come from the replica; only calls recorded without
them (hosted providers, kept with `include_hosted`; left out as `hosted` by default) are
re-tokenised, and those triplets say so (`retokenized`). Calls at different sampling
temperatures never merge: a row is recomputed at one temperature.

Pure: no database, no torch. Drops are returned, the caller stores them
(`trainer.drops.record_drops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from trainer import messages as msgs
from trainer.records import CallRow
from trainer.sampling import DEFAULT_TEMPERATURE, call_sampling

__all__ = ["BuildLimits", "Drop", "DropReason", "Tokenizer", "Triplet", "build_triplets", "retokenize"]


class DropReason(StrEnum):
    """Why a call is in no triplet. Stored in `call_drops.reason`."""

    NOT_OK = "not_ok"  # the call failed, was cut by a client disconnect, or was invalid
    NO_TOKENS = "no_tokens"  # no token IDs recorded and none could be re-tokenised
    EMPTY_COMPLETION = "empty_completion"  # nothing generated: nothing to learn
    LOGPROBS_MISMATCH = "logprobs_mismatch"  # logprobs not one per completion token: a broken record
    PROMPT_TOO_LONG = "prompt_too_long"  # a new triplet's prompt over `max_prompt_len`
    RESPONSE_TOO_LONG = "response_too_long"  # one completion over `max_response_len`
    TRUNCATED = "truncated"  # finish_reason "length" and `drop_truncated` is on
    # The stored response was cut (`proxy.recorder.max_body_bytes`) and its token IDs may stop at the cut.
    RESPONSE_TRUNCATED = "response_truncated"
    # A call of the attempt was cut by a proxy crash or shutdown (`interrupted`): the trajectory
    # has a hole, so none of the attempt's calls is used.
    INCOMPLETE_ATTEMPT = "incomplete_attempt"
    HOSTED = "hosted"  # a hosted model answered, not the policy (kept unless `include_hosted`)
    SAMPLING_NOT_REPRODUCIBLE = "sampling_not_reproducible"  # top_p/top_k/min_p/greedy: see trainer.sampling
    TOO_STALE = "too_stale"  # sampled by a policy older than `off_policy_max_lag` allows


class Tokenizer(Protocol):
    """What re-tokenising needs from a Hugging Face tokenizer."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class BuildLimits:
    """The limits a triplet must fit (`TrainerSettings` fields of the same names).

    `min_policy_version`: calls sampled by an older policy are dropped (`too_stale`); None keeps all.
    """

    max_prompt_len: int = 4096
    max_response_len: int = 8192
    drop_truncated: bool = False
    include_hosted: bool = False
    unreproducible_sampling: str = "drop"
    min_policy_version: int | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """A call left out, with its reason."""

    call_id: str
    rollout_id: str
    attempt_id: str
    seq: int
    reason: DropReason
    detail: str | None = None


@dataclass(slots=True)
class Triplet:
    """One training sequence.

    `response_ids`, `response_mask` and `response_logprobs` have one entry per response
    token. Mask 1 marks tokens the model generated, 0 the tokens between calls.
    `turn_ends[k]` is where call k's completion ends in the response (exclusive): a turn is
    one call, the tokens from the previous turn's end up to its own (glue, then completion),
    so credit can be given per turn inside a merged row.
    `response_logprobs` holds the replica's logprob at generated tokens and 0.0 at masked
    ones; it is None when any merged call came without logprobs, or when re-tokenised.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    policy_version: int | None = None
    retokenized: bool = False
    temperature: float = DEFAULT_TEMPERATURE  # the sampling temperature of every call in it

    def extend(self, glue: Sequence[int], completion: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.response_ids.extend(glue)
        self.response_mask.extend([0] * len(glue))
        self.response_ids.extend(completion)
        self.response_mask.extend([1] * len(completion))
        self.turn_ends.append(len(self.response_ids))
        if self.response_logprobs is not None and logprobs is not None:
            self.response_logprobs.extend([0.0] * len(glue))
            self.response_logprobs.extend(float(x) for x in logprobs)
        else:
            self.response_logprobs = None


@dataclass(slots=True)
class _Tokens:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float] | None
    retokenized: bool


def retokenize(call: CallRow, tokenizer: Tokenizer) -> _Tokens | None:
    """Token IDs for a call recorded without them, from its request and response text.

    Chat routes: the prompt is the chat template over the request messages (with the
    generation prompt); the response is what the template adds for the reply, cut after
    its last end-of-sequence token (the template's trailing newline was not generated).
    When the template does not render the prompt as a prefix of the conversation, the
    reply text is encoded alone, plus EOS when the model stopped on its own.
    `completions`: the prompt text with the tokenizer's special tokens, the text without.
    Returns None when the record has nothing to re-tokenise.
    """
    if call.route == msgs.COMPLETIONS:
        prompt = msgs.prompt_text(call.request)
        text = msgs.reply_text(call.route, call.response)
        if prompt is None or text is None:
            return None
        prompt_ids = prompt if isinstance(prompt, list) else list(tokenizer.encode(prompt))
        return _Tokens(prompt_ids, list(tokenizer.encode(text, add_special_tokens=False)), None, True)
    messages = msgs.chat_messages(call.route, call.request)
    reply = msgs.reply_message(call.route, call.response)
    if messages is None or reply is None or not (reply.get("content") or reply.get("tool_calls")):
        return None
    tools = call.request.get("tools") if isinstance(call.request, dict) else None
    kwargs: dict[str, Any] = {"tokenize": False}
    if tools:
        kwargs["tools"] = tools
    # Render to text and encode once: `tokenize=True` returns different types across
    # transformers releases, and templates already contain their special tokens.
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    full_text = tokenizer.apply_chat_template([*messages, reply], add_generation_prompt=False, **kwargs)
    prompt_ids = list(tokenizer.encode(prompt_text, add_special_tokens=False))
    full_ids = list(tokenizer.encode(full_text, add_special_tokens=False))
    eos = tokenizer.eos_token_id
    if full_ids[: len(prompt_ids)] == prompt_ids and len(full_ids) > len(prompt_ids):
        completion = full_ids[len(prompt_ids) :]
        if eos is not None and eos in completion:
            last = len(completion) - 1 - completion[::-1].index(eos)
            completion = completion[: last + 1]
    else:
        text = msgs.reply_text(call.route, call.response)
        if text is None:
            return None
        completion = list(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None and call.finish_reason in ("stop", "end_turn"):
            completion.append(eos)
    return _Tokens(prompt_ids, completion, None, True)


def _logprobs(values: Sequence[float | None] | None) -> list[float] | None:
    # A token without a logprob (vLLM writes None for -inf) makes the call's logprobs unknown:
    # a made-up number would bias off-policy correction more than having none.
    if values is None or any(v is None for v in values):
        return None
    return [float(v) for v in values]  # type: ignore[arg-type]


def _tokens(call: CallRow, tokenizer: Tokenizer | None) -> _Tokens | str:
    """The call's tokens, or the detail of a `no_tokens` drop."""
    if call.prompt_token_ids is not None and call.completion_token_ids is not None:
        return _Tokens(
            [int(t) for t in call.prompt_token_ids],
            [int(t) for t in call.completion_token_ids],
            _logprobs(call.completion_logprobs),
            False,
        )
    if tokenizer is None:
        return "no token IDs recorded and no tokenizer given to re-tokenise (--model)"
    toks = retokenize(call, tokenizer)
    if toks is None:
        return f"no token IDs recorded and no text to re-tokenise on route {call.route!r}"
    return toks


HOSTED_PREFIX = "litellm:"  # how the proxy names a hosted model in `calls.replica`


def _precheck(call: CallRow, limits: BuildLimits) -> tuple[DropReason, str | None] | None:
    """Reasons to leave a call out that need no tokens."""
    if not limits.include_hosted and call.replica is not None and call.replica.startswith(HOSTED_PREFIX):
        return DropReason.HOSTED, f"answered by {call.replica.removeprefix(HOSTED_PREFIX)}, not the policy"
    if limits.min_policy_version is not None and (call.policy_version or 0) < limits.min_policy_version:
        return DropReason.TOO_STALE, f"policy version {call.policy_version or 0} < {limits.min_policy_version}"
    if limits.unreproducible_sampling == "drop":
        problem = call_sampling(call.request).problem
        if problem is not None:
            return DropReason.SAMPLING_NOT_REPRODUCIBLE, problem
    return None


def _cut_tokens(call: CallRow) -> str | None:
    """Why a call whose stored response was cut cannot be trusted to have all its tokens; None if it can.

    A proxy reads a cut response's token fields from the whole answer, finish reason included.
    Records cut by older proxies read them from the kept part only: a cut whole response has
    none, a cut stream those before the cut. What was kept is a prefix of what the replica
    sent, and a finish reason comes after the tokens it ends, so a cut record with token IDs
    and a finish reason has them all. Re-tokenising is no way out: the text is cut too.
    """
    if not call.response_truncated:
        return None
    if call.prompt_token_ids is None or call.completion_token_ids is None:
        return "response cut at proxy.recorder.max_body_bytes and recorded without token IDs"
    if call.finish_reason is None:
        return "response cut at proxy.recorder.max_body_bytes before its end: its token IDs may stop at the cut"
    return None


def _check(call: CallRow, toks: _Tokens, limits: BuildLimits) -> tuple[DropReason, str | None] | None:
    if not toks.completion:
        return DropReason.EMPTY_COMPLETION, None
    if toks.logprobs is not None and len(toks.logprobs) != len(toks.completion):
        return DropReason.LOGPROBS_MISMATCH, f"{len(toks.logprobs)} logprobs for {len(toks.completion)} tokens"
    if limits.drop_truncated and call.finish_reason == "length":
        return DropReason.TRUNCATED, None
    if len(toks.completion) > limits.max_response_len:
        return DropReason.RESPONSE_TOO_LONG, f"{len(toks.completion)} > {limits.max_response_len} tokens"
    return None


def _min_version(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def build_triplets(
    calls: Sequence[CallRow], limits: BuildLimits | None = None, tokenizer: Tokenizer | None = None
) -> tuple[list[Triplet], list[Drop]]:
    """Triplets of one attempt's calls, in order, and the calls left out with their reasons.

    Merging compares against the last kept call, so a failed call in between (a retry)
    does not break the sequence. A call that would push the response past
    `max_response_len` starts a new triplet rather than being dropped. Re-tokenised calls
    never merge: their tokens are a reconstruction, and a flagged triplet must stay one call.
    An attempt with an `interrupted` call (cut by a proxy crash) gives no triplet at all.
    """
    limits = limits or BuildLimits()
    triplets: list[Triplet] = []
    drops: list[Drop] = []
    current: Triplet | None = None
    # prompt + response of `current`, kept alongside so the prefix test is one slice compare
    current_full: list[int] = []

    def drop(call: CallRow, reason: DropReason, detail: str | None = None) -> None:
        drops.append(Drop(call.call_id, call.rollout_id, call.attempt_id, call.seq, reason, detail))

    cut = [c.seq for c in calls if c.status == "interrupted"]
    if cut:
        for call in sorted(calls, key=lambda c: c.seq):
            drop(call, DropReason.INCOMPLETE_ATTEMPT, f"interrupted call(s) at seq {cut}")
        return triplets, drops
    for call in sorted(calls, key=lambda c: c.seq):
        if call.status != "ok":
            drop(call, DropReason.NOT_OK, f"call status {call.status}")
            continue
        early = _precheck(call, limits)
        if early is not None:
            drop(call, *early)
            continue
        partial = _cut_tokens(call)
        if partial is not None:
            drop(call, DropReason.RESPONSE_TRUNCATED, partial)
            continue
        temperature = call_sampling(call.request).temperature
        toks = _tokens(call, tokenizer)
        if isinstance(toks, str):
            drop(call, DropReason.NO_TOKENS, toks)
            continue
        problem = _check(call, toks, limits)
        if problem is not None:
            drop(call, *problem)
            continue

        n = len(current_full)
        if (
            current is not None
            and not current.retokenized
            and not toks.retokenized
            and current.temperature == temperature  # one temperature per row: the update rescales by it
            and len(toks.prompt) >= n
            and toks.prompt[:n] == current_full
        ):
            glue = toks.prompt[n:]
            if len(current.response_ids) + len(glue) + len(toks.completion) <= limits.max_response_len:
                current.extend(glue, toks.completion, toks.logprobs)
                current.call_ids.append(call.call_id)
                current.seqs.append(call.seq)
                current.policy_version = _min_version(current.policy_version, call.policy_version)
                current_full.extend(glue)
                current_full.extend(toks.completion)
                continue

        if len(toks.prompt) > limits.max_prompt_len:
            # `current` stays open: a later call may still extend it.
            drop(call, DropReason.PROMPT_TOO_LONG, f"{len(toks.prompt)} > {limits.max_prompt_len} tokens")
            continue
        current = Triplet(
            prompt_ids=toks.prompt,
            response_logprobs=[],
            policy_version=call.policy_version,
            retokenized=toks.retokenized,
            temperature=temperature,
        )
        current.extend((), toks.completion, toks.logprobs)
        current.call_ids.append(call.call_id)
        current.seqs.append(call.seq)
        current_full = [*toks.prompt, *toks.completion]
        triplets.append(current)
    return triplets, drops
