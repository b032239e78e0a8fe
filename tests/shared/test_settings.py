"""Settings precedence: init kwargs (CLI flags) > environment > config file > defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from shared.settings import CONFIG_ENV, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the developer's shell exports must not leak into these tests.
    for name in list(os.environ):
        if name.startswith("ROLLTAP_"):
            monkeypatch.delenv(name)


CONFIG_TEXT = {
    "toml": """
[db]
url = "sqlite:///from-file.db"
pool_size = 7

[proxy]
host = "10.0.0.1"
port = 7001
replicas = ["http://file-replica:8000/v1"]

[proxy.recorder]
queue_size = 11
""",
    "yaml": """
db:
  url: sqlite:///from-file.db
  pool_size: 7
proxy:
  host: 10.0.0.1
  port: 7001
  replicas:
    - http://file-replica:8000/v1
  recorder:
    queue_size: 11
""",
    "json": json.dumps({
        "db": {"url": "sqlite:///from-file.db", "pool_size": 7},
        "proxy": {"host": "10.0.0.1", "port": 7001, "replicas": ["http://file-replica:8000/v1"],
                  "recorder": {"queue_size": 11}},
    }),
}


@pytest.fixture(params=sorted(CONFIG_TEXT))
def config_file(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / f"rolltap.{request.param}"
    path.write_text(CONFIG_TEXT[request.param])
    monkeypatch.setenv(CONFIG_ENV, str(path))
    return path


def test_defaults() -> None:
    settings = Settings()
    assert settings.db.url == "sqlite:///./rolltap.db"
    assert settings.proxy.port == 8000
    assert settings.proxy.replicas == []
    assert settings.proxy.admin_token is None
    assert settings.proxy.recorder.queue_size == 4096


def test_config_file_overrides_defaults(config_file: Path) -> None:
    settings = Settings()
    assert settings.db.url == "sqlite:///from-file.db"
    assert settings.db.pool_size == 7
    assert settings.proxy.host == "10.0.0.1"
    assert settings.proxy.port == 7001
    assert settings.proxy.replicas == ["http://file-replica:8000"]  # `/v1` suffix normalised away
    assert settings.proxy.recorder.queue_size == 11
    assert settings.proxy.recorder.batch_max == 256  # untouched keys keep their defaults
    assert settings.db.migrate_on_start is True


def test_env_overrides_config_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLTAP_DB__URL", "postgresql://env@db/rolltap")
    monkeypatch.setenv("ROLLTAP_PROXY__PORT", "7002")
    monkeypatch.setenv("ROLLTAP_PROXY__RECORDER__QUEUE_SIZE", "12")
    settings = Settings()
    assert settings.db.url == "postgresql://env@db/rolltap"
    assert settings.proxy.port == 7002
    assert settings.proxy.recorder.queue_size == 12
    # Keys the environment does not set still come from the file, level by level.
    assert settings.db.pool_size == 7
    assert settings.proxy.host == "10.0.0.1"


def test_init_kwargs_override_env_and_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLTAP_PROXY__PORT", "7002")
    monkeypatch.setenv("ROLLTAP_PROXY__HOST", "10.0.0.2")
    # What `rolltap-proxy --port 7003 --replica URL` passes: a partial `proxy` section.
    settings = Settings(proxy={"port": 7003, "replicas": ["http://cli-replica:1"]})
    assert settings.proxy.port == 7003
    assert settings.proxy.replicas == ["http://cli-replica:1"]
    assert settings.proxy.host == "10.0.0.2"  # not on the command line: env still applies
    assert settings.proxy.recorder.queue_size == 11  # nor in env: the file still applies
    assert settings.db.url == "sqlite:///from-file.db"


def test_nested_env_without_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLTAP_DB__URL", "postgresql://u@h/d")
    monkeypatch.setenv("ROLLTAP_DB__MIGRATE_ON_START", "false")
    monkeypatch.setenv("ROLLTAP_TRAINER__CREDIT", "discounted")
    settings = Settings()
    assert settings.db.url == "postgresql://u@h/d"
    assert settings.db.migrate_on_start is False
    assert settings.trainer.credit == "discounted"


@pytest.mark.parametrize("value", [
    '["http://a:1", "http://b:2/v1/"]',
    "http://a:1,http://b:2/v1/",
    " http://a:1 , http://b:2/v1/ ,",
])
def test_replicas_from_env_as_json_list_or_comma_separated(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLTAP_PROXY__REPLICAS", value)
    assert Settings().proxy.replicas == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("url", ["a:1", "ftp://a:1", "localhost:8000"])
def test_invalid_replica_url_is_rejected(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="replica URL must start with http"):
        Settings(proxy={"replicas": [url]})
    monkeypatch.setenv("ROLLTAP_PROXY__REPLICAS", f"http://ok:1,{url}")
    with pytest.raises(ValidationError, match="replica URL must start with http"):
        Settings()


def test_invalid_values_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        Settings(proxy={"port": 70000})
    monkeypatch.setenv("ROLLTAP_PROXY__RECORDER__QUEUE_SIZE", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_missing_or_unknown_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "absent.toml"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        Settings()
    ini = tmp_path / "rolltap.ini"
    ini.write_text("[db]\n")
    monkeypatch.setenv(CONFIG_ENV, str(ini))
    with pytest.raises(ValueError, match=r"\.toml, \.json or \.yaml"):
        Settings()


def test_admin_token_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "s3cr3t-token-value"
    monkeypatch.setenv("ROLLTAP_PROXY__ADMIN_TOKEN", token)
    settings = Settings()
    assert isinstance(settings.proxy.admin_token, SecretStr)
    assert settings.proxy.admin_token.get_secret_value() == token
    for text in (repr(settings), str(settings), repr(settings.proxy), settings.model_dump_json()):
        assert token not in text
    from_kwargs = Settings(proxy={"admin_token": token})
    assert token not in repr(from_kwargs)


@pytest.mark.parametrize("name", ["dead_after_s", "lease_s"])
def test_dead_after_s_keeps_its_old_name_lease_s(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `lease_s` was the setting's first name: environments and config files written with it still work.
    monkeypatch.setenv(f"ROLLTAP_PROXY__CLUSTER__{name.upper()}", "3.5")
    assert Settings().proxy.cluster.dead_after_s == 3.5
    monkeypatch.delenv(f"ROLLTAP_PROXY__CLUSTER__{name.upper()}")
    path = tmp_path / "rolltap.yaml"
    path.write_text(f"proxy:\n  cluster:\n    {name}: 7\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert Settings().proxy.cluster.dead_after_s == 7.0
    assert Settings(proxy={"cluster": {name: 2}}).proxy.cluster.dead_after_s == 2.0
