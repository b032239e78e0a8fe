"""Trajectory building: merged sequences reproduce every call exactly; drops have reasons."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.records import CallRow
from trainer.trajectory import BuildLimits, DropReason, Triplet, build_triplets

BREAK_BASE = 10_000  # fresh prompts start above every token a continued prompt can hold


def call(seq: int, prompt: list[int], completion: list[int], **kw: Any) -> CallRow:
    values: dict[str, Any] = {
        "call_id": f"c{seq}",
        "seq": seq,
        "route": "chat/completions",
        "status": "ok",
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [-(seq + 1) - i / 100 for i in range(len(completion))],
        "finish_reason": "stop",
        "policy_version": 3,
        **kw,
    }
    return CallRow(**values)


tokens = st.lists(st.integers(0, 500), min_size=0, max_size=6)
turn = st.tuples(
    tokens,  # glue: tool result / user turn / template tokens between calls
    st.lists(st.integers(0, 500), min_size=1, max_size=6),  # completion
    st.booleans(),  # breaks the prefix (context rewritten): new triplet
    st.sampled_from(["ok", "ok", "ok", "upstream_error", "client_disconnected"]),
)


def make_calls(first_prompt: list[int], turns: list[tuple[list[int], list[int], bool, str]]) -> list[CallRow]:
    calls, acc = [], list(first_prompt)
    for seq, (glue, completion, is_break, status) in enumerate(turns):
        prompt = [BREAK_BASE + seq, *glue] if is_break else [*acc, *glue]
        calls.append(call(seq, prompt, completion, status=status))
        if status == "ok":
            acc = [*prompt, *completion]
    return calls


def check_invariants(calls: list[CallRow], triplets: list[Triplet], limits: BuildLimits) -> None:
    by_id = {c.call_id: c for c in calls}
    seen: list[str] = []
    for t in triplets:
        assert len(t.response_ids) == len(t.response_mask) == len(t.response_logprobs or t.response_ids)
        assert len(t.response_ids) <= limits.max_response_len
        full = t.prompt_ids + t.response_ids
        generated = set()
        for call_id in t.call_ids:
            c = by_id[call_id]
            p, comp = c.prompt_token_ids or [], c.completion_token_ids or []
            # the merged sequence reproduces this call's prompt + completion exactly
            assert full[: len(p) + len(comp)] == p + comp
            span = range(len(p) - len(t.prompt_ids), len(p) - len(t.prompt_ids) + len(comp))
            generated.update(span)
            for k, pos in enumerate(span):
                assert t.response_logprobs is not None
                assert t.response_logprobs[pos] == c.completion_logprobs[k]  # type: ignore[index]
        # the mask is 1 on exactly the generated tokens
        assert {i for i, m in enumerate(t.response_mask) if m == 1} == generated
        assert all(t.response_logprobs[i] == 0.0 for i in range(len(t.response_mask)) if i not in generated)  # type: ignore[index]
        assert t.seqs == sorted(t.seqs)
        seen += t.call_ids
    # triplets come in call order and hold each call at most once
    assert seen == [c.call_id for c in calls if c.call_id in set(seen)]


@settings(max_examples=300, deadline=None)
@given(first=st.lists(st.integers(0, 500), min_size=1, max_size=8), turns=st.lists(turn, min_size=1, max_size=8))
def test_merge_reproduces_every_call(first: list[int], turns: list[Any]) -> None:
    calls = make_calls(first, turns)
    limits = BuildLimits(max_prompt_len=10_000, max_response_len=10_000)
    triplets, drops = build_triplets(calls, limits)
    check_invariants(calls, triplets, limits)
    ok = [c for c in calls if c.status == "ok"]
    # every call is in exactly one triplet or dropped with a reason
    assert sorted(c for t in triplets for c in t.call_ids) + sorted(d.call_id for d in drops) == sorted(
        [c.call_id for c in ok]
    ) + sorted(c.call_id for c in calls if c.status != "ok")
    assert all(d.reason == DropReason.NOT_OK for d in drops)
    # a new triplet starts exactly at the first kept call and at each break among kept calls
    breaks = {f"c{i}" for i, (_, _, is_break, _) in enumerate(turns) if is_break}
    starts = [c.call_id for i, c in enumerate(ok) if i == 0 or c.call_id in breaks]
    assert [t.call_ids[0] for t in triplets] == starts


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(st.integers(0, 500), min_size=1, max_size=4),
    turns=st.lists(turn, min_size=1, max_size=8),
    max_response=st.integers(1, 12),
)
def test_response_limit_splits_instead_of_dropping(first: list[int], turns: list[Any], max_response: int) -> None:
    calls = make_calls(first, turns)
    limits = BuildLimits(max_prompt_len=10_000, max_response_len=max_response)
    triplets, drops = build_triplets(calls, limits)
    check_invariants(calls, triplets, limits)
    for d in drops:
        c = next(c for c in calls if c.call_id == d.call_id)
        if d.reason == DropReason.RESPONSE_TOO_LONG:
            assert len(c.completion_token_ids or []) > max_response
        else:
            assert d.reason == DropReason.NOT_OK


def test_merged_example_by_hand() -> None:
    calls = [
        call(0, [1, 2, 3], [4, 5]),
        call(1, [1, 2, 3, 4, 5, 6, 7], [8]),  # tool result 6, 7 between
        call(2, [9, 9], [10]),  # context rewritten: new triplet
    ]
    (a, b), drops = build_triplets(calls)
    assert not drops
    assert a.prompt_ids == [1, 2, 3]
    assert a.response_ids == [4, 5, 6, 7, 8]
    assert a.response_mask == [1, 1, 0, 0, 1]
    assert a.response_logprobs == [-1.0, -1.01, 0.0, 0.0, -2.0]
    assert a.call_ids == ["c0", "c1"] and a.policy_version == 3
    assert b.prompt_ids == [9, 9] and b.response_ids == [10] and b.response_mask == [1]


def test_failed_call_between_does_not_break_the_sequence() -> None:
    calls = [
        call(0, [1], [2]),
        call(1, [1, 2, 3], [], status="failed", prompt_token_ids=None, completion_token_ids=None),
        call(2, [1, 2, 3], [4]),  # the agent retried
    ]
    (t,), drops = build_triplets(calls)
    assert t.response_ids == [2, 3, 4] and t.response_mask == [1, 0, 1]
    assert [(d.call_id, d.reason) for d in drops] == [("c1", DropReason.NOT_OK)]


def test_each_drop_reason() -> None:
    limits = BuildLimits(max_prompt_len=4, max_response_len=3, drop_truncated=True)
    calls = [
        call(0, [1, 2], [3], status="client_disconnected"),
        call(1, [1, 2], [3], prompt_token_ids=None, completion_token_ids=None),
        call(2, [1, 2], []),
        call(3, [1, 2], [3, 4], completion_logprobs=[-1.0]),
        call(4, [1, 2, 3, 4, 5], [6]),
        call(5, [1, 2], [3, 4, 5, 6]),
        call(6, [1, 2], [3], finish_reason="length"),
        call(7, [7], [8]),
    ]
    triplets, drops = build_triplets(calls, limits)
    assert [t.call_ids for t in triplets] == [["c7"]]
    assert [d.reason for d in drops] == [
        DropReason.NOT_OK,
        DropReason.NO_TOKENS,
        DropReason.EMPTY_COMPLETION,
        DropReason.LOGPROBS_MISMATCH,
        DropReason.PROMPT_TOO_LONG,
        DropReason.RESPONSE_TOO_LONG,
        DropReason.TRUNCATED,
    ]
    assert all(d.detail is None or isinstance(d.detail, str) for d in drops)


def test_a_cut_response_is_used_only_with_all_its_tokens() -> None:
    # `response_truncated`: the stored body was cut at proxy.recorder.max_body_bytes. A record
    # with token IDs and a finish reason has them all (the proxy reads them from the whole
    # answer; an older proxy's kept prefix reached the end); anything else may stop at the cut.
    calls = [
        call(0, [1], [2, 3], response_truncated=True),  # token fields of the whole answer: used
        call(1, [9], [], prompt_token_ids=None, completion_token_ids=None, completion_logprobs=None,
             finish_reason=None, response_truncated=True),  # an older proxy's cut whole response
        call(2, [9], [10], finish_reason=None, response_truncated=True),  # an older proxy's cut stream
        call(3, [1, 2, 3, 4], [5], finish_reason=None),  # not cut: no finish reason is no reason to drop
    ]
    triplets, drops = build_triplets(calls)
    assert [t.call_ids for t in triplets] == [["c0", "c3"]]
    assert [(d.call_id, d.reason) for d in drops] == [("c1", DropReason.RESPONSE_TRUNCATED),
                                                      ("c2", DropReason.RESPONSE_TRUNCATED)]
    assert "without token IDs" in (drops[0].detail or "") and "before its end" in (drops[1].detail or "")


def test_truncated_kept_unless_configured() -> None:
    triplets, drops = build_triplets([call(0, [1], [2], finish_reason="length")])
    assert len(triplets) == 1 and not drops


def test_missing_logprobs_make_the_triplet_logprobs_unknown() -> None:
    calls = [call(0, [1], [2]), call(1, [1, 2, 3], [4], completion_logprobs=None)]
    (t,), _ = build_triplets(calls)
    assert t.response_logprobs is None and t.response_mask == [1, 0, 1]
    (t,), _ = build_triplets([call(0, [1], [2, 3], completion_logprobs=[-0.5, None])])
    assert t.response_logprobs is None


def chat_call(seq: int, messages: list[dict[str, Any]], reply: str, tokenizer: Any, *, exact: bool) -> CallRow:
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    completion = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
    return CallRow(
        call_id=f"c{seq}",
        seq=seq,
        route="chat/completions",
        status="ok",
        prompt_token_ids=prompt if exact else None,
        completion_token_ids=completion if exact else None,
        completion_logprobs=[-0.5] * len(completion) if exact else None,
        finish_reason="stop",
        request={"messages": messages},
        response={"choices": [{"message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]},
    )


def test_chat_template_turns_merge_with_the_glue_masked(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    first = [{"role": "user", "content": "What is 7 + 5?"}]
    second = [*first, {"role": "assistant", "content": "The answer is 12."}, {"role": "user", "content": "Thank you."}]
    calls = [
        chat_call(0, first, "The answer is 12.", tok, exact=True),
        chat_call(1, second, "Hello!", tok, exact=True),
    ]
    (t,), drops = build_triplets(calls)
    assert not drops
    glue = [tid for tid, m in zip(t.response_ids, t.response_mask, strict=True) if m == 0]
    assert tok.decode(glue) == "\n<|im_start|>user\nThank you.<|im_end|>\n<|im_start|>assistant\n"
    generated = [tid for tid, m in zip(t.response_ids, t.response_mask, strict=True) if m == 1]
    assert tok.decode(generated) == "The answer is 12.<|im_end|>Hello!<|im_end|>"


def test_calls_without_tokens_are_retokenised_and_flagged(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you?"}]
    hosted = chat_call(0, messages, "I am fine, thank you.", tok, exact=False)
    exact = chat_call(0, messages, "I am fine, thank you.", tok, exact=True)

    (t,), drops = build_triplets([hosted], tokenizer=tok)
    assert not drops and t.retokenized and t.response_logprobs is None
    # the reconstruction equals what the replica would have returned for this template
    assert t.prompt_ids == exact.prompt_token_ids
    assert t.response_ids == exact.completion_token_ids
    assert t.response_mask == [1] * len(t.response_ids)

    _, drops = build_triplets([hosted])
    assert [d.reason for d in drops] == [DropReason.NO_TOKENS]


def test_retokenised_completions_route(tiny_tokenizer: Any) -> None:
    c = CallRow(
        call_id="c0", seq=0, route="completions", status="ok", prompt_token_ids=None,
        completion_token_ids=None, completion_logprobs=None,
        request={"prompt": "The cat reads"}, response={"choices": [{"text": " a book today."}]},
    )
    (t,), _ = build_triplets([c], tokenizer=tiny_tokenizer)
    assert t.retokenized
    assert tiny_tokenizer.decode(t.prompt_ids) == "The cat reads"
    assert tiny_tokenizer.decode(t.response_ids) == " a book today."


def test_attempt_with_an_interrupted_call_gives_no_triplet() -> None:
    # seq 1 was cut by a proxy crash: seq 2's prompt still extends seq 0, but the trajectory
    # misses a turn's answer, so nothing of the attempt is learned from, each call with its reason.
    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2, 3, 4], [], status="interrupted", prompt_token_ids=None, completion_token_ids=None),
        call(2, [1, 2, 3, 4, 5], [6]),
    ]
    triplets, drops = build_triplets(calls)
    assert triplets == []
    assert [(d.call_id, d.reason) for d in drops] == [(f"c{i}", DropReason.INCOMPLETE_ATTEMPT) for i in range(3)]
    assert drops[0].detail == "interrupted call(s) at seq [1]"
