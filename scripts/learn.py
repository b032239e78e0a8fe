"""The whole loop on CPU, measured: agent -> proxy -> vLLM replicas -> trainer -> weight push.

    .venv/bin/python -m scripts.learn [--steps 40] [--minutes 60] [--out docs/learning.md]

By default a tiny model made on the spot learns `examples/letter_task.py` (write text full
of the letter "b": the tiny tokenizer has two tokens made only of it and one that is half
"b", where "e" has one and eighteen half-"e" tokens that trapped runs; docs/learning.md). `--model-dir` serves and trains another local HF model directory
instead (e.g. SmolLM2-135M-Instruct converted from its GGUF, see docs/learning-smollm2.md),
and `--task arithmetic` asks single-turn "What is A + B? Answer with just the number."
questions scored by `examples.agent.score` (1.0 when the first number in the reply is A+B).
`--task calculator` trains a multi-turn agent written with the OpenAI Agents SDK
(`examples/agents_sdk_agent.py`): it calls an `add` tool, reads its answer and replies
(`examples.calculator.answer_score`: 1.0 for just the sum, 0.5 for the sum at the end of a
longer reply); a held-out set is scored greedily at version 0, every `--eval-every` versions
and at the last one, its attempts finished without a reward (recorded, never trained on).

Per policy version the driver runs `groups` tasks x `group_size` attempts through the proxy
with the plain `openai` SDK, then waits for the trainer (the real `rolltap-trainer run
--config`, a separate process) to train on them and push the next version to the replicas: a
LoRA adapter (`--lora-rank N`, runtime LoRA replicas), the LoRA-trained policy merged into full
weights (`--lora-serve merged`), or, with `--lora-rank 0`, full weights (replicas reload those
two with admission paused). The reward curve, step time and its phases are written to `--out`.

A run is budgeted in policy versions (`--steps`): a slow or loaded machine takes longer
rather than stopping early; `--minutes` is only a safety cap, and the report says when it
ended the run. The machine's load average is sampled during the run and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import secrets
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
from sqlalchemy import create_engine, select

from examples import agents_sdk_agent
from examples.agent import Task as ArithmeticTask
from examples.agent import score as arithmetic_score
from examples.calculator import Task as CalculatorTask
from examples.calculator import answer_score
from examples.letter_task import LetterTask, run_attempt
from examples.tool_template import REPLICA_ENV, replica_args
from scripts.agent_report import Score, attempt_samples, interval, plot_agent, row_markdown
from shared.db.engine import sync_url
from shared.db.models import Attempt as AttemptModel
from shared.db.models import TrainingStep, TrainingStepAttempt
from shared.settings import TrainerSettings
from trainer.plot import plot_steps
from tools.replica import VllmReplica, start_replicas
from tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "learn-token"
AGENT_KEY = "rk-" + secrets.token_urlsafe(32)  # the proxy's agent key for this run (proxy.agent_key)
TOPICS = ["the sea", "trees", "a green field", "the weekend", "cheese", "three geese", "the street", "sleep"]
PHASES = ("read_s", "update_s", "save_s", "push_s")
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

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
seed = {seed}
proxy_url = "{proxy}"
admin_token = "{token}"
mini_batch_size = {mini_batch}
micro_batch_size = {micro_batch}
lr = {lr}
lora_rank = {lora_rank}
lora_alpha = {lora_alpha}
lora_serve = "{lora_serve}"
kl_coef = {kl_coef}
ppo_epochs = {ppo_epochs}
entropy_coeff = {entropy_coeff}
clip_ratio_low = {clip_low}
clip_ratio_high = {clip_high}
norm_adv_by_std_in_grpo = {norm_adv}
credit = "{credit}"
gamma = {gamma}
"""

# The trainer's per-step log line (trainer/loop.py `_log_step`): the full step time and the
# push time are only there, because the step is committed to the database before the push.
STEP_LINE = re.compile(
    r"step (\d+) \|.*\| ([\d.]+)s \(read ([\d.]+|-), update ([\d.]+|-), save ([\d.]+|-), push ([\d.]+|-)\)"
)


@dataclass
class Attempt:
    reward: float
    reply: str | None = None
    completion_tokens: int | None = None
    truncated: bool | None = None
    calls: int | None = None  # model calls in the episode (calculator)
    valid_calls: int | None = None  # of its tool calls, those asking the question's numbers
    tool_calls: int | None = None


