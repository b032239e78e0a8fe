"""LoRA adapters as bytes (`trainer.lora_transport = "bytes"`): the trainer's archive, the proxy's routes
on both databases, and the replicas' plugin (`rolltap_vllm`) fetching, checking and unpacking.

The plugin's fetching runs here without vLLM; tests/trainer/test_weights.py pushes to a real replica
that cannot see the trainer's folders.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text, update

from rolltap_vllm import AdapterFetchError, AdapterSource, register
from shared.db.engine import create_sync_db
from shared.db.models import LoraAdapter
from shared.settings import DbSettings
from tests.conftest import ProxyFactory
from tests.support.fault_replica import FaultReplica
from tests.support.servers import serve_in_thread
from trainer.weights import PushError, WeightPusher, adapter_archive

ADAPTER_TOKEN = "rk-adapter-fetch-token-0123456789"
ADMIN = {"authorization": "Bearer t"}
SHAPE = {"message", "type", "param", "code"}


def _adapter(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(f'{{"r": 8, "seed": {seed}}}')
    (folder / "adapter_model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * 4096)
    return folder


def _put(proxy_url: str, name: str, version: int, archive: bytes, *, keep: int | None = None,
         digest: str | None = None) -> httpx.Response:
    params = {"version": version, **({"keep": keep} if keep is not None else {})}
    return httpx.put(f"{proxy_url}/admin/adapters/{name}", content=archive, params=params, timeout=60,
                     headers={**ADMIN, "content-type": "application/octet-stream",
                              "x-rolltap-sha256": digest or hashlib.sha256(archive).hexdigest()})


def test_the_archive_is_the_folder_and_the_same_bytes_each_time(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "a", seed=1)
    assert adapter_archive(folder) == adapter_archive(folder)  # one digest per content: re-pushes match
    with pytest.raises(PushError, match="no adapter_config.json"):
        adapter_archive(tmp_path)


def test_an_adapter_goes_up_once_and_comes_down_checked_and_old_ones_are_pruned(
        proxy_for: ProxyFactory, tmp_path: Path) -> None:
    folders = {v: _adapter(tmp_path / f"policy-v{v}", seed=v) for v in range(1, 5)}
    cache = tmp_path / "replica-cache"
    with proxy_for([], adapter_token=ADAPTER_TOKEN) as proxy:
        source = AdapterSource(proxy.url, ADAPTER_TOKEN, cache)
        for version, folder in folders.items():
            stored = _put(proxy.url, f"policy-v{version}", version, adapter_archive(folder), keep=2)
            assert stored.status_code == 201, stored.text
            if version == 1:
                v1 = source.fetch("policy-v1")
        assert source.fetch("policy-v1") is None and source.fetch("policy-v2") is None  # pruned: keep=2
        v3 = source.fetch("policy-v3")
        v4 = source.fetch("policy-v4")
        assert source.fetch("policy-v9") is None
    assert v1 is not None and v3 is not None and v4 is not None
    for version, folder in ((4, v4), (3, v3)):
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == \
            {p.name: p.read_bytes() for p in folders[version].iterdir()}
    # The replica's copies are named by digest, and only those the proxy still stores remain.
    assert {p.name for p in cache.iterdir()} == {v3.name, v4.name} and not v1.exists()
    assert stored.json()["stored"] == 2


def test_fetching_is_closed_by_default_and_no_token_reaches_a_log(
        proxy_for: ProxyFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with proxy_for([], admin_token=None) as proxy:
        closed = httpx.get(f"{proxy.url}/adapters/policy-v1", headers={"authorization": f"Bearer {ADAPTER_TOKEN}"})
    assert closed.status_code == 403 and set(closed.json()["error"]) == SHAPE
    assert closed.json()["error"]["code"] == "adapters_disabled"
    with proxy_for([], adapter_token=ADAPTER_TOKEN) as proxy:
        _put(proxy.url, "policy-v1", 1, adapter_archive(_adapter(tmp_path / "a", seed=1))).raise_for_status()
        url = f"{proxy.url}/adapters/policy-v1"
        anonymous = httpx.get(url)
        wrong = httpx.get(url, headers={"authorization": "Bearer rk-not-it"})
        agent_style = httpx.get(url, headers={"x-api-key": ADAPTER_TOKEN})  # only `Authorization: Bearer` opens it
        by_admin = httpx.get(url, headers=ADMIN)
        bad_name = httpx.get(f"{proxy.url}/adapters/a%20b", headers=ADMIN)
        with pytest.raises(AdapterFetchError, match="answered 401") as refused:
            AdapterSource(proxy.url, "rk-not-it", tmp_path / "cache").fetch("policy-v1")
        assert AdapterSource(proxy.url, ADAPTER_TOKEN, tmp_path / "cache").fetch("policy-v1") is not None
    for answer in (anonymous, wrong, agent_style):
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_adapter_token"
    assert by_admin.status_code == 200 and by_admin.headers["content-type"] == "application/x-tar"
    assert bad_name.status_code == 400 and set(bad_name.json()["error"]) == SHAPE
    assert "rk-not-it" not in str(refused.value)
    assert ADAPTER_TOKEN not in caplog.text and "rk-not-it" not in caplog.text


def test_damaged_bytes_are_refused_on_the_way_up_and_on_the_way_down(
        proxy_for: ProxyFactory, db_url: str, tmp_path: Path) -> None:
    archive = adapter_archive(_adapter(tmp_path / "a", seed=1))
    cache = tmp_path / "cache"
    with proxy_for([], adapter_token=ADAPTER_TOKEN, limits={"max_adapter_bytes": 1024}) as small:
        too_large = _put(small.url, "policy-v1", 1, archive)
    with proxy_for([], adapter_token=ADAPTER_TOKEN) as proxy:
        mismatch = _put(proxy.url, "policy-v1", 1, archive, digest=hashlib.sha256(b"other").hexdigest())
        missing = httpx.put(f"{proxy.url}/admin/adapters/policy-v1", params={"version": 1}, content=archive,
                            headers=ADMIN)
        _put(proxy.url, "policy-v1", 1, archive).raise_for_status()
        # Damage in storage (or on the way down): the plugin refuses the bytes and unpacks nothing.
        engine = create_sync_db(DbSettings(url=db_url))
        try:
            with engine.begin() as conn:
                conn.execute(update(LoraAdapter).values(data=archive[:-1] + b"\x01"))
        finally:
            engine.dispose()
        with pytest.raises(AdapterFetchError, match="refused"):
            AdapterSource(proxy.url, ADAPTER_TOKEN, cache).fetch("policy-v1")
    assert too_large.status_code == 413 and set(too_large.json()["error"]) == SHAPE
    assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "adapter_digest_mismatch"
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "header.x-rolltap-sha256"
    assert not cache.exists()  # checked before anything is written


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite has one writer: there they queue
def test_calls_are_recorded_while_an_adapter_write_waits(proxy_for: ProxyFactory, db_url: str,
                                                         tmp_path: Path) -> None:
    # An adapter of hundreds of MB takes seconds to store; here a lock holds its write as long as
    # the test likes. Queued with the records it would hold every call's record, and so `finish`.
    archive = adapter_archive(_adapter(tmp_path / "a", seed=1))
    engine = create_sync_db(DbSettings(url=db_url))
    with serve_in_thread(FaultReplica()) as (replica, _), \
            proxy_for([replica], adapter_token=ADAPTER_TOKEN, finish_timeout_s=5.0) as proxy, \
            ThreadPoolExecutor(1) as pool, engine.connect() as blocker, engine.connect() as watcher:
        blocker.execute(text("LOCK TABLE lora_adapters IN ACCESS EXCLUSIVE MODE"))
        upload = pool.submit(_put, proxy.url, "policy-v1", 1, archive)
        deadline = time.monotonic() + 30
        while not watcher.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
            assert time.monotonic() < deadline and not upload.done(), "the adapter write never reached the lock"
            time.sleep(0.05)
        call = httpx.post(f"{proxy.base_url('w1', 'a1')}/chat/completions", timeout=30,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        finish = httpx.post(f"{proxy.url}/rollout/w1/attempt/a1/finish", json={"status": "succeeded"}, timeout=30)
        attempt = httpx.get(f"{proxy.url}/rollout/w1/attempt/a1", timeout=30).json()
        still_waiting = not upload.done()
        blocker.rollback()  # the lock goes: the adapter is stored
        stored = upload.result(timeout=60)
    engine.dispose()
    assert call.status_code == 200 and finish.status_code == 200, finish.text
    assert len(attempt["calls"]) == 1 and still_waiting
    assert stored.status_code == 201 and stored.json()["size_bytes"] == len(archive)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_resolving_needs_the_adapter_name_and_a_refused_upload_touches_no_replica(
        proxy_for: ProxyFactory, tmp_path: Path) -> None:
    with serve_in_thread(FaultReplica()) as (replica, _), \
            proxy_for([replica], pool={"weight_mode": "lora"}, limits={"max_adapter_bytes": 1024}) as proxy:
        nameless = httpx.post(f"{proxy.url}/admin/replicas/control", headers=ADMIN,
                              json={"url": replica, "action": "resolve_lora_adapter", "body": {}})
        with WeightPusher(proxy.url, "t", lora_transport="bytes") as pusher, \
                pytest.raises(PushError, match="413"):
            pusher.push_lora(1, _adapter(tmp_path / "a", seed=1))
        pool = httpx.get(f"{proxy.url}/admin/replicas", headers=ADMIN).json()["data"]
    assert nameless.status_code == 400 and nameless.json()["error"]["code"] == "missing_lora_name"
    assert [r["url"] for r in pool] == [replica]  # the proxy refused the upload: no replica was drained


def test_the_plugin_is_off_without_a_source_and_refuses_a_source_without_a_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Here vLLM is not installed: `register` returning at all shows it reached for none of it.
    monkeypatch.delenv("ROLLTAP_LORA_SOURCE", raising=False)
    register()
    monkeypatch.setenv("ROLLTAP_LORA_SOURCE", "http://proxy:8000")
    monkeypatch.delenv("ROLLTAP_LORA_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="ROLLTAP_LORA_TOKEN is not"):
        register()
