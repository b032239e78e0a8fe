"""Shared fixtures: both databases, a real CPU vLLM replica (once per session), the proxy."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from shared.settings import Settings  # noqa: E402
from tests.support.databases import database  # noqa: E402
from tests.support.servers import RunningProxy, run_proxy  # noqa: E402

DB_KINDS = ["sqlite", "postgresql"]


@pytest.fixture(params=DB_KINDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind (migrated by whoever starts on it)."""
    with database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.tiny_model import build_tiny_model

    cache = os.environ.get("ROLLTAP_TEST_MODEL_DIR")
    out = Path(cache) if cache else tmp_path_factory.mktemp("models") / "tiny"
    return build_tiny_model(out)


@pytest.fixture(scope="session")
def vllm_replica(tiny_model_dir: Path) -> Iterator[Any]:
    """A real CPU vLLM server on loopback serving the tiny model; started once (~75 s), with the
    `hermes` tool parser, stored Responses (`previous_response_id`) and 1024 tokens of context.

    `ROLLTAP_TEST_VLLM_URL` reuses a replica you already run (same tiny model, served as
    `tiny`) to skip the start-up while iterating; CI never sets it. Tests that compare logprobs
    at a temperature other than 1 need it started with `--logprobs-mode processed_logprobs`
    (as `tools.replica` starts it).
    """
    from tools.replica import VllmReplica

    external = os.environ.get("ROLLTAP_TEST_VLLM_URL")
    if external:
        yield SimpleNamespace(url=external.rstrip("/"), served_model_name="tiny")
        return

    # The hermes tool parser is on by default; stored Responses make `previous_response_id` work;
    # 1024 tokens of context (the tiny model's most) leave room for tool-calling turns: a tool
    # list alone is ~300 tokens.
    with VllmReplica(tiny_model_dir, served_model_name="tiny", responses_store=True, max_model_len=1024) as replica:
        replica.wait_healthy(600)
        yield replica


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_settings(db_url: str, replicas: list[str], tmp_path: Path, **proxy: Any) -> Settings:
    """Test settings. Open access by default, so tests about other things send no key; a user's
    proxy is closed by default, and tests/proxy/test_access.py covers keys with `open_access=False`."""
    recorder = proxy.pop("recorder", {})
    return Settings(
        db={"url": db_url},
        # port 0: a free port per proxy (the default 8000 collides between concurrent test runs)
        proxy={"replicas": replicas, "port": 0, "health_interval_s": 0.5, "shutdown_timeout_s": 10, "admin_token": "t",
               "open_access": True, "recorder": {"spool_dir": str(tmp_path / "spool"), **recorder}, **proxy},
    )


ProxyFactory = Callable[..., AbstractContextManager[RunningProxy]]


@pytest.fixture
def proxy_for(db_url: str, tmp_path: Path) -> ProxyFactory:
    """`with proxy_for([replica_url], **proxy_settings) as proxy:` on this test's database."""

    def factory(replicas: list[str], **proxy: Any) -> AbstractContextManager[RunningProxy]:
        return run_proxy(make_settings(db_url, replicas, tmp_path, **proxy))

    return factory
