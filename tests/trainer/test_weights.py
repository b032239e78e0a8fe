"""Weight push to real CPU vLLM replicas: LoRA hot-load and full-weight reload, through the proxy."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import ProxyFactory
from tests.support.servers import free_port
from tests.trainer.policy_batch import policy_batch
from tools.replica import VllmReplica
from shared.settings import TrainerSettings
from trainer import transfer
from trainer.update import PolicyUpdater
from trainer.weights import PushError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              # verl's engine package warns at import that optional backends (megatron, ...) are absent.
              pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning")]

PROMPT = {"messages": [{"role": "user", "content": "Tell me about the brown fox."}], "max_tokens": 12,
          "temperature": 0}


def _greedy(proxy_url: str, rollout: str) -> tuple[str, dict[str, Any]]:
    base = f"{proxy_url}/rollout/{rollout}/attempt/0/v1"
    r = httpx.post(f"{base}/chat/completions", json={"model": "x", **PROMPT}, timeout=120)
    r.raise_for_status()
    (call,) = httpx.get(f"{proxy_url}/rollout/{rollout}/attempt/0", timeout=60).json()["calls"]
    return r.json()["choices"][0]["message"]["content"], call


@pytest.fixture(scope="module")
def lora_replica(tiny_model_dir: Path) -> Iterator[VllmReplica]:
    with VllmReplica(tiny_model_dir, served_model_name="tiny", enable_lora=True) as replica:
        yield replica


@pytest.fixture(scope="module")
def lora_replica_b(tiny_model_dir: Path) -> Iterator[VllmReplica]:
    """A second front end: its own API server and engine, as each of several vLLM servers on a GPU."""
    with VllmReplica(tiny_model_dir, served_model_name="tiny", enable_lora=True) as replica:
        yield replica


@pytest.fixture(scope="module")
def full_replica(tiny_model_dir: Path) -> Iterator[VllmReplica]:
    # Both ways of taking full weights: reload_weights from a folder, and the weight-transfer engine with
    # the Rolltap plugin's host shared-memory backend.
    with VllmReplica(tiny_model_dir, served_model_name="tiny", dev_mode=True,
                     extra_args=["--weight-transfer-config", '{"backend": "rolltap_shm"}']) as replica:
        yield replica


@pytest.fixture(scope="module")
def api_servers_replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmReplica]:
    """One engine behind two API server processes (`vllm serve --api-server-count 2`), started for full
    weights both ways: the layout a merged LoRA run or a full-weight run allows (runtime LoRA does not)."""
    with VllmReplica(tiny_model_dir, served_model_name="tiny", dev_mode=True, api_servers=2,
                     log_path=tmp_path_factory.mktemp("api-servers") / "replica.log",
                     extra_args=["--weight-transfer-config", '{"backend": "rolltap_shm"}']) as replica:
        yield replica


ADAPTER_TOKEN = "rk-replica-adapter-fetch-token"


class RemoteReplica(VllmReplica):
    """A replica that shares no filesystem with the trainer, as on another host: it runs in a mount
    namespace of its own where an empty tmpfs covers `hidden`, the folder the trainer exports to."""

    def __init__(self, model: Path, hidden: Path, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.hidden = hidden

    def command(self) -> list[str]:
        # exec keeps one pid from unshare to vLLM: stop() signals the process group as for any replica.
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs rolltap-elsewhere "$0" && exec "$@"', str(self.hidden), *super().command()]


@pytest.fixture(scope="module")
def trainer_only_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer-only")


@pytest.fixture(scope="module")
def adapter_source_port() -> int:
    """The port every proxy of the bytes test listens on: the replica's plugin is told it at start."""
    return free_port()


@pytest.fixture(scope="module")
def remote_replica(tiny_model_dir: Path, trainer_only_dir: Path, adapter_source_port: int) -> Iterator[RemoteReplica]:
    env = {"ROLLTAP_LORA_SOURCE": f"http://127.0.0.1:{adapter_source_port}", "ROLLTAP_LORA_TOKEN": ADAPTER_TOKEN}
    with RemoteReplica(tiny_model_dir, trainer_only_dir, served_model_name="tiny", enable_lora=True,
                       extra_env=env) as replica:
        yield replica


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    # init_lora_weights=False: random A and B, so the adapter really changes the outputs.
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    peft_model.save_pretrained(out)
    return out


