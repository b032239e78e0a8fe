"""`rolltap-trainer stats`: the per-step training signal table and `--plot`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shared.settings import LimitSettings
from tests.trainer.conftest import Db
from trainer.consumption import record_training_step
from trainer.main import main


def test_stats_shows_the_signal_of_the_last_steps_and_plots_it(db: Db, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with db.engine.begin() as conn:
        for step in (1, 2, 3):
            record_training_step(conn, step=step, attempt_pks=[], policy_version=step, metrics={
                "reward_mean": 0.1 * step, "entropy": 3.0 - step / 2, "clip_frac": 0.05 * step, "ppo_kl": 0.01,
                "grad_norm": 1.5, "logprob_mismatch": 0.002, "tied_groups": step - 1, "off_policy_rows": 0,
                "off_policy_correction": "tis-token",
            })
    assert main(["--db", db.url, "stats", "--json", "--plot", str(tmp_path / "plots")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert report["steps"][2]["entropy"] == 1.5 and report["steps"][2]["clip_frac"] == pytest.approx(0.15)
    assert report["steps"][1]["tied_groups"] == 1 and report["steps"][0]["off_policy_correction"] == "tis-token"
    png = Path(report["plot"])
    assert png == tmp_path / "plots" / "training.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--db", db.url, "stats"]) == 0
    text = capsys.readouterr().out
    assert "Training signal (last 10 steps)" in text and "entropy" in text and "tis-token" in text


def test_plot_writes_drop_reasons_and_staleness(db: Db, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sqlalchemy import insert

    from shared.db.models import CallDrop
    from trainer.plot import drop_counts, staleness_by_step
    from tests.trainer.conftest import tokens_call

    pks = [db.attempt("r", f"a{i}", policy_version=v, calls=[tokens_call([1, 2], [3])]) for i, v in enumerate((0, 1, 2))]
    call_ids = db.call_ids("r", "a0") + db.call_ids("r", "a1")
    with db.engine.begin() as conn:
        conn.execute(insert(CallDrop), [
            {"call_id": call_ids[0], "rollout_id": "r", "attempt_id": "a0", "reason": "truncated"},
            {"call_id": call_ids[1], "rollout_id": "r", "attempt_id": "a1", "reason": "too_stale"}])
        record_training_step(conn, step=1, attempt_pks=pks[:2], policy_version=2, metrics={"reward_mean": 0.5})
        record_training_step(conn, step=2, attempt_pks=pks[2:], policy_version=3, metrics={"reward_mean": 0.6})
    with db.engine.connect() as conn:
        assert drop_counts(conn) == {"too_stale": 1, "truncated": 1}
        # Step 1 (version 2) consumed attempts of versions 0 and 1; step 2 (version 3) one of version 2.
        assert staleness_by_step(conn) == [(1, 1.5, 2), (2, 1.0, 1)]
    assert main(["--db", db.url, "stats", "--json", "--plot", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [Path(p).name for p in report["plots"]] == ["training.png", "drops.png", "staleness.png"]
    for path in report["plots"]:
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_reward_statistics_stay_finite_at_any_stored_magnitude(db: Db, capsys: pytest.CaptureFixture[str]) -> None:
    """Rewards at the proxy's limit, and ±1e308 stored before it had one (or by SQL): sums,
    spread and histogram are finite numbers, not an overflow or NaN."""
    limit = LimitSettings().max_abs_reward
    for i, value in enumerate([limit, -limit, 1e308, -1e308, 1e308]):
        db.attempt(f"big-{i}", "0", reward=value)
    assert main(["--db", db.url, "stats", "--json"]) == 0
    rewards = json.loads(capsys.readouterr().out)["rewards"]
    numbers = [rewards[k] for k in ("mean", "std", "min", "median", "max")]
    numbers += [edge for b in rewards["histogram"] for edge in (b["lo"], b["hi"])]
    assert rewards["rewarded_attempts"] == 5 and all(math.isfinite(n) for n in numbers), rewards
    assert sum(b["count"] for b in rewards["histogram"]) == 5
    assert rewards["mean"] == pytest.approx(1e308 / 5) and rewards["max"] == 1e308
    assert main(["--db", db.url, "stats"]) == 0
    assert "Final rewards (5 rewarded" in capsys.readouterr().out
