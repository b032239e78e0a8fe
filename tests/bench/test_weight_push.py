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
    assert summary["no_answer_of_the_version_before_every_round"] is True
    assert all(r["in_memory_s"] > 0 and r["disk_reload_s"] > 0 for r in result["full"]["rounds"])
    lora = result["lora"]
    assert {(r["transport"], r["rank"]) for r in lora} == {("path", 8), ("bytes", 8)} and len(lora) == 6
    assert all(r["push_s"] > 0 and r["bytes"] > 0 for r in lora)


def test_a_merged_lora_version_reaches_every_api_server_of_every_server(tmp_path: Path) -> None:
    # `trainer.lora_serve = merged` on the GPU compose layout: servers of several API servers each, a
    # LoRA version merged into full weights by the trainer's own merge, pushed in memory through the
    # proxy. After each push every front end (2 servers x 2 API server processes) answers, all alike.
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "bench.weight_push", "--shape", "tiny", "--backend", "shm", "--repeat", "2",
                    "--servers", "2", "--api-servers", "2", "--merge-rank", "4", "--methods", "memory",
                    "--work", str(tmp_path / "work"), "--out", str(out)], check=True, timeout=900)
    result = json.loads(out.read_text())
    full, summary = result["full"], result["full_summary"]
    assert (full["servers"], full["api_servers"], full["merge_rank"]) == (2, 2, 4) and "lora" not in result
    for check in [full["base"], *(r["memory"] for r in full["rounds"])]:
        assert (check["front_ends"], check["of_front_ends"], check["answers"]) == (4, 4, 1)
        assert check["all_answers"] == [check["answer"]]
    # What the run is judged on (a GPU's bf16 batches may split one version's greedy answers): every
    # front end reached, and none answering as the version before; on CPU all alike as well.
    assert summary["every_front_end_reached_every_round"] is True
    assert summary["no_answer_of_the_version_before_every_round"] is True
    assert summary["every_front_end_agrees_every_round"] is True and summary["answers_change_between_rounds"] is True
    assert all(r["in_memory_s"] > 0 for r in full["rounds"]) and "disk_total_s" not in summary
