"""Exporting triplets to files: JSONL or Parquet, one row per triplet, optionally consuming them.

This module owns the row format and the file/consumption ordering. A row:

    group_id, rollout_id, attempt_id, triplet_index, call_ids,
    prompt_ids, response_ids, response_mask, rollout_logprobs (null when unknown),
    reward (this triplet's credit), final_reward (the attempt's), policy_version, retokenized,
    advantage (what the trainer would train this triplet with under the current settings),
    attempt_advantage, group_size, group_mean, group_std (the per-attempt statistics behind it),
    temperature (the calls' sampling temperature),
    data_source, prompt, extra_info            <- the columns verl's RLHFDataset reads

`prompt` is the chat conversation of the triplet's first call (role/content strings;
a `completions` prompt becomes one user message) and `extra_info.index` numbers the
rows, so `verl.utils.dataset.rl_dataset.RLHFDataset` loads the file as it is (and hands
the token columns through in each row dict).

With `mark_consumed`, the file is written beside its destination first, then one
transaction records the export and its attempts and renames the file into place; if
the commit fails the file is removed. A crash between the rename and the commit leaves
a file whose attempts are still unconsumed (exported again next time): at-least-once
for files, never a consumed attempt without its file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine

from shared.settings import TrainerSettings
from trainer import messages as msgs
from trainer.consumption import record_export
from trainer.data import DataRead, read_samples
from trainer.records import CallRow
from trainer.trajectory import Tokenizer

__all__ = ["ExportResult", "TRIPLET_SCHEMA", "export_triplets", "triplet_rows", "write_rows"]

Format = Literal["jsonl", "parquet"]
DATA_SOURCE = "rolltap"

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
TRIPLET_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("rollout_id", pa.string()),
        ("attempt_id", pa.string()),
        ("triplet_index", pa.int32()),
        ("call_ids", pa.list_(pa.string())),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("final_reward", pa.float64()),
        ("policy_version", pa.int64()),
        ("retokenized", pa.bool_()),
        ("advantage", pa.float64()),
        ("turn_ends", pa.list_(pa.int32())),
        ("turn_rewards", pa.list_(pa.float64())),
        ("turn_advantages", pa.list_(pa.float64())),
        ("attempt_advantage", pa.float64()),
        ("group_size", pa.int32()),
        ("group_mean", pa.float64()),
        ("group_std", pa.float64()),
        ("temperature", pa.float64()),
        ("data_source", pa.string()),
        ("prompt", pa.list_(_MESSAGE)),
        (
            "extra_info",
            pa.struct(
                [
                    ("index", pa.int64()),
                    ("rollout_id", pa.string()),
                    ("attempt_id", pa.string()),
                    ("group_id", pa.string()),
                    ("task", pa.string()),
                ]
            ),
        ),
    ]
)


@dataclass(frozen=True, slots=True)
class ExportResult:
    path: Path
    num_groups: int
    num_attempts: int
    num_triplets: int
    num_drops: int
    export_id: int | None  # set when the export consumed its attempts


def _prompt_messages(call: CallRow | None) -> list[dict[str, str]]:
    if call is None:
        return []
    messages = msgs.chat_messages(call.route, call.request)
    if messages is not None:
        return msgs.normalise_messages(messages)
    prompt = msgs.prompt_text(call.request)
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]


def triplet_rows(data: DataRead) -> Iterator[dict[str, Any]]:
    """One export row per sample of `data`, in read order."""
    calls = {c.call_id: c for g in data.groups for a in g.attempts for c in a.calls}
    for index, s in enumerate(data.samples):
        t = s.triplet
        yield {
            "group_id": s.group_id,
            "rollout_id": s.rollout_id,
            "attempt_id": s.attempt_id,
            "triplet_index": s.index,
            "call_ids": list(t.call_ids),
            "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids,
            "response_mask": t.response_mask,
            "rollout_logprobs": t.response_logprobs,
            "reward": s.reward,
            "final_reward": s.final_reward,
            "policy_version": t.policy_version,
            "retokenized": t.retokenized,
            "advantage": s.advantage,
            "turn_ends": t.turn_ends,
            "turn_rewards": s.turn_rewards,
            "turn_advantages": s.turn_advantages,
            "attempt_advantage": s.attempt_advantage,
            "group_size": s.group_size,
            "group_mean": s.group_mean,
            "group_std": s.group_std,
            "temperature": t.temperature,
            "data_source": DATA_SOURCE,
            "prompt": _prompt_messages(calls.get(t.call_ids[0])),
            "extra_info": {
                "index": index,
                "rollout_id": s.rollout_id,
                "attempt_id": s.attempt_id,
                "group_id": s.group_id,
                "task": None if s.task is None else json.dumps(s.task),
            },
        }


def write_rows(rows: Iterable[dict[str, Any]], path: Path, fmt: Format, schema: pa.Schema | None = None) -> int:
    """Write rows as JSONL or Parquet (with `schema`, else inferred); returns the row count."""
    rows = list(rows)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
    elif fmt == "parquet":
        table = pa.Table.from_pylist(rows, schema=schema) if schema is not None or rows else pa.table({})
        pq.write_table(table, path)
    else:
        raise ValueError(f"unknown format {fmt!r}: jsonl or parquet")
    return len(rows)


def _temp_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def export_triplets(
    engine: Engine,
    settings: TrainerSettings,
    out: Path,
    fmt: Format,
    *,
    mark_consumed: bool = False,
    tokenizer: Tokenizer | None = None,
    now: datetime | None = None,
) -> ExportResult:
    """Export every ready group's triplets to `out`; with `mark_consumed`, consume their attempts."""
    out = Path(out)
    data = read_samples(engine, settings, tokenizer=tokenizer, now=now)
    tmp = _temp_path(out)
    try:
        count = write_rows(triplet_rows(data), tmp, fmt, TRIPLET_SCHEMA if fmt == "parquet" else None)
        export_id = None
        if mark_consumed and data.attempt_pks:
            with engine.connect() as conn:  # autobegins; closing without commit rolls back
                export_id = record_export(
                    conn, format=fmt, path=str(out.resolve()), attempt_pks=data.attempt_pks, num_triplets=count
                )
                os.replace(tmp, out)
                try:
                    conn.commit()
                except BaseException:
                    out.unlink(missing_ok=True)
                    raise
        else:
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(out, len(data.groups), len(data.attempt_pks), count, len(data.drops), export_id)
