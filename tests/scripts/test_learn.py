"""The multi-turn agent loop, short, on CPU: `scripts.learn --task calculator` runs the OpenAI Agents
SDK agent through the proxy on PostgreSQL against a real CPU replica, the trainer trains LoRA and
pushes each version merged into full weights (`trainer.lora_serve = merged`; the compose test
runs the loop with adapters), and the rows it builds merge each episode's turns with the tool's
answer masked out."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session
from transformers import AutoTokenizer

from scripts.agent_report import attempt_samples, curve_from_log
from shared.db.engine import sync_url
from shared.db.models import Attempt, Call, PolicyVersion, TrainingStep, TrainingStepAttempt
from shared.settings import TrainerSettings
from tests.support.databases import database

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPS, GROUPS, SIZE, EVAL = 2, 2, 3, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """One short run (the replica's start-up dominates: ~2-3 minutes); its database and report."""
    tmp = tmp_path_factory.mktemp("learn")
    with database("postgresql", tmp) as url:
        out = tmp / "report.md"
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.learn", "--task", "calculator", "--steps", str(STEPS), "--replicas", "1",
             "--groups", str(GROUPS), "--group-size", str(SIZE), "--eval-tasks", str(EVAL), "--eval-every", str(STEPS), "--credit", "last_only",
             "--concurrency", "4", "--lora-serve", "merged", "--db", url, "--workdir", str(tmp / "work"), "--out", str(out), "--port", str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=1200)
        logs = "".join(f"\n== {f.name}\n" + f.read_text(errors="replace")[-4000:]
                       for f in sorted((tmp / "work").glob("*.log")))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
        yield url, out, proc.stdout


def test_the_loop_trains_and_evaluates_without_training_on_the_held_out_set(run: tuple[str, Path, str]) -> None:
    url, out, _ = run
    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(TrainingStep)).scalar() == STEPS
        evals = conn.execute(select(Attempt.id).where(Attempt.rollout_id.like("eval-%"))).scalars().all()
        # Version 0 and the last one, EVAL questions each, every one recorded with its calls.
        assert len(evals) == 2 * EVAL
        called = conn.execute(select(func.count(func.distinct(Call.rollout_id))).where(
            Call.rollout_id.like("eval-%"))).scalar()
        assert called == 2 * EVAL
        trained = conn.execute(select(func.count()).select_from(TrainingStepAttempt)
                               .where(TrainingStepAttempt.attempt_pk.in_(evals))).scalar()
        assert trained == 0
        # Every version went out as merged full weights, and the last evaluation was served by the last.
        kinds = dict(conn.execute(select(PolicyVersion.version, PolicyVersion.kind).where(PolicyVersion.version > 0)).all())
        assert kinds == {v: "full" for v in range(1, STEPS + 1)}
        versions = set(conn.execute(select(Call.policy_version).where(Call.rollout_id.like("eval-%"))).scalars())
        assert versions == {0, STEPS}
    engine.dispose()
    report = out.read_text()
    assert "## The agent: held-out score, calls, tool calls" in report
    assert "held-out attempts consumed by a training step: **0**" in report
    assert (out.parent / "report-agent.png").stat().st_size > 10_000


def test_each_episode_is_one_row_with_the_tool_answer_masked(run: tuple[str, Path, str]) -> None:
    url, _, _ = run
    model = ROOT / ".rolltap" / "models" / "tiny"  # what scripts.learn built and served
    tok = AutoTokenizer.from_pretrained(model)
    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        rollouts = [f"v{v}-t{g}" for v in range(STEPS) for g in range(GROUPS)]
        samples = attempt_samples(conn, rollouts, TrainerSettings(model=str(model), credit="last_only"))
        with Session(conn) as session:
            calls = {c.call_id: c for c in session.scalars(select(Call).where(Call.rollout_id.in_(rollouts)))}
    engine.dispose()
    assert samples
    merged = 0
    for s in samples:
        t = s.triplet
        ordered = [calls[i] for i in t.call_ids]
        # Consecutive calls of one row: the later prompt starts with the earlier prompt + completion.
        for a, b in zip(ordered, ordered[1:], strict=False):
            head = [*a.prompt_token_ids, *a.completion_token_ids]
            assert b.prompt_token_ids[: len(head)] == head
        if len(t.seqs) < 2:
            continue
        merged += 1
        assert t.turn_ends[-1] == len(t.response_ids) and len(t.turn_ends) == len(t.seqs)
        first = ordered[0]
        # Turn 1 (the tool call) generated, then the tool's answer and the template glue masked, then turn 2.
        n1 = len(first.completion_token_ids)
        assert t.response_mask[:n1] == [1] * n1
        glue_end = t.turn_ends[1] - len(ordered[1].completion_token_ids)
        assert t.response_mask[n1:glue_end] == [0] * (glue_end - n1) and glue_end > n1
        assert t.response_mask[glue_end:] == [1] * (len(t.response_ids) - glue_end)
        glue = tok.decode(t.response_ids[n1:glue_end])
        assert "<|im_start|>tool\n" in glue and glue.endswith("<|im_start|>assistant\n"), glue
        # last_only: the tool call's tokens get no share of the advantage, the answer all of it.
        assert s.turn_advantages is not None and s.turn_advantages[0] == 0.0
        assert s.turn_advantages[-1] == s.attempt_advantage
    # Every episode called the tool first (the first turn names it): most rows merge both turns.
    assert merged >= len({(s.rollout_id, s.attempt_id) for s in samples}) // 2



def test_the_printed_progress_reads_back_as_the_curve(run: tuple[str, Path, str]) -> None:
    # What `scripts.agent_report` plots of a run cut before its report: the lines it printed.
    _, out, stdout = run
    printed = curve_from_log(stdout)
    written = json.loads((out.parent / "work" / "curve.json").read_text())
    assert [c["version"] for c in printed["curve"]] == [c["version"] for c in written["curve"]] == list(range(STEPS))
    for p, w in zip(printed["curve"], written["curve"], strict=True):
        assert p["reward"] == pytest.approx(w["reward"], abs=5.1e-4) and p["calls"] == pytest.approx(w["calls"], abs=5.1e-3)
        assert p["valid"] == pytest.approx(w["valid"], abs=5.1e-3)
    assert [(h["version"], h["mean"]) for h in printed["held_out"]] == [
        (h["version"], pytest.approx(h["mean"], abs=5.1e-4)) for h in written["held_out"]]
