"""Exports: JSONL/Parquet round trips, consumption, verl's dataset classes reading them, the CLI."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from shared.db.models import Export
from shared.settings import TrainerSettings
from tests.trainer.conftest import Db, tokens_call
from trainer.data import read_samples
from trainer.export import export_triplets
from trainer.main import main
from trainer.records import AttemptRow, CallRow
from trainer.sft import attempt_examples, export_sft

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 5?"}]
REPLY_1 = "The answer is 12."
FOLLOW_UP = {"role": "user", "content": "Thank you."}
REPLY_2 = "Hello!"


def chat_call(tok: Any, messages: list[dict[str, Any]], reply: str, *, exact: bool = True) -> dict[str, Any]:
    """A `calls` row as the proxy records a chat call (token IDs only when `exact`)."""
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    completion = [*tok.encode(reply, add_special_tokens=False), tok.eos_token_id]
    return {
        "request": {"model": "tiny", "messages": messages},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]},
        "prompt_token_ids": prompt if exact else None,
        "completion_token_ids": completion if exact else None,
        "completion_logprobs": [-0.25] * len(completion) if exact else None,
    }


def two_turns(tok: Any, *, exact: bool = True) -> list[dict[str, Any]]:
    second = [*QUESTION, {"role": "assistant", "content": REPLY_1}, FOLLOW_UP]
    return [chat_call(tok, QUESTION, REPLY_1, exact=exact), chat_call(tok, second, REPLY_2, exact=exact)]


def seed(db: Db, tok: Any) -> None:
    db.rollout("task-7", task={"question": "7 + 5"})
    db.attempt("task-7", "0", reward=1.0, calls=two_turns(tok), policy_version=2)
    db.attempt("task-7", "1", reward=0.0, calls=[*two_turns(tok), {"status": "failed", "http_status": None}], policy_version=2)


SETTINGS = TrainerSettings(group_size=2, max_staleness=5)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_and_parquet_round_trip(db: Db, tiny_tokenizer: Any, tmp_path: Path) -> None:
    seed(db, tiny_tokenizer)
    samples = read_samples(db.engine, SETTINGS).samples
    jl = export_triplets(db.engine, SETTINGS, tmp_path / "t.jsonl", "jsonl")
    pa_ = export_triplets(db.engine, SETTINGS, tmp_path / "t.parquet", "parquet")
    assert jl.num_triplets == pa_.num_triplets == len(samples) == 2 and jl.num_drops == 1
    rows = read_jsonl(tmp_path / "t.jsonl")
    table = pq.read_table(tmp_path / "t.parquet").to_pylist()
    for row, prow, s in zip(rows, table, samples, strict=True):
        assert row["prompt_ids"] == s.triplet.prompt_ids and row["response_ids"] == s.triplet.response_ids
        assert row["response_mask"] == s.triplet.response_mask and 0 in row["response_mask"]
        assert row["rollout_logprobs"] == s.triplet.response_logprobs
        assert (row["group_id"], row["rollout_id"], row["policy_version"]) == ("task-7", "task-7", 2)
        assert row["reward"] == s.reward and row["retokenized"] is False and len(row["call_ids"]) == 2
        assert row["prompt"] == QUESTION and row["extra_info"]["task"] == json.dumps({"question": "7 + 5"})
        # Parquet holds the same values (logprobs as float32)
        assert prow["rollout_logprobs"] == pytest.approx(row["rollout_logprobs"])
        assert {k: v for k, v in prow.items() if k != "rollout_logprobs"} == {
            k: v for k, v in row.items() if k != "rollout_logprobs"
        }
    assert sorted(r["reward"] for r in rows) == [0.0, 1.0]
    # without --mark-consumed nothing is consumed: a second export finds the same rows
    assert export_triplets(db.engine, SETTINGS, tmp_path / "again.jsonl", "jsonl").num_triplets == 2


def test_mark_consumed_exports_once(db: Db, tiny_tokenizer: Any, tmp_path: Path) -> None:
    seed(db, tiny_tokenizer)
    first = export_triplets(db.engine, SETTINGS, tmp_path / "a.parquet", "parquet", mark_consumed=True)
    assert first.export_id is not None and first.num_attempts == 2
    second = export_triplets(db.engine, SETTINGS, tmp_path / "b.parquet", "parquet", mark_consumed=True)
    assert second.num_triplets == 0 and second.export_id is None
    assert pq.read_table(tmp_path / "b.parquet").num_rows == 0
    with db.engine.connect() as conn:
        export = conn.execute(select(Export.num_attempts, Export.num_triplets, Export.format, Export.path)).one()
    assert tuple(export) == (2, 2, "parquet", str((tmp_path / "a.parquet").resolve()))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_verl_rlhf_dataset_reads_the_export(db: Db, tiny_tokenizer: Any, tmp_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    seed(db, tiny_tokenizer)
    for fmt in ("parquet", "jsonl"):
        path = tmp_path / f"t.{fmt}"
        export_triplets(db.engine, SETTINGS, path, fmt)  # type: ignore[arg-type]
        config = OmegaConf.create({"max_prompt_length": 256, "cache_dir": str(tmp_path / "cache"), "filter_overlong_prompts": True})
        dataset = RLHFDataset(data_files=str(path), tokenizer=tiny_tokenizer, config=config)
        assert len(dataset) == 2
        item = dataset[1]
        assert item["raw_prompt"] == QUESTION  # what verl's agent loop renders with the chat template
        assert item["index"] == 1 and item["data_source"] == "rolltap"
        exported = read_jsonl(tmp_path / "t.jsonl") if fmt == "jsonl" else pq.read_table(path).to_pylist()
        assert list(item["prompt_ids"]) == exported[1]["prompt_ids"]  # token columns ride along
        assert list(item["response_mask"]) == exported[1]["response_mask"]


def test_retokenised_export_with_model(db: Db, tiny_tokenizer: Any, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    db.attempt("hosted", "0", calls=two_turns(tiny_tokenizer, exact=False))
    db.attempt("hosted", "1", calls=two_turns(tiny_tokenizer, exact=False))
    url = ["--db", db.url]
    assert main([*url, "export", "--group-size", "2", "--out", str(tmp_path / "none.jsonl")]) == 0
    assert read_jsonl(tmp_path / "none.jsonl") == []  # no tokens, no tokenizer: every call dropped
    out = tmp_path / "re.jsonl"
    assert main([*url, "export", "--group-size", "2", "--model", str(tiny_tokenizer_dir), "--out", str(out)]) == 0
    rows = read_jsonl(out)
    assert len(rows) == 4 and all(r["retokenized"] and r["rollout_logprobs"] is None for r in rows)
    exact = two_turns(tiny_tokenizer)
    assert rows[0]["prompt_ids"] == exact[0]["prompt_token_ids"]
    assert rows[0]["response_ids"] == exact[0]["completion_token_ids"]


def test_sft_export_jsonl(db: Db, tiny_tokenizer: Any, tmp_path: Path) -> None:
    seed(db, tiny_tokenizer)
    few_shot = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}, {"role": "user", "content": "7 + 5?"}]
    db.attempt("few-shot", "0", reward=0.2, calls=[chat_call(tiny_tokenizer, few_shot, "12")])
    db.attempt("broken", "0", status="failed", reward=0.0, calls=[chat_call(tiny_tokenizer, QUESTION, "13")])
    out = tmp_path / "sft.jsonl"
    result = export_sft(db.engine, out)
    rows = read_jsonl(out)
    assert result.num_examples == len(rows) == 3
    # two calls that continue one conversation make one example
    assert rows[0] == {
        "messages": [
            *QUESTION,
            {"role": "assistant", "content": REPLY_1},
            FOLLOW_UP,
            {"role": "assistant", "content": REPLY_2},
        ]
    }
    # assistant turns the agent wrote itself are weighted out
    assert rows[2]["messages"][1] == {"role": "assistant", "content": "hello.", "weight": 0}
    assert rows[2]["messages"][-1] == {"role": "assistant", "content": "12", "weight": 1}
    assert len(read_jsonl(export_sft(db.engine, tmp_path / "f.jsonl", include_failed=True).path)) == 4
    assert len(read_jsonl(export_sft(db.engine, tmp_path / "m.jsonl", min_reward=0.5).path)) == 1


def test_sft_skips_a_call_whose_reply_was_cut() -> None:
    # A stream cut at proxy.recorder.max_body_bytes keeps the start of the reply in `response`.
    def attempt(*, is_cut: bool) -> AttemptRow:
        call = CallRow("c0", 0, "chat/completions", "ok", [1], [2], None, request={"messages": QUESTION},
                       response={"choices": [{"message": {"role": "assistant", "content": "1"}}]},
                       response_truncated=is_cut)
        return AttemptRow(1, "r", "0", "r", "succeeded", 0, datetime.now(UTC), calls=[call])

    assert attempt_examples(attempt(is_cut=True)) == []
    assert attempt_examples(attempt(is_cut=False)) == [{"messages": [*QUESTION, {"role": "assistant", "content": "1"}]}]


def test_verl_multiturn_sft_dataset_reads_the_sft_parquet(db: Db, tiny_tokenizer: Any, tmp_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    seed(db, tiny_tokenizer)
    out = tmp_path / "sft.parquet"
    assert main(["--db", db.url, "export-sft", "--format", "parquet", "--out", str(out)]) == 0
    dataset = MultiTurnSFTDataset(str(out), tiny_tokenizer, OmegaConf.create({"max_length": 256}))
    item = dataset[0]
    ids, loss = item["input_ids"], item["loss_mask"]
    trained = tiny_tokenizer.decode(ids[loss.bool()].tolist())
    assert REPLY_1 in trained and REPLY_2 in trained and "7 + 5" not in trained


def test_cli_stats(db: Db, tiny_tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed(db, tiny_tokenizer)
    db.attempt("other", "0", status="running", reward=None)
    db.policy(2)
    url = ["--db", db.url]
    assert main([*url, "export", "--group-size", "2", "--mark-consumed", "--out", str(tmp_path / "x.jsonl")]) == 0
    assert "wrote 2 triplets from 2 attempts in 1 groups" in capsys.readouterr().out
    assert main([*url, "stats", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attempts_by_status"] == {"running": 1, "succeeded": 2}
    assert report["consumed"] == {"by_training": 0, "by_export": 2}
    assert report["drops"] == {"not_ok": 1}
    assert report["rewards"]["rewarded_attempts"] == 2 and report["rewards"]["mean"] == 0.5
    assert report["policy"]["current_version"] == 2
    assert report["policy"]["versions"][0]["attempts"] == 2
    assert main([*url, "stats"]) == 0
    text = capsys.readouterr().out
    for heading in ("Attempts by status", "Drop reasons", "Final rewards", "Policy versions"):
        assert heading in text
    assert "not_ok" in text and "v2" in text


GRPO_2 = 0.5 / (math.sqrt(0.5) + 1e-6)  # rewards {1, 0}: mean 0.5, unbiased std sqrt(0.5), verl's epsilon


def three_calls(first: int, n: int) -> list[dict[str, Any]]:
    # Each call's prompt is new (it does not extend the previous call's): one triplet per call.
    return [tokens_call([first + 4 * i, first + 4 * i + 1], [first + 4 * i + 2, first + 4 * i + 3]) for i in range(n)]


@pytest.mark.parametrize(
    ("mode", "win"),
    [
        ("identical", [GRPO_2] * 3),
        ("last_only", [0.0, 0.0, GRPO_2]),
        ("discounted", [GRPO_2 * 0.81, GRPO_2 * 0.9, GRPO_2]),
        ("per_call", [GRPO_2] * 3),  # the finish reward sits on the last call: reward-to-go 1.0 on each
    ],
)
def test_export_advantages_of_the_acceptance_group_in_every_credit_mode(
    db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, win: list[float]
) -> None:
    """Issue 11's acceptance, through `rolltap-trainer export`: "win" (three calls) scored 1.0 and "lose"
    (one call) 0.0 get equal and opposite per-attempt advantages (GRPO +-0.7071); a tied group exports 0.0."""
    db.attempt("task", "win", reward=1.0, calls=three_calls(10, 3))
    db.attempt("task", "lose", reward=0.0, calls=three_calls(40, 1))
    db.attempt("tie", "a", reward=0.5, calls=three_calls(60, 2))
    db.attempt("tie", "b", reward=0.5, calls=three_calls(80, 1))
    monkeypatch.setenv("ROLLTAP_TRAINER__CREDIT", mode)
    monkeypatch.setenv("ROLLTAP_TRAINER__GAMMA", "0.9")
    out = tmp_path / "x.jsonl"
    assert main(["--db", db.url, "export", "--group-size", "2", "--out", str(out)]) == 0
    rows = read_jsonl(out)
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["rollout_id"], r["attempt_id"], r["triplet_index"])):
        by.setdefault((row["rollout_id"], row["attempt_id"]), []).append(row)
    assert [r["advantage"] for r in by["task", "win"]] == pytest.approx(win, abs=1e-6)
    assert [r["advantage"] for r in by["task", "lose"]] == pytest.approx([-GRPO_2], abs=1e-6)
    win_adv, lose_adv = by["task", "win"][0]["attempt_advantage"], by["task", "lose"][0]["attempt_advantage"]
    assert win_adv == pytest.approx(0.7071, abs=1e-4) and win_adv == -lose_adv
    assert {(r["group_size"], r["group_mean"]) for r in by["task", "win"] + by["task", "lose"]} == {(2, 0.5)}
    assert by["task", "win"][0]["group_std"] == pytest.approx(math.sqrt(0.5))
    tied = by["tie", "a"] + by["tie", "b"]
    assert len(tied) == 3 and all(r["advantage"] == 0.0 and r["attempt_advantage"] == 0.0 for r in tied)
    assert all(r["group_std"] == 0.0 for r in tied)
