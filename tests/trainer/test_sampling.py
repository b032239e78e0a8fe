"""Sampling parameters of recorded calls: temperature per triplet, unreproducible sampling, hosted and stale calls."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.sampling import call_sampling
from trainer.trajectory import BuildLimits, DropReason, build_triplets
from trainer.records import CallRow


def call(seq: int, prompt: list[int], request: dict[str, Any] | None = None, *, replica: str | None = "http://r",
         version: int | None = 3) -> CallRow:
    return CallRow(
        call_id=f"c{seq}", seq=seq, route="chat/completions", status="ok", prompt_token_ids=prompt,
        completion_token_ids=[50 + seq, 60 + seq], completion_logprobs=[-0.1, -0.2], policy_version=version,
        request={"model": "tiny", "messages": [], **(request or {})}, replica=replica,
    )


@pytest.mark.parametrize(
    ("request_body", "temperature", "reproducible"),
    [
        ({}, 1.0, True),  # vLLM's default
        ({"temperature": 0.7}, 0.7, True),
        ({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0}, 0.7, True),  # the "off" values
        ({"temperature": 0.7, "top_p": 0.9}, 0.7, False),
        ({"top_k": 20}, 1.0, False),
        ({"min_p": 0.05}, 1.0, False),
        ({"temperature": 0}, 0.0, False),  # greedy
        ({"temperature": None}, 1.0, True),
    ],
)
def test_call_sampling(request_body: dict[str, Any], temperature: float, reproducible: bool) -> None:
    s = call_sampling(request_body)
    assert (s.temperature, s.is_reproducible) == (temperature, reproducible)


def test_each_triplet_carries_its_temperature_and_temperatures_never_merge() -> None:
    first = call(0, [1, 2], {"temperature": 0.7})
    extends = call(1, [1, 2, 50, 60, 9], {"temperature": 0.7})
    other_t = call(2, [1, 2, 50, 60, 9, 51, 61, 9], {"temperature": 1.0})  # extends, but sampled hotter
    triplets, drops = build_triplets([first, extends, other_t])
    assert not drops
    assert [(t.seqs, t.temperature) for t in triplets] == [([0, 1], 0.7), ([2], 1.0)]


def test_unreproducible_sampling_dropped_with_a_reason_or_kept_by_setting() -> None:
    calls = [call(0, [1], {"top_p": 0.9}), call(1, [2], {"temperature": 0.0}), call(2, [3])]
    triplets, drops = build_triplets(calls)
    assert [t.seqs for t in triplets] == [[2]]
    assert [(d.seq, d.reason) for d in drops] == [(0, DropReason.SAMPLING_NOT_REPRODUCIBLE)] * 1 + [
        (1, DropReason.SAMPLING_NOT_REPRODUCIBLE)]
    assert "top_p 0.9" in (drops[0].detail or "") and "greedy" in (drops[1].detail or "")
    kept, _ = build_triplets(calls[:1], BuildLimits(unreproducible_sampling="keep"))
    assert [t.seqs for t in kept] == [[0]]


def test_hosted_calls_are_left_out_unless_included() -> None:
    calls = [call(0, [1], replica="litellm:gpt-4o-mini"), call(1, [2])]
    triplets, drops = build_triplets(calls)
    assert [t.seqs for t in triplets] == [[1]]
    assert [(d.seq, d.reason, d.detail) for d in drops] == [(0, DropReason.HOSTED, "answered by gpt-4o-mini, not the policy")]
    both, none = build_triplets(calls, BuildLimits(include_hosted=True))
    assert [t.seqs for t in both] == [[0], [1]] and not none


def test_calls_beyond_the_off_policy_bound_are_dropped_as_too_stale() -> None:
    calls = [call(0, [1], version=1), call(1, [2], version=None), call(2, [3], version=4)]
    triplets, drops = build_triplets(calls, BuildLimits(min_policy_version=2))
    assert [t.seqs for t in triplets] == [[2]]
    assert [(d.seq, d.reason) for d in drops] == [(0, DropReason.TOO_STALE), (1, DropReason.TOO_STALE)]