@dataclass
class Memory:
    """Peak memory and the load average (1 min) seen by a background sampler (every 2 s)."""

    pids: dict[str, list[str]] = field(default_factory=dict)  # label -> `ps` selectors: "-g SID" or "-p PID"
    peak_used_gb: float = 0.0
    peak_rss_gb: dict[str, float] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kb = {k: int(v.split()[0]) for k, v in info.items() if v.strip().endswith("kB")}
        self.peak_used_gb = max(self.peak_used_gb, (kb["MemTotal"] - kb["MemAvailable"]) / 2**20)
        self.loads.append(os.getloadavg()[0])
        for label, pgids in list(self.pids.items()):  # the driver adds the trainer while this runs
            total = sum(_rss_kb(p) for p in pgids) / 2**20
            self.peak_rss_gb[label] = max(self.peak_rss_gb.get(label, 0.0), total)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(2.0):
                try:
                    self.sample()
                except (OSError, ValueError):
                    pass

        threading.Thread(target=loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def _rss_kb(selector: str) -> int:
    out = subprocess.run(["ps", "-o", "rss=", *selector.split()], capture_output=True, text=True).stdout
    return sum(int(x) for x in out.split())


def _wait(predicate: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def _active_version(proxy_url: str, tries: int = 5) -> int:
    # A proxy on a machine under heavy load (several demos at once) can take longer than a
    # timeout to answer; a demo should wait it out, not die.
    for attempt in range(tries):
        try:
            policy = httpx.get(f"{proxy_url}/admin/policy", headers={"authorization": f"Bearer {TOKEN}"},
                               timeout=30).json()
            return int(policy["version"] or 0)
        except httpx.TransportError:
            if attempt == tries - 1:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def arithmetic_task(version: int, group: int, max_operand: int = 20) -> ArithmeticTask:
    """The group's question: A and B in 1..max_operand, fixed by (version, group) so a run can be repeated."""
    rng = random.Random(version * 1000 + group)
    return ArithmeticTask(rng.randint(1, max_operand), rng.randint(1, max_operand))


def arithmetic_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: ArithmeticTask, *,
                       max_tokens: int, http: httpx.Client, temperature: float = 1.0) -> Attempt:
    """One single-turn attempt: ask, score with `examples.agent.score`, report the reward with `finish`."""
    base_url = f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    # openai accepts an `httpx.Client` (its check takes the legacy client) but types only its own httpx2 one.
    client = openai.OpenAI(base_url=base_url, api_key=AGENT_KEY, max_retries=3, http_client=http)  # type: ignore[arg-type]
    out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.question}],
                                         max_tokens=max_tokens, temperature=temperature)
    reply = out.choices[0].message.content or ""
    reward = arithmetic_score(task, reply)
    http.post(f"{proxy_url}/rollout/{rollout_id}/attempt/{attempt_id}/finish",
              json={"status": "succeeded", "reward": reward},
              headers={"authorization": f"Bearer {AGENT_KEY}"}).raise_for_status()
    return Attempt(reward, reply, out.usage.completion_tokens if out.usage else None,
                   out.choices[0].finish_reason == "length")


def calculator_task(version: int, group: int, max_operand: int) -> CalculatorTask:
    """The group's question, A and B in 10..max_operand, fixed by (version, group)."""
    rng = random.Random(version * 1000 + group)
    return CalculatorTask(rng.randint(10, max_operand), rng.randint(10, max_operand))


def held_out_tasks(n: int, max_operand: int, training: set[CalculatorTask]) -> list[CalculatorTask]:
    """`n` questions from a seed stream of their own, none of them a training question of this run."""
    rng = random.Random(7_777_777)
    out: list[CalculatorTask] = []
    while len(out) < n:
        task = CalculatorTask(rng.randint(10, max_operand), rng.randint(10, max_operand))
        if task not in training and task not in out:
            out.append(task)
    return out


def calculator_attempt(proxy_url: str, rollout_id: str, attempt_id: str, task: CalculatorTask, *, max_tokens: int,
                       temperature: float, seed: int | None, train: bool = True) -> Attempt:
    """One episode of the Agents SDK agent; finished with its reward, or (held out) without one."""
    episode = agents_sdk_agent.play(proxy_url, rollout_id, attempt_id, task, AGENT_KEY, api="chat",
                                    temperature=temperature, max_tokens=max_tokens, seed=seed,
                                    reward=answer_score if train else None)
    score = episode.reward if train else answer_score(task, episode.answer)
    return Attempt(score, episode.answer, calls=episode.calls, valid_calls=episode.valid_calls(task),
                   tool_calls=len(episode.tool_arguments))


def _episode_stats(attempts: list[Attempt]) -> dict[str, float | None]:
    """Calls per episode and the share of tool calls that asked the question's numbers."""
    calls = [a.calls for a in attempts if a.calls is not None]
    tools = sum(a.tool_calls or 0 for a in attempts)
    return {"calls": statistics.fmean(calls) if calls else None,
            "valid": sum(a.valid_calls or 0 for a in attempts) / tools if tools else None}


def _safetensors_params(model_dir: Path) -> int | None:
    """Parameter count from the safetensors headers (no torch needed)."""
    total = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total if files else None


def _request_seed(seed: int, rollout_id: str, attempt_id: str) -> int:
    """A per-attempt sampling seed: reproducible for one --seed, different across attempts of a group."""
    return zlib.crc32(f"{seed}/{rollout_id}/{attempt_id}".encode()) & 0x7FFFFFFF


def _parse_trainer_log(path: Path) -> dict[int, dict[str, float]]:
    def num(s: str) -> float | None:
        return None if s == "-" else float(s)

    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = STEP_LINE.search(line)
        if m:
            values = dict(zip(("step_time_s", *PHASES), map(num, m.groups()[1:]), strict=True))
            steps[int(m.group(1))] = {k: v for k, v in values.items() if v is not None}
    return steps


def _adapters_served(args: argparse.Namespace) -> bool:
    """Whether replicas serve pushed adapters (runtime LoRA), else full weights (trained, or merged)."""
    return bool(args.lora_rank) and args.lora_serve == "adapter"


