"""The main job, on an embedded default: one CPU vLLM replica, the proxy on SQLite, an agent.

    make demo            (or: .venv/bin/python -m scripts.demo)

Builds a tiny model (no hub), starts a real vLLM replica and the real `rolltap-proxy`
command, runs a few multi-turn rollouts through the templated URL with the plain
`openai` SDK (several attempts per task: a GRPO group each), then prints what was
recorded: per attempt, its calls in order with token counts and logprobs, and rewards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from examples.agent import Task, run_attempt
from tools.replica import VllmReplica
from tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"rolltap-proxy exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("rolltap-proxy did not become ready")


def _print_attempt(attempt: dict) -> None:  # type: ignore[type-arg]
    rewards = ", ".join(f"{r['name'] or 'reward'}={r['value']:g}" for r in attempt["rewards"]) or "none"
    print(f"  attempt {attempt['rollout_id']}/{attempt['attempt_id']}  status={attempt['status']}  "
          f"policy v{attempt['policy_version']}  rewards: {rewards}")
    for call in attempt["calls"]:
        prompt, completion = call["prompt_token_ids"] or [], call["completion_token_ids"] or []
        logprobs = call["completion_logprobs"] or []
        reply = (call["response"] or {}).get("choices", [{}])[0].get("message", {}).get("content", "")
        print(f"    #{call['seq']} {call['route']:<17} {call['status']:<3} stream={call['is_streaming']!s:<5} "
              f"prompt={len(prompt):>3} tok  completion={len(completion):>3} tok  "
              f"sum logprob={sum(lp for lp in logprobs if lp is not None):7.2f}  replica={call['replica']}")
        print(f"       ids {completion[:8]}{'...' if len(completion) > 8 else ''}  text {reply[:48]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--attempts", type=int, default=2, help="attempts per task (a GRPO group)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workdir", type=Path, default=ROOT / ".rolltap" / "demo")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    db_path = args.workdir / "rolltap.db"
    for suffix in ("", "-wal", "-shm"):
        Path(str(db_path) + suffix).unlink(missing_ok=True)
    shutil.rmtree(args.workdir / "spool", ignore_errors=True)

    print("building a tiny model (no hub) ...", flush=True)
    model = build_tiny_model(ROOT / ".rolltap" / "models" / "tiny")
    print("starting a CPU vLLM replica (about a minute) ...", flush=True)
    with VllmReplica(model, served_model_name="tiny") as replica:
        replica.wait_healthy(600)
        proxy_url = f"http://127.0.0.1:{args.port}"
        env = {**os.environ, "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(args.workdir / "spool")}
        exe = str(Path(sys.executable).parent / "rolltap-proxy")
        # The proxy is closed: agents need a key. Made here with the CLI; shown once, stored hashed.
        created = subprocess.run([exe, "keys", "--db", f"sqlite:///{db_path}", "create", "--name", "demo",
                                  "--rollout-prefix", "task-"], env=env, check=True, capture_output=True, text=True)
        api_key = created.stdout.split("key: ", 1)[1].split()[0]
        print("created an agent key for rollouts task-* (rolltap-proxy keys create)", flush=True)
        cmd = [exe, "--replica", replica.url, "--db", f"sqlite:///{db_path}", "--host", "127.0.0.1",
               "--port", str(args.port)]
        print("starting:", " ".join(cmd), flush=True)
        proxy = subprocess.Popen(cmd, env=env)
        try:
            _wait_ready(proxy_url, proxy)
            tasks = {f"task-{i}": Task(3 + i, 4 + 2 * i) for i in range(args.tasks)}
            jobs = [(rid, str(k), task) for rid, task in tasks.items() for k in range(args.attempts)]
            with ThreadPoolExecutor(max_workers=8) as pool:
                rewards = list(pool.map(lambda j: run_attempt(proxy_url, j[0], j[1], j[2], api_key=api_key,
                                                              stream=int(j[1]) % 2 == 0),
                                        jobs))
            print(f"\n{len(jobs)} attempts finished, mean reward {sum(rewards) / len(rewards):.2f}. Recorded:")
            for rid, aid, _ in jobs:
                _print_attempt(httpx.get(f"{proxy_url}/rollout/{rid}/attempt/{aid}", timeout=30,
                                         headers={"authorization": f"Bearer {api_key}"}).json())
            print(f"\ndatabase: {db_path}")
        finally:
            proxy.terminate()
            proxy.wait(timeout=60)


if __name__ == "__main__":
    main()
