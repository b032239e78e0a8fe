"""The read path on a real database: no stalls behind untrainable groups, dynamic sampling, exported advantages."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shared.settings import TrainerSettings
from tests.trainer.conftest import Db, tokens_call
from trainer.batch import build_batch
from trainer.data import read_samples
from trainer.drops import drop_counts
from trainer.export import export_triplets

GRPO_2 = 0.5 / (math.sqrt(0.5) + 1e-6)


def calls(n: int, base: int) -> list[dict[str, Any]]:
    """n calls whose prompts do not extend each other: n triplets."""
    return [tokens_call([base + 10 * i, base + 10 * i + 1], [base + 10 * i + 2, base + 10 * i + 3]) for i in range(n)]


def untrainable(db: Db, rollout: str) -> None:
    """A complete group whose every call failed: it yields no triplet."""
    for k in range(2):
        db.attempt(rollout, str(k), reward=float(k), finished_ago_s=100.0,
                   calls=[{**tokens_call([1], [2]), "status": "failed"}])


def test_untrainable_groups_at_the_head_are_consumed_and_read_past(db: Db) -> None:
    for i in range(3):
        untrainable(db, f"broken-{i}")
    db.attempt("good", "0", reward=1.0, calls=calls(1, 100), finished_ago_s=1.0)
    db.attempt("good", "1", reward=0.0, calls=calls(1, 200), finished_ago_s=1.0)
    data = read_samples(db.engine, TrainerSettings(group_size=2), max_groups=1)
    assert {s.group_id for s in data.samples} == {"good"}
    # The broken groups are part of what the step consumes, with why they gave nothing.
    assert [g.group_id for g in data.groups] == ["broken-0", "broken-1", "broken-2", "good"]
    assert data.skipped == {f"broken-{i}": "no_triplets" for i in range(3)}
    assert data.drop_counts() == {"not_ok": 6}
    assert len(data.attempt_pks) == 8


def test_dynamic_sampling_skips_tied_groups_and_keeps_the_step_size(db: Db) -> None:
    for i in range(2):
        for k in range(2):
            db.attempt(f"tied-{i}", str(k), reward=1.0, calls=calls(1, 100 * i + 10 * k), finished_ago_s=50.0 - i)
    for i in range(2):
        db.attempt(f"live-{i}", "0", reward=1.0, calls=calls(1, 500 + i), finished_ago_s=10.0)
        db.attempt(f"live-{i}", "1", reward=0.0, calls=calls(1, 600 + i), finished_ago_s=10.0)
    plain = read_samples(db.engine, TrainerSettings(group_size=2), max_groups=2)
    assert {s.group_id for s in plain.samples} == {"tied-0", "tied-1"} and plain.tied_groups == 2
    assert all(s.advantage == 0.0 for s in plain.samples)
    dynamic = read_samples(db.engine, TrainerSettings(group_size=2, dynamic_sampling=True), max_groups=2)
    assert {s.group_id for s in dynamic.samples} == {"live-0", "live-1"}
    assert dynamic.skipped == {"tied-0": "tied", "tied-1": "tied"} and len(dynamic.groups) == 4


@pytest.mark.parametrize("credit", ["identical", "last_only", "discounted", "per_call"])
def test_export_rows_carry_the_advantage(db: Db, tmp_path: Path, credit: str) -> None:
    db.attempt("task", "win", reward=1.0, calls=calls(3, 100))
    db.attempt("task", "lose", reward=0.0, calls=calls(1, 200))
    db.attempt("tie", "0", reward=0.5, calls=calls(3, 300))
    db.attempt("tie", "1", reward=0.5, calls=calls(1, 400))
    out = tmp_path / "triplets.jsonl"
    settings = TrainerSettings(group_size=2, credit=credit, gamma=0.9)  # type: ignore[arg-type]
    export_triplets(db.engine, settings, out, "jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["group_id"], r["attempt_id"]): r for r in rows}  # the attempt's last triplet
    win, lose = by[("task", "win")], by[("task", "lose")]
    assert win["attempt_advantage"] == pytest.approx(0.7071, abs=1e-4)
    assert win["attempt_advantage"] == -lose["attempt_advantage"]
    assert win["advantage"] == pytest.approx(GRPO_2, abs=1e-6)  # every rule gives the last triplet all of it
    assert lose["advantage"] == pytest.approx(-GRPO_2, abs=1e-6)
    assert (win["group_size"], win["group_mean"], win["group_std"]) == (2, 0.5, pytest.approx(math.sqrt(0.5)))
    ties = [r for r in rows if r["group_id"] == "tie"]
    assert len(ties) == 4 and all(r["advantage"] == 0.0 and r["attempt_advantage"] == 0.0 for r in ties)
    assert all(r["group_std"] == 0.0 for r in ties)
    assert sum(r["group_id"] == "task" for r in rows) == 4  # three triplets + one


def test_staleness_gate_off_reads_old_versions_and_bounds_them_per_call(db: Db) -> None:
    db.policy(5)
    for version, rollout in ((1, "old"), (4, "recent")):
        db.attempt(rollout, "0", reward=1.0, calls=calls(1, 10 * version), policy_version=version, finished_ago_s=9.0)
        db.attempt(rollout, "1", reward=0.0, calls=calls(1, 10 * version + 5), policy_version=version,
                   finished_ago_s=9.0)
    gated = read_samples(db.engine, TrainerSettings(group_size=2, max_staleness=1))
    assert [g.group_id for g in gated.groups] == ["recent"]
    open_ = read_samples(db.engine, TrainerSettings(group_size=2, max_staleness=1, staleness_gate=False))
    assert {s.group_id for s in open_.samples} == {"old", "recent"} and open_.current_version == 5
    bounded = read_samples(db.engine, TrainerSettings(group_size=2, staleness_gate=False, off_policy_max_lag=2))
    assert {s.group_id for s in bounded.samples} == {"recent"}
    assert bounded.skipped == {"old": "no_triplets"} and bounded.drop_counts() == {"too_stale": 2}


def test_a_cut_response_without_all_its_tokens_is_dropped_and_reported(db: Db) -> None:
    # As an older proxy recorded a stream cut at recorder.max_body_bytes: the tokens before the
    # cut, no finish reason. Dropped with its reason, stored in call_drops, counted by `stats`.
    cut = {**tokens_call([1, 2], [3, 4]), "response_truncated": True, "finish_reason": None}
    whole = {**tokens_call([1, 2], [3, 4]), "response_truncated": True}  # the token fields of all of it
    db.attempt("cut", "0", reward=1.0, calls=[cut], finished_ago_s=1.0)
    db.attempt("cut", "1", reward=0.0, calls=[whole], finished_ago_s=1.0)
    data = read_samples(db.engine, TrainerSettings(group_size=2))
    assert [(s.attempt_id, s.triplet.response_ids) for s in data.samples] == [("1", [3, 4])]
    assert data.drop_counts() == {"response_truncated": 1}
    assert data.drops[0].detail is not None and "max_body_bytes" in data.drops[0].detail
    with db.engine.connect() as conn:
        assert drop_counts(conn) == {"response_truncated": 1}


@pytest.mark.parametrize("credit", ["identical", "last_only", "discounted"])
def test_credit_is_per_turn_inside_a_merged_row(db: Db, tmp_path: Path, credit: str) -> None:
    # Two calls merged into one row (the second prompt extends the first prompt + completion,
    # with a tool answer between), then an unrelated call: three turns in two rows.
    merged = [tokens_call([1, 2], [3, 4]), tokens_call([1, 2, 3, 4, 90, 91], [5, 6, 7]), tokens_call([50], [51])]
    db.attempt("g", "win", reward=1.0, calls=merged)
    db.attempt("g", "lose", reward=0.0, calls=[tokens_call([60], [61])])
    settings = TrainerSettings(group_size=2, credit=credit, gamma=0.5)  # type: ignore[arg-type]
    out = tmp_path / "rows.jsonl"
    export_triplets(db.engine, settings, out, "jsonl")
    rows = {(r["attempt_id"], r["triplet_index"]): r for r in map(json.loads, out.read_text().splitlines())}
    row = rows[("win", 0)]
    assert row["response_ids"] == [3, 4, 90, 91, 5, 6, 7] and row["response_mask"] == [1, 1, 0, 0, 1, 1, 1]
    assert row["turn_ends"] == [2, 7] and rows[("win", 1)]["turn_ends"] == [1]
    a = GRPO_2
    expected = {"identical": [a, a, a], "last_only": [0.0, 0.0, a], "discounted": [0.25 * a, 0.5 * a, a]}[credit]
    got = [*row["turn_advantages"], *rows[("win", 1)]["turn_advantages"]]
    assert got == pytest.approx(expected, abs=1e-6)
    assert row["advantage"] == pytest.approx(expected[1], abs=1e-6)  # the row's last turn
    assert row["reward"] == row["turn_rewards"][-1] and len(row["turn_rewards"]) == 2

    # The batch puts each turn's share on its own generated tokens, nothing on the tool answer.
    samples = [s for s in read_samples(db.engine, settings).samples if s.attempt_id == "win" and s.index == 0]
    batch = build_batch(samples)
    adv = batch.tensors["advantages"][0].tolist()
    assert adv == pytest.approx([expected[0]] * 2 + [0.0, 0.0] + [expected[1]] * 3, abs=1e-6)
    scores = batch.tensors["token_level_scores"][0].tolist()
    assert scores == pytest.approx([0.0] * 6 + [row["reward"]])
