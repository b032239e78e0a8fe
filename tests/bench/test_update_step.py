"""bench.update_step on CPU: the GPU measurements of docs/scale.md come from this module."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.update_step import _ranks


def test_kinds_read_as_ranks() -> None:
    assert _ranks("lora:16,lora:64,full") == [16, 64, 0]
    for bad in ("lora", "full:8", "lora:x", "qlora:8"):
        with pytest.raises(SystemExit):
            _ranks(bad)


def test_a_real_shape_updates_and_exports_its_adapter(tmp_path: Path) -> None:
    # SmolLM2-135M's shape with random weights (the smallest of bench.shapes); 8 rows in 4 groups of 2,
    # so that advantages are not all 0.
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "bench.update_step", "--device", "cpu", "--shape", "smollm2-135m",
                    "--kinds", "lora:8", "--rows", "8", "--prompt", "8", "--response", "8", "--steps", "2",
                    "--micro-batch", "8", "--json", str(out)], check=True, timeout=900)
    result = json.loads(out.read_text())
    assert result["shape"] == "smollm2-135m"
    lora = result["lora8"]
    assert lora["device"] == "cpu" and lora["checks_pass"] is True
    assert lora["export_lora_s"] > 0 and len(lora["loss"]) == 2
