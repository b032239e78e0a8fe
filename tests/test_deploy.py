"""Deployment files: the compose file and the Dockerfiles validate with the real tools.

No Docker engine runs here; the services' commands themselves are exercised natively
by the CLI tests (`tests/proxy/test_cli.py`, `tests/trainer/test_loop.py`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (it comes with the test extra)"
    return path


def test_compose_file_is_valid() -> None:
    env = {**os.environ, "MODEL_DIR": "/models/x", "ROLLTAP_ADMIN_TOKEN": "t"}
    result = subprocess.run([_tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_secrets() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "ROLLTAP_ADMIN_TOKEN")}
    result = subprocess.run([_tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            env=env, capture_output=True, text=True)
    output = result.stderr + result.stdout
    assert result.returncode != 0
    assert "MODEL_DIR" in output or "ROLLTAP_ADMIN_TOKEN" in output


def test_compose_wires_the_services_as_the_cli_expects() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    proxy = compose["services"]["proxy"]
    replicas = [proxy["command"][i + 1] for i, arg in enumerate(proxy["command"]) if arg == "--replica"]
    assert replicas == ["http://vllm-0:8000", "http://vllm-1:8000"]
    assert proxy["environment"]["ROLLTAP_PROXY__POOL__WEIGHT_MODE"] == "lora"
    for name in ("vllm-0", "vllm-1"):
        assert "--enable-lora" in compose["services"][name]["command"]
    # The trainer writes adapters where the replicas read them.
    trainer_volumes = compose["services"]["trainer"]["volumes"]
    assert "policies:/shared/policies" in trainer_volumes
    assert "policies:/shared/policies:ro" in compose["x-vllm"]["volumes"]


def test_dockerfiles_lint_clean() -> None:
    result = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile.proxy"), str(ROOT / "Dockerfile.trainer")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
