"""Supervised fine-tuning export: the conversations of finished attempts as chat messages.

This module owns the SFT view of an attempt. Each `chat/completions` or `messages` call
contributes its request messages plus the reply it got. Calls whose conversation
continues the previous one (its messages start with the previous call's messages and
reply) extend one example, so a multi-turn attempt gives one example per unbroken
conversation, not one per call. `completions` (raw text) calls, calls that are not
`ok` and calls whose stored response was cut (`response_truncated`: the reply is cut) are skipped.

Output rows follow OpenAI's fine-tuning format: `{"messages": [...], "tools": [...]}`.
Assistant messages the attempt did not generate (history the agent wrote itself, e.g.
few-shot turns) get `"weight": 0` and the generated ones `"weight": 1`, written only
when an example holds both kinds. Parquet output (`format="parquet"`) flattens content
to strings so `verl.utils.dataset.multiturn_sft_dataset.MultiTurnSFTDataset` reads it.

No consumption: SFT exports may be repeated freely.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Engine, select

from shared.db.models import Attempt
from trainer import messages as msgs
from trainer.credit import final_reward
from trainer.export import write_rows
from trainer.reader import load_attempt_data, utc
from trainer.records import AttemptRow

__all__ = ["SftResult", "attempt_examples", "export_sft"]

CHUNK = 200  # attempts loaded at once: bounds memory on large databases


@dataclass(frozen=True, slots=True)
class SftResult:
    path: Path
    num_attempts: int
    num_examples: int


def _key(message: dict[str, Any]) -> str:
    # Agents re-serialise history (extra null fields, content parts): compare what matters.
    calls = [
        ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
        for c in message.get("tool_calls") or []
    ]
    return json.dumps([message.get("role"), msgs.flatten_content(message.get("content")), calls])


def attempt_examples(attempt: AttemptRow) -> list[dict[str, Any]]:
    """The SFT examples (OpenAI fine-tuning rows) of one attempt with loaded calls."""
    chains: list[tuple[list[dict[str, Any]], Any]] = []  # (messages, tools)
    generated: set[str] = set()
    for call in sorted(attempt.calls, key=lambda c: c.seq):
        if call.status != "ok" or call.response_truncated:
            continue
        messages = msgs.chat_messages(call.route, call.request)
        reply = msgs.reply_message(call.route, call.response)
        if messages is None or reply is None or not (reply.get("content") or reply.get("tool_calls")):
            continue
        generated.add(_key(reply))
        conversation = [*messages, reply]
        tools = call.request.get("tools") if isinstance(call.request, dict) else None
        if chains:
            previous, _ = chains[-1]
            keys = [_key(m) for m in messages[: len(previous)]]
            if len(messages) >= len(previous) and keys == [_key(m) for m in previous]:
                chains[-1] = (conversation, tools or chains[-1][1])
                continue
        chains.append((conversation, tools))

    examples = []
    for conversation, tools in chains:
        assistant = [m for m in conversation if m.get("role") == "assistant"]
        weights = [1 if _key(m) in generated else 0 for m in assistant]
        if 0 in weights:
            it = iter(weights)
            conversation = [{**m, "weight": next(it)} if m.get("role") == "assistant" else m for m in conversation]
        example: dict[str, Any] = {"messages": conversation}
        if tools:
            example["tools"] = tools
        examples.append(example)
    return examples


def _for_parquet(example: dict[str, Any]) -> dict[str, Any]:
    # One Arrow type per column: content as a string, tools as JSON text.
    messages = []
    for m in example["messages"]:
        flat = {k: v for k, v in m.items() if v is not None}
        flat["content"] = msgs.flatten_content(m.get("content"))
        messages.append(flat)
    out: dict[str, Any] = {"messages": messages}
    if "tools" in example:
        out["tools"] = json.dumps(example["tools"])
    return out


def _attempts(engine: Engine, statuses: tuple[str, ...]) -> Iterator[list[AttemptRow]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(Attempt.id, Attempt.rollout_id, Attempt.attempt_id, Attempt.policy_version, Attempt.finished_at, Attempt.created_at)
            .where(Attempt.status.in_(statuses))
            .order_by(Attempt.id)
        ).all()
        for i in range(0, len(rows), CHUNK):
            part = [
                AttemptRow(pk, rid, aid, rid, "", int(v or 0), utc(fin or created))
                for pk, rid, aid, v, fin, created in rows[i : i + CHUNK]
            ]
            load_attempt_data(conn, part)
            yield part


def export_sft(
    engine: Engine,
    out: Path,
    *,
    fmt: Literal["jsonl", "parquet"] = "jsonl",
    include_failed: bool = False,
    min_reward: float | None = None,
) -> SftResult:
    """Write the SFT examples of finished attempts (`succeeded`, plus `failed` if asked).

    `min_reward` keeps only attempts whose final reward is at least that (rejection
    sampling); attempts without a reward are then left out.
    """
    statuses = ("succeeded", "failed") if include_failed else ("succeeded",)
    examples: list[dict[str, Any]] = []
    num_attempts = 0
    for part in _attempts(engine, statuses):
        for attempt in part:
            if min_reward is not None:
                final = final_reward(attempt.rewards)
                if final is None or final < min_reward:
                    continue
            found = attempt_examples(attempt)
            num_attempts += bool(found)
            examples += found
    rows = examples if fmt == "jsonl" else [_for_parquet(e) for e in examples]
    write_rows(rows, Path(out), fmt)
    return SftResult(Path(out), num_attempts, len(examples))
