"""Deployment files: the compose layouts and the Dockerfiles validate with the real tools.

This checks the files without an engine (Compose's own `config`, hadolint). The stack itself runs in
`tests/deploy/test_compose.py`, against the `cpu` profile `.ci/run` brings up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE_ENV = ROOT / ".env.example"
SECRETS = ("POSTGRES_PASSWORD", "ROLLTAP_PROXY__ADMIN_TOKEN", "ROLLTAP_PROXY__AGENT_KEY")
# Each layout: extra compose arguments and the services it starts.
LAYOUTS = {
    "one GPU": ([], {"postgres", "volume-owner", "vllm-0", "vllm-1", "proxy", "trainer"}),
    "several GPUs": (["-f", "docker-compose.yml", "-f", "docker-compose.gpus.yml"],
                     {"postgres", "volume-owner", "vllm-0", "vllm-1", "proxy", "trainer"}),
    "scaled proxies": (["-f", "docker-compose.yml", "-f", "docker-compose.scaled.yml"],
                       {"postgres", "volume-owner", "vllm-0", "vllm-1", "proxy", "proxy-2", "nginx", "trainer"}),
    "cpu": (["--profile", "cpu"], {"postgres", "tiny-model", "volume-owner-cpu", "vllm-cpu-0", "vllm-cpu-1",
                                   "proxy-cpu", "trainer-cpu", "agent"}),
    "scaled proxies, cpu": (["-f", "docker-compose.yml", "-f", "docker-compose.scaled.yml", "--profile", "cpu"],
                            {"postgres", "tiny-model", "volume-owner-cpu", "vllm-cpu-0", "vllm-cpu-1", "proxy-cpu",
                             "proxy-cpu-2", "nginx-cpu", "trainer-cpu", "agent"}),
}


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (it comes with the test extra)"
    return path


def _env() -> dict[str, str]:
    """The process environment without anything compose would interpolate (the env file decides)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("ROLLTAP_", "COMPOSE_", "VLLM_", "POSTGRES_"))
            and k not in ("MODEL_DIR", "GPU", "TORCH_INDEX_URL")}


