"""bench.weight_push on CPU (host shared memory and a LoRA replica): the H200 figures of docs/scale.md
come from this module with `--backend ipc`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_both_full_weight_pushes_deliver_the_same_weights_and_adapters_travel_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "bench.weight_push", "--shape", "tiny", "--backend", "shm", "--repeat", "2",
                    "--lora-ranks", "8", "--work", str(tmp_path / "work"), "--out", str(out)],
                   check=True, timeout=900)
    result = json.loads(out.read_text())
    summary = result["full_summary"]
    assert result["backend"] == "shm" and len(result["full"]["rounds"]) == 2
    # Each round the in-memory push and the reload of the same weights answer alike; rounds differ.
    assert summary["same_answer_every_round"] is True and summary["answers_change_between_rounds"] is True
    assert all(r["in_memory_s"] > 0 and r["disk_reload_s"] > 0 for r in result["full"]["rounds"])
    lora = result["lora"]
    assert {(r["transport"], r["rank"]) for r in lora} == {("path", 8), ("bytes", 8)} and len(lora) == 6
    assert all(r["push_s"] > 0 and r["bytes"] > 0 for r in lora)
