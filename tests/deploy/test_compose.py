"""The compose `cpu` profile with the scaled proxies, running for real: calls through nginx recorded once
by two proxies, recording, a trainer step, the new policy served, a clean down.

`.ci/run` brings the stack up first (`deploy/offline/ci.sh up`: docker-compose.yml with
docker-compose.scaled.yml, two proxies behind nginx); these tests drive it from the host through
nginx's published port, as a user's agent would, and read PostgreSQL inside its container.
The last test takes the stack down (`docker compose down` under load) and checks that no acknowledged
call was lost. Without a running stack they are skipped, except under `CI=true`, where a missing stack
is a failure. This module sits in `tests/deploy/` so pytest runs it before the rest of the suite, which
then gets the machine back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from examples.agent import Task, run_attempt

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = Path(os.environ.get("ROLLTAP_COMPOSE_ENV_FILE", ".rolltap/compose-ci.env"))
GROUP_SIZE = 4  # deploy/trainer-cpu.toml's trainer.group_size


@dataclass(frozen=True)
class Stack:
    url: str
    agent_key: str
    admin_token: str


def _compose(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    env_file = ENV_FILE if ENV_FILE.is_absolute() else ROOT / ENV_FILE
    cmd = ["docker", "compose", "--env-file", str(env_file), "-f", "docker-compose.yml", "-f",
           "docker-compose.scaled.yml", "--profile", "cpu", *args]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def _sql(query: str) -> str:
    """One value from PostgreSQL inside the stack (psql over the container's local socket)."""
    out = _compose("exec", "-T", "postgres", "psql", "-U", "rolltap", "-d", "rolltap", "-At", "-c", query)
    return out.stdout.strip()


def _absent(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}: .ci/run brings the stack up with `deploy/offline/ci.sh up`")
    pytest.skip(f"{reason}; `deploy/offline/ci.sh up` (root, a Docker engine) starts it")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        _absent("no Docker engine is running")
    env_file = ENV_FILE if ENV_FILE.is_absolute() else ROOT / ENV_FILE
    if not env_file.is_file():
        _absent(f"no compose env file at {env_file}")
    if not _compose("ps", "--status", "running", "-q", "nginx-cpu", check=False).stdout.strip():
        _absent("the compose cpu profile (scaled) is not running")
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line and line[0] != "#")
    yield Stack(f"http://127.0.0.1:{values['ROLLTAP_PORT']}", values["ROLLTAP_PROXY__AGENT_KEY"],
                values["ROLLTAP_PROXY__ADMIN_TOKEN"])


def _policy(stack: Stack) -> dict[str, object]:
    out = httpx.get(f"{stack.url}/admin/policy", headers={"authorization": f"Bearer {stack.admin_token}"}, timeout=30)
    out.raise_for_status()
    return dict(out.json())


def _served_by_replica(service: str) -> list[str]:
    script = ("import json, urllib.request; "
              "print(json.dumps([m['id'] for m in json.load(urllib.request.urlopen("
              "'http://127.0.0.1:8000/v1/models'))['data']]))")
    return list(json.loads(_compose("exec", "-T", service, "python3", "-c", script).stdout))


def test_calls_through_nginx_land_on_both_proxies_and_are_recorded_once(stack: Stack) -> None:
    rollout = f"lb-{uuid.uuid4().hex[:10]}"
    upstreams: set[str] = set()
    call_ids: list[str] = []
    auth = {"authorization": f"Bearer {stack.agent_key}"}
    with httpx.Client(timeout=60) as http:
        for i in range(8):  # a new connection each: nginx round-robins requests over the proxies
            body = {"model": "policy", "max_tokens": 4, "stream": i % 2 == 1,
                    "messages": [{"role": "user", "content": f"lb {i}"}]}
            r = http.post(f"{stack.url}/rollout/{rollout}/attempt/a{i % 2}/v1/chat/completions", json=body,
                          headers={**auth, "connection": "close"})
            assert r.status_code == 200, r.text
            upstreams.add(r.headers["x-rolltap-upstream"])
            call_ids.append(r.headers["x-rolltap-call-id"])
        for attempt in ("a0", "a1"):  # `finish` through nginx: a barrier over both proxies
            done = http.post(f"{stack.url}/rollout/{rollout}/attempt/{attempt}/finish", json={"status": "succeeded"},
                             headers=auth)
            assert done.status_code == 200, done.text
    assert len(upstreams) == 2, upstreams
    assert int(_sql("select count(*) from proxies")) >= 2  # both proxies (each with its workers) are members
    rows = _sql(f"select call_id from calls where rollout_id = '{rollout}'").split()
    assert sorted(rows) == sorted(call_ids)  # every call once, whichever proxy took it