def _config(args: list[str], env_file: Path = EXAMPLE_ENV) -> dict[str, Any]:
    result = subprocess.run([_tool("docker-compose"), "--env-file", str(env_file), *args, "config", "--format", "json"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_is_valid_and_starts_its_services(layout: str) -> None:
    args, services = LAYOUTS[layout]
    assert set(_config(args)["services"]) == services


@pytest.mark.parametrize(("layout", "suffix"), [("scaled proxies", ""), ("scaled proxies, cpu", "-cpu")])
def test_scaled_layout_puts_nginx_in_front_of_two_proxies(layout: str, suffix: str) -> None:
    services = _config(LAYOUTS[layout][0])["services"]
    nginx, first, second = f"nginx{suffix}", f"proxy{suffix}", f"proxy{suffix}-2"
    assert [p["published"] for p in services[nginx]["ports"]] == ["8000"]
    assert set(services[nginx]["depends_on"]) == {first, second}
    for name in (first, second):
        assert not services[name].get("ports"), f"{name} is reached through nginx only"
        assert services[name]["environment"]["ROLLTAP_DB__URL"].startswith("postgresql://")
        assert services[name]["command"][0] == "--workers"
    assert services[second]["environment"]["ROLLTAP_DB__MIGRATE_ON_START"] == "false"
    assert services[f"trainer{suffix}"]["environment"]["ROLLTAP_TRAINER__PROXY_URL"] == f"http://{nginx}:8000"
    if suffix:  # nginx.conf's upstream names, as aliases
        assert services[first]["networks"]["default"]["aliases"] == ["proxy"]
        assert services[second]["networks"]["default"]["aliases"] == ["proxy-2"]
        assert services["agent"]["command"][:2] == ["--proxy", f"http://{nginx}:8000"]
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    assert "server proxy:8000" in conf and "server proxy-2:8000" in conf and "proxy_buffering off" in conf


@pytest.mark.parametrize("secret", SECRETS)
def test_compose_refuses_to_start_without_a_secret(secret: str, tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("".join(line + "\n" for line in EXAMPLE_ENV.read_text().splitlines()
                                if not line.startswith(f"{secret}=")))
    result = subprocess.run([_tool("docker-compose"), "--env-file", str(env_file), "config", "-q"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert result.returncode != 0
    assert secret in result.stderr


def test_no_secret_on_a_command_line_and_the_agent_key_is_wired() -> None:
    for args, _ in LAYOUTS.values():
        config = _config(args)
        for name, service in config["services"].items():
            words = " ".join(service.get("command") or []) + " " + " ".join(service.get("entrypoint") or [])
            assert "change-me" not in words, name
            url = (service.get("environment") or {}).get("ROLLTAP_DB__URL")
            if url:
                assert "change-me" not in url and (service["environment"]["PGPASSWORD"] == "change-me"), name
        proxies = [s for n, s in config["services"].items() if n.startswith("proxy")]
        for proxy in proxies:
            assert proxy["environment"]["ROLLTAP_PROXY__AGENT_KEY"] == "change-me"
            assert proxy["environment"]["ROLLTAP_PROXY__OPEN_ACCESS"] == "false"
    agent = _config(["--profile", "cpu"])["services"]["agent"]
    assert agent["environment"]["ROLLTAP_AGENT_KEY"] == "change-me"


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60}
    for unit in sorted(units, key=len, reverse=True):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    raise AssertionError(duration)


def test_one_gpu_layout_shares_the_gpu_with_explicit_fractions() -> None:
    services = _config([])["services"]
    for name in ("vllm-0", "vllm-1"):
        command = services[name]["command"]
        assert command[command.index("--gpu-memory-utilization") + 1] == "0.30"
        assert {"--enable-auto-tool-choice", "--tool-call-parser"} <= set(command)
        assert services[name]["ipc"] == "host"
    gpus = {name: services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in ("vllm-0", "vllm-1", "trainer")}
    assert gpus == {"vllm-0": ["0"], "vllm-1": ["0"], "trainer": ["0"]}
    several = _config(LAYOUTS["several GPUs"][0])["services"]
    gpus = {name: several[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in ("vllm-0", "vllm-1", "trainer")}
    assert gpus == {"vllm-0": ["0"], "vllm-1": ["1"], "trainer": ["2"]}
    command = several["vllm-0"]["command"]
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.90"
    # Sharing one GPU, the second replica starts once the first is up (docs/gpu-results.md says why);
    # on a GPU of its own it need not wait.
    assert services["vllm-1"]["depends_on"]["vllm-0"]["condition"] == "service_healthy"
    assert "vllm-0" not in several["vllm-1"]["depends_on"]


def test_gpu_replicas_take_merged_full_weights_on_several_api_servers() -> None:
    # The GPU layouts serve what `lora_serve = merged` pushes: full weights reloaded through the
    # dev-mode routes, several API servers per engine (vLLM refuses runtime LoRA with several).
    import tomllib

    for layout in ([], LAYOUTS["several GPUs"][0], LAYOUTS["scaled proxies"][0]):
        services = _config(layout)["services"]
        for name in ("vllm-0", "vllm-1"):
            command, env = services[name]["command"], services[name]["environment"]
            assert "--enable-lora" not in command
            assert command[command.index("--api-server-count") + 1] == "4"
            assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
            assert "policies:/shared/policies:ro" in [f"{v['source']}:{v['target']}:ro" for v in
                                                      services[name]["volumes"] if v.get("read_only")]
        for proxy in {"proxy", "proxy-2"} & set(services):
            assert services[proxy]["environment"]["ROLLTAP_PROXY__POOL__WEIGHT_MODE"] == "full"
    trainer = tomllib.loads((ROOT / "deploy" / "trainer.toml").read_text())["trainer"]
    settings = TrainerSettings(**trainer)
    assert settings.lora_rank > 0 and settings.lora_serve == "merged" and settings.weight_transfer == "disk"
    assert settings.run_dir == "/shared/policies"  # what the replicas mount
    # The CPU profile keeps runtime LoRA (one API server each): the adapters the compose test pushes.
    cpu = _config(LAYOUTS["cpu"][0])["services"]
    assert "--enable-lora" in cpu["vllm-cpu-0"]["command"]
    assert cpu["proxy-cpu"]["environment"]["ROLLTAP_PROXY__POOL__WEIGHT_MODE"] == "lora"


def test_lifecycle_settings() -> None:
    for args, _ in LAYOUTS.values():
        services = _config(args)["services"]
        proxy = services.get("proxy") or services["proxy-cpu"]
        # The proxy drains for up to 30 s (proxy.shutdown_timeout_s) and then flushes its records.
        assert _seconds(proxy["stop_grace_period"]) > 30
        trainer = services.get("trainer") or services["trainer-cpu"]
        assert trainer["restart"] == "on-failure"  # exits 0 after max_steps and stays down
        # It starts once what it pushes to answers: the proxy, or nginx in front of the proxies.
        assert trainer["depends_on"][next(n for n in trainer["depends_on"] if n.startswith(("proxy", "nginx")))][
            "condition"] == "service_healthy"
        assert trainer.get("shm_size") or trainer.get("ipc") == "host"
        for name, service in services.items():
            for volume in service.get("volumes", []):
                if volume["target"] in ("/shared/policies", "/var/lib/rolltap", "/var/lib/postgresql/data"):
                    assert volume["type"] == "volume", (name, volume)


def test_the_trainer_image_follows_the_vllm_image() -> None:
    trainer = _config([])["services"]["trainer"]
    vllm = _config([])["services"]["vllm-0"]
    assert trainer["build"]["args"]["BASE_IMAGE"] == vllm["build"]["args"]["BASE_IMAGE"] == "vllm/vllm-openai:v0.26.0"
    # The replicas run vLLM's image with Rolltap's plugin in it (logprobs as bytes, shm pushes, LoRA by bytes).
    assert vllm["build"]["dockerfile"] == "Dockerfile.vllm-gpu" and vllm["image"] == "rolltap/vllm-gpu:0.26.0"
    assert "pip install --no-cache-dir /tmp/rolltap_vllm" in (ROOT / "Dockerfile.vllm-gpu").read_text()
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in ("VLLM_IMAGE", "POSTGRES_IMAGE", "PYTHON_IMAGE", "ROLLTAP_PROXY_IMAGE", "TORCH_INDEX_URL"):
        assert "${" + variable in text, variable


def test_dockerignore_keeps_secrets_and_environments_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".env", ".venv", ".git", ".rolltap"):
        assert entry in ignored


def test_dockerfiles_lint_clean() -> None:
    dockerfiles = sorted(ROOT.glob("Dockerfile*")) + sorted((ROOT / "deploy").rglob("Dockerfile*"))
    assert len(dockerfiles) >= 5
    result = subprocess.run([_tool("hadolint"), *map(str, dockerfiles)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