def _perturbed_model(model_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_lora_push_changes_greedy_output_and_stamps_records(lora_replica: VllmReplica, tiny_model_dir: Path,
                                                            proxy_for: ProxyFactory, tmp_path: Path) -> None:
    adapter = _make_adapter(tiny_model_dir, tmp_path / "adapter-v1", seed=0)
    with proxy_for([lora_replica.url], pool={"weight_mode": "lora"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        before, call0 = _greedy(proxy.url, "lora-0")
        with pytest.raises(PushError, match="not started for 'full'"):
            pusher.push_full(1, tiny_model_dir, served_name="tiny")
        result = pusher.push_lora(1, adapter, base_model="tiny")
        after, call1 = _greedy(proxy.url, "lora-1")
        models = httpx.get(f"{lora_replica.url}/v1/models").json()["data"]
    assert result.pushed == [lora_replica.url] and not result.drained
    assert after != before
    assert (call0["policy_version"], call0["served_model"]) == (0, "tiny")
    assert (call1["policy_version"], call1["served_model"]) == (1, "policy-v1")
    assert "policy-v1" in {m["id"] for m in models}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_full_push_changes_greedy_output_and_stamps_records(full_replica: VllmReplica, tiny_model_dir: Path,
                                                            proxy_for: ProxyFactory, tmp_path: Path) -> None:
    new_weights = _perturbed_model(tiny_model_dir, tmp_path / "full-v1")
    with proxy_for([full_replica.url], pool={"weight_mode": "full"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        before, call0 = _greedy(proxy.url, "full-0")
        with pytest.raises(PushError, match="not started for 'lora'"):
            pusher.push_lora(1, tiny_model_dir)
        result = pusher.push_full(1, new_weights, served_name="tiny")
        after, call1 = _greedy(proxy.url, "full-1")
        # Reloading the original weights restores the original output exactly.
        pusher.push_full(2, tiny_model_dir, served_name="tiny")
        restored, call2 = _greedy(proxy.url, "full-2")
    assert result.pushed == [full_replica.url]
    assert after != before and restored == before
    assert [c["policy_version"] for c in (call0, call1, call2)] == [0, 1, 2]


class _ShmStaging:
    """The trainer's side of in-memory pushes of a folder's weights, each staged in a shared-memory segment."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        self.staged: list[transfer.StagedWeights] = []

    def stage(self) -> dict[str, Any]:
        self.staged.append(transfer.stage(self.model.named_parameters(), "shm"))
        assert self.staged[-1].update_info is not None
        return self.staged[-1].update_info

    def release(self) -> None:
        self.staged[-1].release()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_full_push_in_memory_matches_a_reload_and_frees_its_segment(full_replica: VllmReplica, tiny_model_dir: Path,
                                                                   proxy_for: ProxyFactory, tmp_path: Path) -> None:
    new_weights = _perturbed_model(tiny_model_dir, tmp_path / "full-v1")
    staging = _ShmStaging(new_weights)

    settings = TrainerSettings(model=str(tiny_model_dir), lora_rank=0, weight_transfer="shm", mini_batch_size=4,
                               micro_batch_size=2)
    with proxy_for([full_replica.url], pool={"weight_mode": "full"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        before, _ = _greedy(proxy.url, "mem-0")
        result = pusher.push_full_in_memory(1, served_name="tiny", stage=staging.stage, release=staging.release)
        in_memory, call1 = _greedy(proxy.url, "mem-1")
        pusher.push_full(2, new_weights, served_name="tiny")
        from_disk, _ = _greedy(proxy.url, "mem-2")
        # The trainer's own weights (untrained: the base model's), staged by its worker.
        with PolicyUpdater(tiny_model_dir, settings) as updater:
            restored_result = pusher.push_full_in_memory(3, served_name="tiny",
                                                         stage=lambda: updater.stage_weights("shm"),
                                                         release=updater.release_weights)
        restored, call3 = _greedy(proxy.url, "mem-3")
    staged = staging.staged
    segment = staged[0].update_info["segment"] if staged[0].update_info else ""
    assert result.pushed == restored_result.pushed == [full_replica.url] and not result.drained
    assert in_memory != before and in_memory == from_disk  # the same numbers as the folder gives
    assert restored == before
    assert (call1["policy_version"], call3["policy_version"]) == (1, 3)
    assert segment and not (Path("/dev/shm") / segment).exists()  # removed once the replica loaded it
    print(f"full push in memory (shm, {staged[0].bytes} bytes): {result.seconds * 1000:.0f} ms, "
          f"of which staging {result.staged_s * 1000:.0f} ms")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_in_memory_push_to_a_replica_without_the_engine_changes_nothing(
        lora_replica: VllmReplica, proxy_for: ProxyFactory) -> None:
    # A replica started without --weight-transfer-config (declared full-weight here) refuses the engine's
    # first call, before anything is staged or paused: it keeps serving, the policy stays.
    staged: list[int] = []
    with proxy_for([lora_replica.url], pool={"weight_mode": "full"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        with pytest.raises(PushError, match="takes no in-memory weights"):
            pusher.push_full_in_memory(1, served_name="tiny", stage=lambda: {"never": staged.append(1)},
                                       release=lambda: None)
        answer, call = _greedy(proxy.url, "no-engine")
        pool = httpx.get(f"{proxy.url}/admin/replicas", headers={"authorization": "Bearer t"}).json()["data"]
    assert staged == [] and answer and call["policy_version"] == 0
    assert [r["url"] for r in pool] == [lora_replica.url]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_replica_failing_the_push_is_drained(lora_replica: VllmReplica, proxy_for: ProxyFactory,
                                               tmp_path: Path) -> None:
    with proxy_for([lora_replica.url], pool={"weight_mode": "lora"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        with pytest.raises(PushError, match="no replica loaded"):
            pusher.push_lora(7, tmp_path / "no-such-adapter")
        pool = httpx.get(f"{proxy.url}/admin/replicas", headers={"authorization": "Bearer t"}).json()["data"]
        policy = pusher.active_policy()
    assert pool == []  # drained (nothing in flight, so removed at once): not left serving v0 silently
    assert policy["version"] == 0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_lora_push_reaches_every_front_end(lora_replica: VllmReplica, lora_replica_b: VllmReplica,
                                             tiny_model_dir: Path, proxy_for: ProxyFactory, tmp_path: Path) -> None:
    # The layout of several vLLM servers behind the proxy: after a push, greedy calls spread over
    # every front end all answer with the new policy, and each front end serves it on its own.
    adapter = _make_adapter(tiny_model_dir, tmp_path / "adapter-v7", seed=3)
    fronts = [lora_replica.url, lora_replica_b.url]
    with proxy_for(fronts, pool={"weight_mode": "lora", "policy": "round_robin"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher:
        before = {_greedy(proxy.url, f"spread-before-{i}")[0] for i in range(4)}
        result = pusher.push_lora(7, adapter, base_model="tiny")
        answers = [_greedy(proxy.url, f"spread-{i}") for i in range(8)]
    direct = {url: httpx.post(f"{url}/v1/chat/completions", json={"model": "policy-v7", **PROMPT}, timeout=120)
              .json()["choices"][0]["message"]["content"] for url in fronts}
    assert sorted(result.pushed) == sorted(fronts) and not result.drained
    assert {call["replica"] for _, call in answers} == set(fronts)  # both front ends answered
    assert {call["policy_version"] for _, call in answers} == {7}
    assert {text for text, _ in answers} == set(direct.values()) and len(set(direct.values())) == 1
    assert before.isdisjoint(direct.values())  # the new policy answers differently from the base model
    print(f"LoRA push to {len(fronts)} front ends: {result.seconds * 1000:.0f} ms")


def test_a_lora_push_as_bytes_reaches_a_replica_that_cannot_see_the_trainers_folders(
        remote_replica: RemoteReplica, lora_replica: VllmReplica, tiny_model_dir: Path, trainer_only_dir: Path,
        adapter_source_port: int, proxy_for: ProxyFactory, db_url: str) -> None:
    # A fresh version per database: the replica keeps what an earlier run of this test loaded.
    version = 21 if db_url.startswith("sqlite") else 22
    adapter = _make_adapter(tiny_model_dir, trainer_only_dir / f"adapter-v{version}", seed=version)
    assert remote_replica.proc is not None
    seen = subprocess.run(["nsenter", "--target", str(remote_replica.proc.pid), "--mount", "ls", "-A",
                           str(trainer_only_dir)], capture_output=True, text=True, check=True).stdout
    assert (adapter / "adapter_config.json").is_file() and seen.strip() == ""  # empty where the replica runs
    by_path = httpx.post(f"{remote_replica.url}/v1/load_lora_adapter", timeout=120,
                         json={"lora_name": f"by-path-v{version}", "lora_path": str(adapter)})
    assert by_path.status_code >= 400  # the path transport cannot reach it
    with proxy_for([remote_replica.url], pool={"weight_mode": "lora"}, port=adapter_source_port,
                   adapter_token=ADAPTER_TOKEN) as proxy, \
            WeightPusher(proxy.url, "t", lora_transport="bytes") as pusher:
        before, _ = _greedy(proxy.url, f"bytes-before-v{version}")
        result = pusher.push_lora(version, adapter, base_model="tiny")
        after, call = _greedy(proxy.url, f"bytes-after-v{version}")
        # A replica that lost the adapter (a restart) fetches it again on its next call.
        httpx.post(f"{proxy.url}/admin/replicas/control", headers={"authorization": "Bearer t"}, timeout=120,
                   json={"url": remote_replica.url, "action": "unload_lora_adapter",
                         "body": {"lora_name": f"policy-v{version}"}}).raise_for_status()
        healed, _ = _greedy(proxy.url, f"bytes-healed-v{version}")
    # The same adapter loaded by path, on a replica that sees the folder, answers the same.
    copy = f"path-copy-v{version}"
    httpx.post(f"{lora_replica.url}/v1/load_lora_adapter", json={"lora_name": copy, "lora_path": str(adapter)},
               timeout=120).raise_for_status()
    try:
        reference = httpx.post(f"{lora_replica.url}/v1/chat/completions", json={"model": copy, **PROMPT},
                               timeout=120).json()["choices"][0]["message"]["content"]
    finally:
        httpx.post(f"{lora_replica.url}/v1/unload_lora_adapter", json={"lora_name": copy}, timeout=120)
    assert result.pushed == [remote_replica.url] and not result.drained
    assert (call["policy_version"], call["served_model"]) == (version, f"policy-v{version}")
    assert after != before and after == reference == healed
    print(f"LoRA push as bytes ({result.uploaded_bytes} bytes, {db_url.split(':')[0]}): "
          f"{result.seconds * 1000:.0f} ms")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_merged_lora_version_serves_on_a_full_weight_replica_as_its_adapter_does(
        lora_replica: VllmReplica, full_replica: VllmReplica, tiny_model_dir: Path, proxy_for: ProxyFactory,
        tmp_path: Path) -> None:
    # `lora_serve = merged`: a LoRA run's versions go out as full weights, the adapter merged in, for
    # replicas without runtime LoRA: from an exported folder, or in memory. The same trained policy
    # served each of the three ways answers alike.
    settings = TrainerSettings(model=str(tiny_model_dir), lora_rank=8, lora_serve="merged", weight_transfer="shm",
                               lr=0.2, ppo_epochs=1, mini_batch_size=4, micro_batch_size=2)
    with PolicyUpdater(tiny_model_dir, settings) as updater:
        updater.update(policy_batch(tiny_model_dir))
        merged = updater.export(tmp_path / "policy-v1")  # the loop's export: its kind is the setting's
        adapter = updater.export(tmp_path / "adapter-v1", kind="lora")
        with proxy_for([full_replica.url], pool={"weight_mode": "full"}) as full, \
                WeightPusher(full.url, "t") as pusher:
            before, _ = _greedy(full.url, "merged-0")
            result = pusher.push_full(1, merged, served_name="tiny")
            from_disk, call = _greedy(full.url, "merged-1")
            pusher.push_full(2, tiny_model_dir, served_name="tiny")
            pusher.push_full_in_memory(3, served_name="tiny", stage=lambda: updater.stage_weights("shm"),
                                       release=updater.release_weights)
            in_memory, _ = _greedy(full.url, "merged-3")
            pusher.push_full(4, tiny_model_dir, served_name="tiny")  # the module's replica back to the base model
    assert updater.export_kind == "full" and (merged / "model.safetensors").is_file()
    assert not (merged / "adapter_config.json").exists()
    with proxy_for([lora_replica.url], pool={"weight_mode": "lora"}) as lora, \
            WeightPusher(lora.url, "t") as pusher:
        pusher.push_lora(31, adapter, base_model="tiny")
        as_adapter, _ = _greedy(lora.url, "adapter-31")
    assert result.pushed == [full_replica.url] and call["policy_version"] == 1
    assert from_disk != before and from_disk == in_memory == as_adapter


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_full_push_reaches_every_api_server_of_a_replica(api_servers_replica: VllmReplica, tiny_model_dir: Path,
                                                           proxy_for: ProxyFactory, tmp_path: Path) -> None:
    # Several API servers share one engine: a push through any of them (the proxy drives one) must
    # change what all of them serve. Greedy calls spread over both after each push, from a folder and
    # in memory, all answer with the pushed weights.
    new_weights = _perturbed_model(tiny_model_dir, tmp_path / "full-v1")
    staging = _ShmStaging(new_weights)

    rounds: dict[str, tuple[set[str], set[str], set[int]]] = {}
    with proxy_for([api_servers_replica.url], pool={"weight_mode": "full"}) as proxy, \
            WeightPusher(proxy.url, "t") as pusher, ThreadPoolExecutor(8) as pool:

        def spread(name: str) -> None:
            # Until both API servers have answered, at most 12 waves. Each connection goes to one of them
            # (whichever process accepts it first), and the proxy keeps its connections: once a round's were
            # all taken by one API server (CI, once), only new ones can reach the other. So from the fourth
            # wave on, each waits out the API servers' keep-alive (5 s) first: they close the proxy's idle
            # connections, and the wave opens new ones.
            offset, answers, versions = api_servers_replica.log_size(), set(), set()
            for wave in range(12):
                if wave >= 3:
                    time.sleep(6)
                calls = list(pool.map(_greedy, [proxy.url] * 8, [f"{name}-{wave}-{i}" for i in range(8)]))
                answers |= {text for text, _ in calls}
                versions |= {call["policy_version"] for _, call in calls}
                if len(api_servers_replica.front_ends_served(offset, "chat/completions")) == 2:
                    break
            rounds[name] = (api_servers_replica.front_ends_served(offset, "chat/completions"), answers, versions)

        spread("before")
        disk = pusher.push_full(1, new_weights, served_name="tiny")
        spread("disk")
        pusher.push_full(2, tiny_model_dir, served_name="tiny")
        spread("restored")
        memory = pusher.push_full_in_memory(3, served_name="tiny", stage=staging.stage, release=staging.release)
        spread("memory")
        pusher.push_full(4, tiny_model_dir, served_name="tiny")  # the module's replica back to the base model
    assert disk.pushed == memory.pushed == [api_servers_replica.url] and not disk.drained
    both = {"ApiServer_0", "ApiServer_1"}
    for name, (fronts, answers, _) in rounds.items():
        assert fronts == both, f"{name}: calls reached only {fronts}"
        assert len(answers) == 1, f"{name}: the API servers answered differently: {answers}"
    (before,), (from_disk,), (restored,), (in_memory,) = (rounds[n][1] for n in ("before", "disk", "restored", "memory"))
    assert from_disk != before and restored == before and in_memory == from_disk
    assert [rounds[n][2] for n in ("before", "disk", "restored", "memory")] == [{0}, {1}, {2}, {3}]
    print(f"full push to one engine behind 2 API servers: disk {disk.seconds * 1000:.0f} ms, "
          f"in memory {memory.seconds * 1000:.0f} ms")
