"""`rolltap-trainer stats`: the per-step training signal table and `--plot`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