def _weights(args: argparse.Namespace) -> str:
    if _adapters_served(args):
        return "runtime LoRA"
    return "full-weight reloads (LoRA merged)" if args.lora_rank else "full-weight reloads"


def _trained(args: argparse.Namespace) -> str:
    return (f"LoRA rank {args.lora_rank} alpha {args.lora_alpha} (all linear layers)" if args.lora_rank
            else "full weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock cap on the training part (a "
                        "safety net: the run is budgeted by --steps, so a loaded machine takes longer)")
    parser.add_argument("--groups", type=int, default=4, help="tasks per step")
    parser.add_argument("--group-size", type=int, default=8, help="attempts per task (a GRPO group)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--workdir", type=Path, default=ROOT / ".rolltap" / "learn")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "learning.md")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a local HF model directory to serve and train (default: build the tiny model)")
    parser.add_argument("--served-name", default=None, help="the base model's served name (default: tiny, "
                        "or the model directory's name)")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (the trainer always trains in fp32)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gb", type=int, default=None,
                        help="VLLM_CPU_KVCACHE_SPACE per replica (default: tools.replica's, 1 GiB)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                        help="an extra vLLM flag for every replica, repeatable (on a GPU host: "
                        "--replica-arg=--gpu-memory-utilization=0.2 so two replicas and the trainer share it)")
    parser.add_argument("--db", default=None, help="the database URL for the proxy and the trainer "
                        "(default: SQLite in --workdir)")
    parser.add_argument("--task", choices=("letter", "arithmetic", "calculator"), default="letter")
    parser.add_argument("--credit", choices=("identical", "last_only", "discounted"), default="identical",
                        help="the trainer's credit over an episode's turns (trainer.credit)")
    parser.add_argument("--gamma", type=float, default=0.9, help="discount per turn for --credit discounted")
    parser.add_argument("--grammar-backend", choices=("xgrammar", "guidance"), default="xgrammar",
                        help="calculator: the replicas' structured-output backend for the forced tool call")
    parser.add_argument("--eval-tasks", type=int, default=64, help="calculator: held-out questions per evaluation")
    parser.add_argument("--eval-every", type=int, default=None, help="calculator: evaluate every N versions "
                        "(default: half the run; always at version 0 and the last)")
    parser.add_argument("--letter", default="b", help="letter: the letter the reply should be full of (default b: "
                        "see docs/learning.md for why not e)")
    parser.add_argument("--max-operand", type=int, default=None, help="arithmetic: A and B are drawn from 1..N "
                        "(default 20); calculator: from 10..N (default 999)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="max_tokens per completion (default: 16 for letter, 24 for arithmetic, 48 for calculator)")
    parser.add_argument("--lora-rank", type=int, default=8, help="0: train and push full weights")
    parser.add_argument("--lora-alpha", type=int, default=None, help="default: 2 x rank")
    parser.add_argument("--lora-serve", choices=["adapter", "merged"], default="adapter",
                        help="trainer.lora_serve: push adapters to runtime LoRA replicas, or the merged full weights")
    parser.add_argument("--mini-batch", type=int, default=None, help="PPO mini-batch rows (default: one step's "
                        "rows, groups x group size: one optimizer step per policy version)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward "
                        "(default: half the mini-batch)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the trainer (LoRA init, mini-batch order) "
                        "and the replicas' sampling (each attempt's request `seed`)")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="passes over each step's batch (trust region)")
    parser.add_argument("--entropy-coeff", type=float, default=0.005, help="entropy bonus in the loss")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference loss weight (the base model: "
                        "the adapter switched off)")
    parser.add_argument("--clip-ratio", type=float, default=0.2, help="PPO clip range, both sides")
    parser.add_argument("--concurrency", type=int, default=16, help="attempts in flight at once (32 seeded "
                        "requests on one CPU vLLM 0.27.1 replica killed its engine: 'CPU Generator does not use offset')")
    parser.add_argument("--clip-high", type=float, default=None, help="PPO upper clip range (DAPO's clip-higher; "
                        "default: --clip-ratio)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the agents' sampling temperature (the "
                        "trainer recomputes logprobs at each sample's own temperature)")
    parser.add_argument("--no-std-norm", action="store_true", help="GRPO advantages without the division by the "
                        "group's std (Dr. GRPO)")
    parser.add_argument("--plot", type=Path, default=None, help="write the reward/entropy curve PNG here "
                        "(default: beside --out, named after it)")
    parser.add_argument("--title", default="Learning on CPU, through the whole loop (scripts/learn.py)")
    args = parser.parse_args()
    if args.lora_rank < 0:
        parser.error("--lora-rank must be >= 0 (0: full weights)")
    args.lora_alpha = args.lora_alpha or 2 * args.lora_rank or 16  # unused with full weights, but must be > 0
    args.max_tokens = args.max_tokens or {"arithmetic": 24, "calculator": 48}.get(args.task, 16)
    args.max_operand = args.max_operand or (999 if args.task == "calculator" else 20)
    args.eval_every = args.eval_every or max(1, args.steps // 2)
    args.mini_batch = args.mini_batch or args.groups * args.group_size
    args.micro_batch = args.micro_batch or max(1, args.mini_batch // 2)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM (and SIGINT, which background jobs ignore) must reach the `finally` that stops the replicas.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    if args.model_dir is None:
        model = build_tiny_model(ROOT / ".rolltap" / "models" / "tiny")
        served_name = args.served_name or "tiny"
    else:
        model = args.model_dir.resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model-dir {model}: no config.json (not a Hugging Face model directory)")
        served_name = args.served_name or model.name
    db = args.db or f"sqlite:///{args.workdir / 'rolltap.db'}"
    proxy_url = f"http://127.0.0.1:{args.port}"
    bin_dir = Path(sys.executable).parent
    # A replica takes runtime LoRA or full-weight reloads (the control routes of vLLM's dev mode), not both.
    replica_kwargs: dict[str, Any] = {"served_model_name": served_name, "enable_lora": _adapters_served(args),
                                      "dev_mode": not _adapters_served(args)}
    if args.dtype != "float32":
        replica_kwargs["dtype"] = args.dtype
    if args.max_model_len != 512:
        replica_kwargs["max_model_len"] = args.max_model_len
    extra_env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb)} if args.kv_cache_gb is not None else {}
    extra_args = list(args.replica_arg)
    if args.task == "calculator":
        extra_args += replica_args(args.workdir, args.grammar_backend)
        extra_env |= REPLICA_ENV
    if extra_env:
        replica_kwargs["extra_env"] = extra_env
    if _adapters_served(args) and args.lora_rank > 8:  # tools.replica passes --max-lora-rank 8; the last wins
        extra_args += ["--max-lora-rank", str(args.lora_rank)]
    if extra_args:
        replica_kwargs["extra_args"] = extra_args
    print(f"starting {args.replicas} vLLM replica(s) with {_weights(args)} ...", flush=True)
    t = time.monotonic()
    replicas: list[VllmReplica] = start_replicas(args.replicas, model, timeout_s=900, **replica_kwargs)
    replica_start_s = time.monotonic() - t
    print(f"replicas healthy after {replica_start_s:.0f}s", flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    memory = Memory(pids={"replicas": [f"-g {r.proc.pid}" for r in replicas if r.proc is not None]})
    memory.start()
    try:
        # The trainer is a world of its own: a torch.distributed rendezvous inherited from the
        # caller (a process that ran an updater in-process, as the tests do) points at a port in use.
        env = {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}, "ROLLTAP_PROXY__ADMIN_TOKEN": TOKEN, "ROLLTAP_PROXY__AGENT_KEY": AGENT_KEY,
               "ROLLTAP_PROXY__POOL__WEIGHT_MODE": "lora" if _adapters_served(args) else "full",
               "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(args.workdir / "spool")}
        cmd = [str(bin_dir / "rolltap-proxy"), "--db", db, "--port", str(args.port)]
        for r in replicas:
            cmd += ["--replica", r.url]
        proxy_log = open(args.workdir / "proxy.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(cmd, env=env, stdout=proxy_log, stderr=subprocess.STDOUT))
        _wait(lambda: _ready(proxy_url), 120, "the proxy", procs[-1])

        config = args.workdir / "trainer.toml"
        config.write_text(TRAINER_CONFIG.format(
            db=db, model=model, ckpt=args.workdir / "checkpoints", steps=args.steps, group_size=args.group_size,
            groups=args.groups, proxy=proxy_url, token=TOKEN, mini_batch=args.mini_batch,
            micro_batch=args.micro_batch, lr=args.lr, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
            lora_serve=args.lora_serve,
            seed=args.seed, ppo_epochs=args.ppo_epochs, entropy_coeff=args.entropy_coeff, kl_coef=args.kl_coef,
            clip_low=args.clip_ratio, clip_high=args.clip_high or args.clip_ratio, norm_adv=str(not args.no_std_norm).lower(),
            credit=args.credit, gamma=args.gamma))
        trainer_log = open(args.workdir / "trainer.log", "wb")  # noqa: SIM115
        trainer = subprocess.Popen([str(bin_dir / "rolltap-trainer"), "run", "--config", str(config)],
                                   env=env, stdout=trainer_log, stderr=subprocess.STDOUT)
        procs.append(trainer)
        memory.pids["trainer"] = [f"-p {trainer.pid}"]

        curve: list[dict[str, Any]] = []
        scores: list[Score] = []
        held_out = held_out_tasks(args.eval_tasks, args.max_operand, {
            calculator_task(v, g, args.max_operand) for v in range(args.steps) for g in range(args.groups)
        }) if args.task == "calculator" else []
        started = time.monotonic()
        deadline = started + args.minutes * 60
        version = _active_version(proxy_url)
        with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64)) as http, \
                ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            def evaluate(v: int) -> None:
                # Greedy, finished without a reward: recorded, never read by the trainer.
                t_eval = time.monotonic()
                done = list(pool.map(lambda it: calculator_attempt(
                    proxy_url, f"eval-v{v}-q{it[0]}", "0", it[1], max_tokens=args.max_tokens, temperature=0.0,
                    seed=None, train=False), enumerate(held_out)))
                values = [a.reward for a in done]
                low, high = interval(values)
                stats = _episode_stats(done)
                scores.append(Score(v, statistics.fmean(values), low, high, len(values), stats["calls"] or 0.0,
                                    stats["valid"] or 0.0))
                print(f"held-out at v{v}: {scores[-1].mean:.3f} (90% {low:.3f}-{high:.3f}), "
                      f"{time.monotonic() - t_eval:.1f}s", flush=True)

            while version < args.steps and time.monotonic() < deadline:
                if held_out and (version % args.eval_every == 0):
                    evaluate(version)
                t = time.monotonic()
                if args.task == "letter":
                    jobs: list[tuple[str, str, Any]] = [
                        (f"v{version}-t{g}", str(k), LetterTask(args.letter, TOPICS[(version + g) % len(TOPICS)]))
                        for g in range(args.groups) for k in range(args.group_size)]
                    attempts = [Attempt(r) for r in pool.map(
                        lambda j: run_attempt(proxy_url, j[0], j[1], j[2], api_key=AGENT_KEY, max_tokens=args.max_tokens,
                                              http=http, temperature=args.temperature, seed=_request_seed(args.seed, j[0], j[1])),
                        jobs)]
                elif args.task == "calculator":
                    jobs = [(f"v{version}-t{g}", str(k), calculator_task(version, g, args.max_operand))
                            for g in range(args.groups) for k in range(args.group_size)]
                    attempts = list(pool.map(lambda j: calculator_attempt(
                        proxy_url, j[0], j[1], j[2], max_tokens=args.max_tokens, temperature=args.temperature,
                        seed=_request_seed(args.seed, j[0], j[1])), jobs))
                else:
                    jobs = [(f"v{version}-t{g}", str(k), arithmetic_task(version, g, args.max_operand))
                            for g in range(args.groups) for k in range(args.group_size)]
                    attempts = list(pool.map(lambda j: arithmetic_attempt(
                        proxy_url, j[0], j[1], j[2], max_tokens=args.max_tokens, http=http,
                        temperature=args.temperature), jobs))
                rollout_s = time.monotonic() - t
                _wait(lambda v=version: _active_version(proxy_url) > v, 900, "the trainer's next version", trainer)
                tokens = [a.completion_tokens for a in attempts if a.completion_tokens is not None]
                truncated = [a.truncated for a in attempts if a.truncated is not None]
                curve.append({
                    "version": version, "reward": statistics.fmean(a.reward for a in attempts),
                    "rollout_s": rollout_s, "cycle_s": time.monotonic() - t,
                    "completion_tokens": statistics.fmean(tokens) if tokens else None,
                    "truncated": statistics.fmean(truncated) if truncated else None,
                    "examples": [(str(jobs[i][2]), a.reply, a.reward) for i, a in enumerate(attempts)
                                 if a.reply is not None][:: args.group_size][:4],
                    **_episode_stats(attempts),
                })
                agent = (f", {curve[-1]['calls']:.2f} calls/episode, valid tool calls {curve[-1]['valid']:.0%}"
                         if curve[-1]["calls"] is not None and curve[-1]["valid"] is not None else "")
                print(f"policy v{version}: mean reward {curve[-1]['reward']:.3f} ({len(attempts)} attempts, "
                      f"rollout {rollout_s:.1f}s, cycle {curve[-1]['cycle_s']:.1f}s{agent})", flush=True)
                version = _active_version(proxy_url)
            if held_out and (not scores or scores[-1].version != version):
                evaluate(version)  # the last version the trainer pushed
        elapsed_min = (time.monotonic() - started) / 60
        trainer.terminate()
        trainer.wait(timeout=120)
        engine = create_engine(sync_url(db))
        with engine.connect() as conn:
            steps = [(int(step), metrics) for step, metrics in conn.execute(
                select(TrainingStep.step, TrainingStep.metrics).order_by(TrainingStep.step)).all()]
        engine.dispose()
        agent_lines = _agent_section(args, engine_url=db, model=model, curve=curve, scores=scores) if held_out else []
        logged = _parse_trainer_log(args.workdir / "trainer.log")
        memory.stop()
        (args.workdir / "curve.json").write_text(json.dumps(
            {"curve": curve, "steps": steps, "logged": logged, "held_out": [s.__dict__ for s in scores]},
            indent=1, default=str))
        _write_report(args, model, served_name, curve, steps, logged, elapsed_min, replica_start_s, memory,
                      agent_lines)
    finally:
        memory.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for r in replicas:
            r.stop()


