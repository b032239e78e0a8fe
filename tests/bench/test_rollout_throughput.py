"""Server groups and path targets of bench.rollout_throughput (the layouts of docs/gpu-results.md "At scale")."""

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.rollout_throughput import _group, _server_spec, _slug, _target, _vllm_processes
from bench.throughput_report import baselines

GROUPS = {"a": ["http://h:1"], "c": ["http://h:2", "http://h:3", "http://h:4"]}


def test_server_spec_reads_count_and_api_servers() -> None:
    assert _server_spec("a=1x4") == ("a", (1, 4))
    assert _server_spec("c=3") == ("c", (3, 1))
    for bad in ("c", "=3", "c=x4", "c=3xx"):
        with pytest.raises(SystemExit):
            _server_spec(bad)


def test_target_picks_a_group_or_its_first_servers() -> None:
    assert _target("direct@a", GROUPS) == ("direct", ["http://h:1"])
    assert _target("proxy_on@c:1", GROUPS) == ("proxy_on", ["http://h:2"])
    assert _target("proxy_on@c", GROUPS) == ("proxy_on", GROUPS["c"])
    assert _target("direct", GROUPS) == ("direct", ["http://h:1", *GROUPS["c"]])
    with pytest.raises(SystemExit):
        _target("direct@b", GROUPS)


def test_rollout_ids_and_baselines_of_grouped_paths() -> None:
    assert _slug("proxy_on@c:1") == "proxy_on-c-1"
    paths = ["direct@a", "direct@c", "direct_same_ask", "proxy_on@c:1", "proxy_on@c"]
    assert baselines(paths) == ["direct@a", "direct@c", "direct_same_ask"]


def test_a_path_names_its_group() -> None:
    assert [_group(p) for p in ("direct@l", "proxy_on@l:1", "direct")] == ["l", "l", ""]


@pytest.mark.vllm
def test_a_lora_group_serves_the_pushed_adapter_on_every_front_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Two CPU servers with runtime LoRA behind the proxy and one without: the pushes go through the
    # proxy, the check proves both front ends serve the last, and then the group's direct calls ask
    # for the adapter by name (a name no front end had loaded would fail every call) and the proxy's
    # calls are rewritten to it. A warm-up of 6 s: on a busy 2-core machine a server's first calls
    # of a window took longer than 1 s of warm-up and 3 s of window together (no call, no token).
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-m", "bench.rollout_throughput", "--start-replica", str(tiny_model_dir),
                    "--model", "tiny", "--dtype", "float32", "--server", "p=1", "--server", "l=2", "--lora-group", "l",
                    "--paths", "direct@p,direct@l,proxy_on@l", "--loads", "2", "--rounds", "1", "--window-s", "4",
                    "--warmup-s", "6", "--max-tokens", "8", "--procs", "2", "--db", f"sqlite:///{tmp_path}/{{name}}.db",
                    "--lora-db", f"sqlite:///{tmp_path}/lora.db", "--logs", str(tmp_path / "logs"), "--out", str(out)],
                   check=True, timeout=900)
    result = json.loads(out.read_text())
    push = result["lora_push"]
    assert push["ok"] and all(push["checks"].values()) and len(push["push_s"]) == 3
    assert len(push["served_by"]) == 2 and all(s > 0 for s in push["push_s"])
    windows = {w["path"]: w for w in result["windows"]}
    assert set(windows) == {"direct@p", "direct@l", "proxy_on@l"}
    assert all(w["errors"] == 0 and w["delivered_tokens_per_s"] > 0 for w in windows.values())
    with sqlite3.connect(tmp_path / "lora.db") as db:  # the proxy's calls were served by the last version
        versions = {v for (v,) in db.execute("SELECT DISTINCT policy_version FROM calls WHERE rollout_id LIKE 'bench-%'")}
    assert versions == {3}


def test_a_servers_engine_core_and_first_api_server_are_found_by_their_titles() -> None:
    # vLLM titles its processes (`VLLM::EngineCore`, `VLLM::ApiServer_<k>`): stand-ins titled alike.
    server = subprocess.Popen(["bash", "-c", "(exec -a VLLM::EngineCore sleep 30) & (exec -a VLLM::ApiServer_0 sleep 30) & "
                               "(exec -a VLLM::ApiServer_1 sleep 30) & wait"])
    try:
        for _ in range(50):
            found = _vllm_processes(server.pid)
            if len(found) == 2:
                break
            time.sleep(0.1)
        titles = {name: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for name, pid in found.items()}
        assert titles == {"replica_engine": b"VLLM::EngineCore", "replica_api0": b"VLLM::ApiServer_0"}
    finally:
        subprocess.run(["pkill", "-P", str(server.pid)], check=False)
        server.kill()
        server.wait()