def test_a_group_is_recorded_trained_on_and_the_new_policy_served(stack: Stack) -> None:
    before = _policy(stack)
    rollout = f"ci-{uuid.uuid4().hex[:10]}"
    task = Task(3, 4)
    # One GRPO group from the host, through the proxy, with the agent key as a Bearer token.
    for i in range(GROUP_SIZE):
        run_attempt(stack.url, rollout, f"a{i}", task, turns=2, stream=i % 2 == 0, api_key=stack.agent_key)

    # Every call is in PostgreSQL with its token ids and logprobs.
    calls = _sql(f"select count(*), count(prompt_token_ids), count(completion_token_ids), "
                 f"count(completion_logprobs), min(json_array_length(completion_token_ids::json)) "
                 f"from calls where rollout_id = '{rollout}'")
    total, prompts, completions, logprobs, shortest = (int(x) for x in calls.split("|"))
    assert (total, prompts, completions, logprobs) == (2 * GROUP_SIZE,) * 4
    assert shortest >= 1

    # The trainer (its own container) trains on the group and pushes a new LoRA version.
    deadline = time.monotonic() + 600
    while True:
        step = _sql(f"select s.step, s.policy_version from training_step_attempts t "
                    f"join attempts a on a.id = t.attempt_pk join training_steps s on s.step = t.step "
                    f"where a.rollout_id = '{rollout}' limit 1")
        policy = _policy(stack)
        if step and int(policy["version"] or 0) > int(before["version"] or 0):
            break
        assert time.monotonic() < deadline, f"no trainer step on {rollout} (policy {policy})"
        time.sleep(2)
    served = str(policy["served_name"])
    # Both CPU replicas serve the new version, and the proxy routes new calls to it.
    for replica in ("vllm-cpu-0", "vllm-cpu-1"):
        assert served in _served_by_replica(replica), replica
    after = f"{rollout}-after"
    run_attempt(stack.url, after, "a0", task, turns=1, stream=False, api_key=stack.agent_key)
    recorded = _sql(f"select policy_version, served_model from calls where rollout_id = '{after}'")
    assert recorded == f"{policy['version']}|{served}"


def test_compose_down_under_load_loses_no_acknowledged_call(stack: Stack) -> None:
    rollout = f"load-{uuid.uuid4().hex[:10]}"
    acknowledged: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def agent(worker: int) -> None:
        client = openai.OpenAI(base_url=f"{stack.url}/rollout/{rollout}/attempt/w{worker}/v1",
                               api_key=stack.agent_key, max_retries=0, timeout=60)
        n = 0
        while not stop.is_set():
            call = f"w{worker}-{n}"
            try:
                out = client.chat.completions.create(model="policy", max_tokens=8,
                                                     messages=[{"role": "user", "content": call}])
            except openai.APIError:
                return  # the proxy stopped accepting: nothing acknowledged from here on
            assert out.choices
            with lock:
                acknowledged.append(call)
            n += 1

    workers = [threading.Thread(target=agent, args=(w,)) for w in range(4)]
    for t in workers:
        t.start()
    time.sleep(3)
    assert acknowledged, "no call succeeded before the stop"
    # Each service gets its own stop_grace_period (the proxy 45 s); volumes stay: the records are read back.
    down = _compose("down", timeout=300)
    stop.set()
    for t in workers:
        t.join(timeout=120)
    assert "Removed" in down.stderr + down.stdout

    try:
        _compose("up", "-d", "--wait", "postgres", timeout=300)
        # Each call's message is its own name: the acknowledged ones must all be there, answered.
        recorded = set(_sql(f"select request->'messages'->0->>'content' from calls "
                            f"where rollout_id = '{rollout}' and status = 'ok' "
                            f"and completion_token_ids is not null").split())
        missing = [c for c in acknowledged if c not in recorded]
        assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged calls not recorded: {missing[:5]}"
    finally:
        _compose("down", "-v", "-t", "30", timeout=300, check=False)