def _agent_section(args: argparse.Namespace, *, engine_url: str, model: Path, curve: list[dict[str, Any]],
                   scores: list[Score]) -> list[str]:
    """The calculator agent's part of the report: held-out scores, the acceptance figures, how the
    episodes became rows (rebuilt with the trainer's code under the run's credit rule), one row
    shown with its mask, and the agent's curves as a PNG."""
    from transformers import AutoTokenizer

    rewards = [c["reward"] for c in curve]
    diffs = [b - a for a, b in zip(rewards, rewards[1:], strict=False)]
    step_sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    gain = statistics.fmean(rewards[-5:]) - statistics.fmean(rewards[:5])
    calls = [c["calls"] for c in curve if c.get("calls") is not None]
    first, last = scores[0], scores[-1]
    lines = ["", "## The agent: held-out score, calls, tool calls", "",
             f"Held-out set: {first.n} questions the run never trains on (their own seed stream, none equal to a "
             "training question), answered greedily (temperature 0) through the proxy; their attempts are finished "
             "without a reward, so the trainer never reads them. Score: `answer_score` per question, mean with a 90% "
             "percentile-bootstrap interval over the questions.", "",
             "| policy version | held-out score | 90% interval | calls per episode | valid tool calls |",
             "|---:|---:|---|---:|---:|"]
    lines += [f"| {s.version} | {s.mean:.3f} | {s.low:.3f}-{s.high:.3f} | {s.calls:.2f} | {s.valid:.0%} |"
              for s in scores]
    engine = create_engine(sync_url(engine_url))
    with engine.connect() as conn:
        trained_eval = conn.execute(
            select(TrainingStepAttempt.attempt_pk)
            .join(AttemptModel, AttemptModel.id == TrainingStepAttempt.attempt_pk)
            .where(AttemptModel.rollout_id.like("eval-%"))).all()
        settings = TrainerSettings(model=str(model), credit=args.credit, gamma=args.gamma)
        train_rollouts = [f"v{v}-t{g}" for v in range(len(curve)) for g in range(args.groups)]
        samples = attempt_samples(conn, train_rollouts, settings)
    engine.dispose()
    episodes: dict[tuple[str, str], list[int]] = {}
    for sm in samples:
        episodes.setdefault((sm.rollout_id, sm.attempt_id), []).append(len(sm.triplet.seqs))
    multi = [rows for rows in episodes.values() if sum(rows) >= 2]
    merged = sum(len(rows) == 1 for rows in multi)
    lines += [
        "",
        f"- learning: mean reward of the last five versions minus the first five: **{gain:+.3f}**; the "
        f"version-to-version changes of the mean reward have a standard deviation of {step_sd:.3f} "
        f"({gain / step_sd if step_sd else float('inf'):.1f}x)",
        f"- held-out: version {first.version} {first.mean:.3f} ({first.low:.3f}-{first.high:.3f}), version "
        f"{last.version} {last.mean:.3f} ({last.low:.3f}-{last.high:.3f}): the last is "
        f"**{'above' if last.mean > first.high else 'not above'}** version {first.version}'s interval",
        f"- model calls per episode (training episodes, per version): min {min(calls):.2f}, mean "
        f"{statistics.fmean(calls):.2f}" if calls else "- model calls per episode: none recorded",
        f"- rows: {len(multi)} training episodes with two or more kept calls, {merged} of them ({merged / len(multi):.0%}) "
        f"merged into one row (the next prompt starts with the previous prompt + completion); credit "
        f"`{args.credit}`{f' (gamma {args.gamma:g})' if args.credit == 'discounted' else ''} per turn" if multi
        else "- rows: no training episode with two kept calls",
        f"- held-out attempts consumed by a training step: **{len(trained_eval)}**",
    ]
    multi_rows = [sm for sm in samples if len(sm.triplet.seqs) >= 2]
    shown = next((sm for sm in reversed(multi_rows) if sm.final_reward > 0), multi_rows[-1] if multi_rows else None)
    if shown is not None:
        tok = AutoTokenizer.from_pretrained(model)
        lines += ["", "### One trained row of a multi-turn episode, with its mask", "",
                  *row_markdown(shown, lambda ids: tok.decode(ids, skip_special_tokens=False))]
    plot = plot_agent(curve, scores, args.out.with_name(args.out.stem + "-agent.png"),
                      title=f"{args.title.split(':')[0]}: credit {args.credit}")
    lines[2:2] = ["", f"![the agent's curves]({plot.name})"]
    return lines


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    return f"{os.cpu_count()} cores ({cpu}), {mem_kb / 2**20:.0f} GiB RAM, {_gpu()}, Python {platform.python_version()}"


