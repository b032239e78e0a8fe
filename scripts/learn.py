"""The whole loop on CPU, measured: agent -> proxy -> two vLLM replicas -> trainer -> weight push.

    .venv/bin/python -m scripts.learn [--steps 40] [--minutes 15] [--out docs/learning.md]

A tiny model made on the spot learns `examples/letter_task.py` (write text full of the
letter "e"). Per policy version the driver runs `groups` tasks x `group_size` attempts
through the proxy with the plain `openai` SDK, then waits for the trainer (the real
`rolltap-trainer run --config`, a separate process) to train on them and push the next
LoRA version to both replicas. The reward curve and step timings are written to `--out`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select

from examples.letter_task import LetterTask, run_attempt
from shared.db.models import TrainingStep
from tools.replica import start_replicas
from tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "learn-token"
TOPICS = ["the sea", "trees", "a green field", "the weekend", "cheese", "three geese", "the street", "sleep"]

TRAINER_CONFIG = """\
[db]
url = "{db}"

[trainer]
model = "{model}"
checkpoint_dir = "{ckpt}"
max_steps = {steps}
group_size = {group_size}
groups_per_step = {groups}
min_groups_per_step = {groups}
max_staleness = 1
proxy_url = "{proxy}"
admin_token = "{token}"
mini_batch_size = {mini_batch}
micro_batch_size = {micro_batch}
lr = {lr}
lora_rank = 8
lora_alpha = 16
kl_coef = 0.0
"""


def _wait(predicate: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def _active_version(proxy_url: str) -> int:
    policy = httpx.get(f"{proxy_url}/admin/policy", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return int(policy["version"] or 0)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--minutes", type=float, default=15.0, help="time budget for the training part")
    parser.add_argument("--groups", type=int, default=4, help="tasks per step")
    parser.add_argument("--group-size", type=int, default=8, help="attempts per task (a GRPO group)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--workdir", type=Path, default=ROOT / ".rolltap" / "learn")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "learning.md")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    model = build_tiny_model(ROOT / ".rolltap" / "models" / "tiny")
    db = f"sqlite:///{args.workdir / 'rolltap.db'}"
    proxy_url = f"http://127.0.0.1:{args.port}"
    bin_dir = Path(sys.executable).parent
    print("starting two CPU vLLM replicas with runtime LoRA ...", flush=True)
    replicas = start_replicas(2, model, served_model_name="tiny", enable_lora=True, timeout_s=900)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "ROLLTAP_PROXY__ADMIN_TOKEN": TOKEN, "ROLLTAP_PROXY__POOL__WEIGHT_MODE": "lora",
               "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(args.workdir / "spool")}
        cmd = [str(bin_dir / "rolltap-proxy"), "--db", db, "--port", str(args.port)]
        for r in replicas:
            cmd += ["--replica", r.url]
        proxy_log = open(args.workdir / "proxy.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(cmd, env=env, stdout=proxy_log, stderr=subprocess.STDOUT))
        _wait(lambda: _ready(proxy_url), 120, "the proxy", procs[-1])

        mini_batch = args.groups * args.group_size
        config = args.workdir / "trainer.toml"
        config.write_text(TRAINER_CONFIG.format(
            db=db, model=model, ckpt=args.workdir / "checkpoints", steps=args.steps, group_size=args.group_size,
            groups=args.groups, proxy=proxy_url, token=TOKEN, mini_batch=mini_batch, micro_batch=mini_batch // 2,
            lr=args.lr))
        trainer_log = open(args.workdir / "trainer.log", "wb")  # noqa: SIM115
        trainer = subprocess.Popen([str(bin_dir / "rolltap-trainer"), "run", "--config", str(config)],
                                   env=env, stdout=trainer_log, stderr=subprocess.STDOUT)
        procs.append(trainer)

        curve: list[dict[str, Any]] = []
        started = time.monotonic()
        deadline = started + args.minutes * 60
        version = _active_version(proxy_url)
        with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64)) as http, \
                ThreadPoolExecutor(max_workers=16) as pool:
            while version < args.steps and time.monotonic() < deadline:
                t = time.monotonic()
                jobs = [(f"v{version}-t{g}", str(k), LetterTask("e", TOPICS[(version + g) % len(TOPICS)]))
                        for g in range(args.groups) for k in range(args.group_size)]
                rewards = list(pool.map(lambda j: run_attempt(proxy_url, j[0], j[1], j[2], http=http), jobs))
                rollout_s = time.monotonic() - t
                _wait(lambda: _active_version(proxy_url) > version, 600, "the trainer's next version", trainer)
                curve.append({"version": version, "reward": statistics.fmean(rewards),
                              "rollout_s": rollout_s, "cycle_s": time.monotonic() - t})
                print(f"policy v{version}: mean reward {curve[-1]['reward']:.3f} "
                      f"({len(rewards)} attempts, cycle {curve[-1]['cycle_s']:.1f}s)", flush=True)
                version = _active_version(proxy_url)
        elapsed_min = (time.monotonic() - started) / 60
        trainer.terminate()
        trainer.wait(timeout=120)
        engine = create_engine(db.replace("sqlite:///", "sqlite:///"))
        with engine.connect() as conn:
            steps = [(int(step), metrics) for step, metrics in conn.execute(
                select(TrainingStep.step, TrainingStep.metrics).order_by(TrainingStep.step)).all()]
        engine.dispose()
        _write_report(args, curve, steps, elapsed_min)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for r in replicas:
            r.stop()


def _write_report(args: argparse.Namespace, curve: list[dict[str, Any]], steps: list[tuple[int, Any]],
                  elapsed_min: float) -> None:
    rewards = [c["reward"] for c in curve]
    first5, last5 = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    passed = last5 >= 2 * first5 or last5 > 0.9
    lines = [
        "# Learning on CPU, through the whole loop (scripts/learn.py)",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on the 2-core, no-GPU machine: a tiny Qwen2 made on the spot "
        "(347K parameters), two CPU vLLM replicas with runtime LoRA, the proxy on SQLite, the trainer "
        "(`rolltap-trainer run --config`, verl GRPO with LoRA rank 8) and the agent "
        "(`examples/letter_task.py`, plain `openai` SDK).",
        f"Command: `.venv/bin/python -m scripts.learn --steps {args.steps} --minutes {args.minutes:g} "
        f"--groups {args.groups} --group-size {args.group_size} --lr {args.lr:g}`",
        "",
        f"- policy versions trained and served: {len(curve)} in {elapsed_min:.1f} min",
        f"- mean reward, first five versions: {first5:.3f}; last five: {last5:.3f} "
        f"(x{last5 / first5 if first5 else float('inf'):.2f})",
        f"- target (last five >= 2x first five, or > 0.9, within 15 min): **{'met' if passed else 'NOT met'}**",
        "",
        "| policy version | mean reward of its attempts | rollout s | cycle s | trainer step | loss | grad norm | "
        "update s | push s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_step = dict(steps)
    for c in curve:
        m = by_step.get(c["version"] + 1) or {}

        def f(key: str, fmt: str = ".3f", m: dict[str, Any] = m) -> str:
            value = m.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) else "-"

        lines.append(f"| {c['version']} | {c['reward']:.3f} | {c['rollout_s']:.1f} | {c['cycle_s']:.1f} | "
                     f"{c['version'] + 1} | {f('loss', '.4f')} | {f('grad_norm')} | {f('update_s', '.2f')} | "
                     f"{f('push_s', '.2f')} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:9]))


if __name__ == "__main__":
    main()