def _gpu() -> str:
    """The GPU the replicas and the trainer share, from nvidia-smi (the driver's own tool)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
    return out.replace("\n", "; ") or "no GPU"


def _db_kind(args: argparse.Namespace) -> str:
    return "sqlite" if args.db is None or args.db.startswith("sqlite") else "postgresql"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: Any, fmt: str = ".2f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _write_report(args: argparse.Namespace, model: Path, served_name: str, curve: list[dict[str, Any]],
                  steps: list[tuple[int, Any]], logged: dict[int, dict[str, float]], elapsed_min: float,
                  replica_start_s: float, memory: Memory, agent_lines: list[str]) -> None:
    if not curve:
        raise SystemExit("no policy version finished within the time budget: nothing to report")
    rewards = [c["reward"] for c in curve]
    first5, last5 = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    # The database's `step_time_s` is the update's own clock (set before the commit); the step's is in the log.
    by_step = {step: {k: v for k, v in (m or {}).items() if k != "step_time_s"} for step, m in steps}
    for step, values in logged.items():  # the log has the whole step (and the push); the database the rest
        by_step.setdefault(step, {}).update(values)
    tiny = args.model_dir is None
    params = _safetensors_params(model)
    if tiny:
        model_text = "a tiny Qwen2 made on the spot (347K parameters)"
    else:
        arch = json.loads((model / "config.json").read_text()).get("architectures", ["?"])[0]
        model_text = (f"`{model.relative_to(ROOT) if model.is_relative_to(ROOT) else model}` ({arch}, "
                      f"{_fmt(params / 1e6 if params else None, '.1f')}M parameters, served as `{served_name}`)")
    task_text = (f"`examples/letter_task.py` (write text full of the letter \"{args.letter}\"; reward: the share "
                 f"of \"{args.letter}\")"
                 if args.task == "letter" else
                 "a multi-turn calculator agent written with the OpenAI Agents SDK (`examples/agents_sdk_agent.py`: "
                 f"\"What is A + B? Use the add tool, then answer with just the number.\", A and B random in "
                 f"10..{args.max_operand} per group; the first call must call `add`, the tool's answer goes back, the "
                 "model replies; reward `examples.calculator.answer_score`: 1.0 for just the sum, 0.5 for the sum as "
                 f"the last number of a longer reply; trainer credit `{args.credit}` over the turns)"
                 if args.task == "calculator" else
                 "single-turn arithmetic (\"What is A + B? Answer with just the number.\", A and B random in "
                 f"1..{args.max_operand} per group; reward `examples.agent.score`: 1.0 when the first number in the "
                 "reply is A+B)")
    lines = [
        f"# {args.title}",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on the {os.cpu_count()}-core machine ({_gpu()}): {model_text}, "
        f"{args.replicas} vLLM replica{'s' if args.replicas != 1 else ''} with {_weights(args)} "
        f"(`--dtype {args.dtype} --max-model-len {args.max_model_len}`"
        f"{f', VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gb}' if args.kv_cache_gb is not None else ''}"
        f"{''.join(' ' + a for a in args.replica_arg)}), the proxy on "
        f"{'SQLite' if _db_kind(args) == 'sqlite' else 'PostgreSQL'}, the trainer (`rolltap-trainer run --config`, verl GRPO, {_trained(args)}) and the "
        f"agent ({task_text}{'' if args.task == 'calculator' else ', plain `openai` SDK'}).",
        f"Command: `.venv/bin/python -m scripts.learn {shlex.join(sys.argv[1:])}`",
        "",
        f"- machine: {_machine()}",
        f"- settings: {args.groups} groups x {args.group_size} attempts per policy version, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature:g}; trainer lr {args.lr:g}, {_trained(args)}, mini-batch {args.mini_batch}, micro-batch {args.micro_batch}, "
        f"PPO epochs {args.ppo_epochs}, clip ratio {args.clip_ratio:g}, entropy_coeff {args.entropy_coeff:g}, "
        f"kl_coef {args.kl_coef:g}, GRPO {'without' if args.no_std_norm else 'with'} the std division, "
        f"{'fp32' if _gpu() == 'no GPU' else 'bf16 compute, fp32 master weights'}, max_staleness 1, seed {args.seed}",
        f"- replicas healthy after {replica_start_s:.0f} s (not counted below)",
        f"- policy versions trained and served: {len(curve)} of {args.steps} in {elapsed_min:.1f} min"
        f"{f' (**ended by the {args.minutes:g}-minute cap**)' if len(curve) < args.steps else ''}",
        f"- mean reward, first five versions: {first5:.3f}; last five: {last5:.3f} "
        f"(x{last5 / first5 if first5 else float('inf'):.2f})",
    ]
    for key, label in (("entropy", "entropy (nats/token)"), ("clip_frac", "clip fraction")):
        per_version = [m[key] for c in curve if isinstance((m := by_step.get(c["version"] + 1) or {}).get(key),
                                                           int | float)]
        if per_version:
            lines.append(f"- {label}, mean of the first five versions: {statistics.fmean(per_version[:5]):.3f}; "
                         f"last five: {statistics.fmean(per_version[-5:]):.3f}")
    # A collapse: 10 versions in a row with gradient norm 0 while the reward is still below 0.9.
    streak = longest = 0
    for c in curve:
        m = by_step.get(c["version"] + 1) or {}
        stuck = isinstance(m.get("grad_norm"), int | float) and m["grad_norm"] == 0.0 and c["reward"] < 0.9
        streak = streak + 1 if stuck else 0
        longest = max(longest, streak)
    lines.append(f"- longest run of versions with gradient norm 0 while reward < 0.9: {longest}")
    if tiny and args.task == "letter":
        passed = last5 >= 0.9 and longest < 10
        lines.append(f"- target (last five >= 0.9, no 10 versions in a row with gradient norm 0 below 0.9): "
                     f"**{'met' if passed else 'NOT met'}**")
    if memory.loads:
        loads = sorted(memory.loads)
        lines.append(f"- machine load during the run (1-minute load average on {os.cpu_count()} cores, sampled every "
                     f"2 s): median {statistics.median(loads):.1f}, max {loads[-1]:.1f}")
    if memory.peak_rss_gb:
        rss = ", ".join(f"{k} {v:.1f} GiB" for k, v in memory.peak_rss_gb.items())
        lines.append(f"- peak memory: machine in use {memory.peak_used_gb:.1f} GiB (all processes); "
                     f"peak RSS {rss} (RSS counts shared pages once per process)")

    # Step time and its phases. Version 0's rollouts run while the trainer starts (model load), so
    # its cycle and step 1 are a warm-up: the summary is over the later, steady steps.
    rows = [(c, by_step.get(c["version"] + 1, {})) for c in curve]
    rows = [(c, m) for c, m in rows if "step_time_s" in m]
    steady = [(c, m) for c, m in rows if c["version"] >= 1] or rows
    lines += ["", "## Step time and its phases", ""]
    if steady:
        step_times = [m["step_time_s"] for _, m in steady]
        total = sum(step_times)
        share = {k: sum(m.get(k, 0.0) for _, m in steady) / total for k in PHASES}
        rollout_share = sum(c["rollout_s"] for c, _ in steady) / total
        med = {k: _median([m[k] for _, m in steady if k in m]) for k in PHASES}
        other = 1 - sum(share.values())
        lines += [
            f"Over {len(steady)} trainer steps ({steady[0][0]['version'] + 1}..{steady[-1][0]['version'] + 1}; "
            f"{'step 1 overlaps the trainer start-up and is left out' if steady is not rows else 'all'}): step "
            f"time (end of one step to the end of the next, push included) median "
            f"**{statistics.median(step_times):.1f} s** (min {min(step_times):.1f}, max {max(step_times):.1f}); "
            f"the driver's cycle (rollouts, then waiting for the next version) median "
            f"{statistics.median(c['cycle_s'] for c, _ in steady):.1f} s.",
            "",
            "| phase | median s | share of step time |",
            "|---|---:|---:|",
            f"| read: waiting for the version's groups, then reading them | {_fmt(med['read_s'])} | "
            f"{share['read_s']:.0%} |",
            f"| - of which the driver's rollouts (all attempts of the version, through the proxy) | "
            f"{_fmt(_median([c['rollout_s'] for c, _ in steady]))} | {rollout_share:.0%} |",
            f"| update: old logprobs, GRPO advantages, PPO loss, backward, AdamW | {_fmt(med['update_s'])} | "
            f"{share['update_s']:.0%} |",
            f"| save: checkpoint + {'LoRA' if _adapters_served(args) else 'full-weight'} export | {_fmt(med['save_s'])} | "
            f"{share['save_s']:.0%} |",
            f"| push: {'LoRA load on the replicas' if _adapters_served(args) else 'pause, weight reload on the replicas, resume'}"
            f", proxy switch | {_fmt(med['push_s'])} | {share['push_s']:.0%} |",
            f"| other (batch building, commit) | | {other:.0%} |",
            "",
            "A trainer step starts when the previous one has pushed; the driver sees the new version (polling "
            "every 0.2 s) and starts that version's rollouts, so `read` holds the rollouts plus the poll delay.",
        ]
        if rows and rows[0][0]["version"] == 0 and len(rows) > 1:
            c0, m0 = rows[0]
            lines += ["", f"Warm-up: version 0's cycle took {c0['cycle_s']:.1f} s (rollouts {c0['rollout_s']:.1f} s, "
                      f"while the trainer started); trainer step 1: {_fmt(m0.get('step_time_s'), '.1f')} s, of "
                      f"which update {_fmt(m0.get('update_s'), '.1f')} s."]
    else:
        lines.append("No trainer step lines were found in the trainer log.")

    lines += [
        "",
        "## Reward curve and per-step phases",
        "",
        "| policy version | mean reward | | rollout s | reply tokens | cut at max_tokens | cycle s | trainer step | "
        "loss | grad norm | entropy | clip frac | approx KL | tied groups | read s | update s | save s | push s | "
        "step s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in curve:
        m = by_step.get(c["version"] + 1) or {}
        bar = "#" * round(c["reward"] * 20)
        lines.append(
            f"| {c['version']} | {c['reward']:.3f} | `{bar:<20}` | {c['rollout_s']:.1f} | "
            f"{_fmt(c.get('completion_tokens'), '.1f')} | {_fmt(c.get('truncated'), '.0%')} | {c['cycle_s']:.1f} | "
            f"{c['version'] + 1} | {_fmt(m.get('loss'), '.4f')} | {_fmt(m.get('grad_norm'), '.3f')} | "
            f"{_fmt(m.get('entropy'), '.3f')} | {_fmt(m.get('clip_frac'), '.3f')} | {_fmt(m.get('ppo_kl'), '.4f')} | "
            f"{_fmt(m.get('tied_groups'), '.0f')} | {_fmt(m.get('read_s'))} | {_fmt(m.get('update_s'))} | {_fmt(m.get('save_s'))} | "
            f"{_fmt(m.get('push_s'))} | {_fmt(m.get('step_time_s'))} |")
    examples = [(c["version"], e) for c in (curve[:1] + curve[-1:]) for e in c.get("examples", [])]
    if examples:
        lines += ["", "## Sample replies (first attempt of each of the first groups; first and last version)", ""]
        seen: set[tuple[int, str]] = set()
        for v, (task, reply, reward) in examples:
            if (v, task + (reply or "")) in seen:
                continue
            seen.add((v, task + (reply or "")))
            lines.append(f"- v{v}, {task}, reward {reward:.0f}: {json.dumps(reply)}")
    plot = args.plot or args.out.with_suffix(".png")
    plot_steps(sorted(by_step.items()), plot, title=f"letter task, seed {args.seed}" if tiny else None)
    lines[2:2] = [f"![reward and entropy per step]({plot.name})", ""]
    lines += agent_lines
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:14]))


if __name__ == "__main__":
    main()
