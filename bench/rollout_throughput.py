"""Benchmark: rollout throughput through the proxy against vLLM directly, per `proxy.rollout_logprobs`.

Against one running vLLM replica it starts one `rolltap-proxy` per logprob setting (`on`, `off`,
`sample`; open access, each on its own database or all on one PostgreSQL database), then, for
each load (concurrent streaming agents), runs windows of the same streamed chat calls (fixed
prompts, `ignore_eos`, `max_tokens` tokens each) alternating between the paths, `--rounds` times:

- `direct`: the replica as an agent would call it;
- `direct_same_ask`: the replica asked what the proxy asks with logprobs on (token IDs, logprobs as
  token IDs: `proxy.formats`' own chat ask);
- `proxy_on`, `proxy_off`, `proxy_sample`: through the proxy's templated route, one attempt per call.

Throughput is what the replicas generated in the window (vLLM's own `generation_tokens_total`,
read before and after): a busy vLLM merges several tokens into one streamed chunk, so counting
chunks at the client undercounts by a factor that differs from path to path (measured: 1.0
tokens a chunk at 4 streams on a CPU replica, 7 at 128 with logprobs). The client's count of
token IDs is kept beside it (`delivered_tokens_per_s`; one per chunk where the chunk has none),
with the chunk rate.

Agents start staggered over the warm-up, so a window sees calls in every phase (prefill and
decode), not one synchronised wave. Per window: generated tokens/s, time to first content
p50/p99, whole-call latency p50/p99, and the CPU cores each process used in it (the proxy with
its workers; the replica's API server alone and with its engine): that is where the time goes
when a path is slower. After each window the cut-off calls must drain from the replica (vLLM's
`num_requests_running` and `_waiting` back to 0) before the next one starts; the time that took
is reported too (`drain_s`: how fast a client's disconnect stops the replica's work on that
path). The load comes from `--procs` processes so the client is not the bottleneck. Ratios to
both direct paths are pooled over rounds, with a 90% interval (`bench.throughput_report` pools
several runs). Prints and writes JSON (`--out`).

Layouts: `--replicas N` starts N replicas of the model (direct calls spread over them as the
proxy spreads its calls), `--proxy-workers N` runs each proxy with `--workers N` (PostgreSQL).
Several layouts on one GPU in one run: `--server NAME=COUNT[xAPI]` (repeatable) starts a group of
COUNT vLLM servers, each with API API-server processes (`vllm serve --api-server-count`), and a
path `KIND@NAME` (or `KIND@NAME:N`, the group's first N servers) runs against that group alone,
through a proxy of its own for the proxy paths. Groups not in a window idle (no CPU, no GPU
work), so every layout is measured in the same rounds and their ratios are paired like the
paths'. E.g. one server with 4 API servers against 3 servers behind the proxy:

    --server a=1x4 --server c=3 --paths direct@a,direct@c,proxy_on@c,proxy_on@c:1

`--group-arg NAME=ARG` gives one group's servers a vLLM argument of their own (a KV cache sized
for its share of the streams, `--stream-interval`), so two groups differing only in it are
measured in the same rounds; `--group-env NAME=KEY=VALUE` gives them an environment variable of their
own (`n=ROLLTAP_VLLM_LOGPROBS_WIRE=numpy`: vLLM's own logprob transport beside the plugin's).

Serving a pushed policy, as Rolltap's default (`trainer.lora_rank = 8`) serves every call after the
first push: `--lora-group NAME` starts that group with runtime LoRA; once its proxies are up, random
rank-`--lora-rank` adapters are pushed through the first of them (`--pushes` versions, each timed) and
`bench.lora_push` checks that every front end serves the last (the run exits 1 at its end if not;
a push that missed a front end stops it at once); then every call on that group asks for the
adapter, direct ones by its name. Its proxies keep the policy in
their own database (`--lora-db`): a policy is per database, and other groups serve the base model.

    python -m bench.rollout_throughput --replica http://127.0.0.1:8100 --model tiny \\
        --db 'sqlite:////tmp/rt-{name}.db' --loads 8 --window-s 5 --rounds 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (cpu_seconds, descendants, free_port, http_get, machine, stop_process, tree_cpu_seconds,
                           wait_ready)
from bench.proxy_profile import fold, module_bucket
from proxy.formats import FORMATS
from shared.types import Route
from bench.throughput_report import baselines, pooled_ratio, tagged
from trainer.weights import lora_name

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("on", "off", "sample")
ADMIN_TOKEN = "bench-admin-token"
_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.eE+-]+)$", re.M)
_BUSY = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.eE+-]+)$", re.M)
PROMPTS = [f"Write a short story about a {thing}." for thing in
           ("lighthouse", "fox", "violin", "glacier", "market", "comet", "river", "clockmaker")]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _load(urls: list[str], extra: dict[str, Any], model: str, agents: range, total: int, tag: str, begin: float,
          warmup_s: float, window_s: float, max_tokens: int) -> dict[str, Any]:
    """One load process: `agents` agents streaming back to back, cut off at the window's end.

    `agents` are this process's share of the `total` agents' indices; `begin` is the wall-clock
    time every load process starts from, and agent i starts its first call `i / total` of the
    warm-up after it. Rollout ids carry `tag`, so no two windows share an attempt.

    Delivered tokens are those of the content chunks that arrive inside the window, so calls
    longer than the window count too; latency counts calls that started and ended inside it,
    time to first token calls that started inside it."""
    tokens = chunks = 0
    ttft: list[float] = []
    latency: list[float] = []
    errors = 0

    async def main() -> None:
        nonlocal errors, tokens, chunks
        t0 = time.monotonic() + (begin - time.time())
        start, end = t0 + warmup_s, t0 + warmup_s + window_s
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            async def agent(i: int) -> None:
                nonlocal errors, tokens, chunks
                await asyncio.sleep(max(0.0, t0 + warmup_s * i / total - time.monotonic()))
                n = 0
                while True:
                    url = urls[i % len(urls)].format(rollout=f"bench-{tag}-{i}", attempt=n)
                    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}],
                            "max_tokens": max_tokens, "stream": True, "temperature": 1.0, "ignore_eos": True, **extra}
                    n += 1
                    t_start = time.monotonic()
                    t_first = 0.0
                    try:
                        async with http.post(url, json=body) as resp:
                            if resp.status != 200:
                                errors += 1
                                await resp.read()
                                continue
                            async for line in resp.content:
                                if not line.startswith(b"data: {"):
                                    continue
                                chunk = json.loads(line[6:])
                                choices = [c for c in chunk.get("choices") or () if (c.get("delta") or {}).get("content")]
                                if choices:
                                    now = time.monotonic()
                                    if start <= now <= end:
                                        # A busy vLLM merges several tokens into one chunk: count the
                                        # token IDs where the chunk carries them, else one per chunk.
                                        chunks += 1
                                        tokens += sum(len(c.get("token_ids") or ()) or 1 for c in choices)
                                    if not t_first:
                                        t_first = now
                                        if t_start >= start:
                                            ttft.append(now - t_start)
                    except (aiohttp.ClientError, TimeoutError):
                        errors += 1
                        continue
                    t_end = time.monotonic()
                    if t_start >= start:
                        latency.append(t_end - t_start)

            tasks = [asyncio.ensure_future(agent(i)) for i in agents]
            await asyncio.sleep(end - time.monotonic())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    return {"tokens": tokens, "chunks": chunks, "ttft": ttft, "latency": latency, "errors": errors}


def _window(path: str, urls: list[str], extra: dict[str, Any], model: str, args: argparse.Namespace, load: int,
            rnd: int, pool: ProcessPoolExecutor, pids: dict[str, int]) -> dict[str, Any]:
    begin = time.time() + 0.5  # every load process counts from here, whenever the pool starts it
    tag = f"{load}-{rnd}-{_slug(path)}"  # rollout ids take letters, digits, '-' and '_'
    futures = [pool.submit(_load, urls, extra, model, range(p, load, args.procs), load, tag,
                           begin, args.warmup_s, args.window_s, args.max_tokens) for p in range(min(args.procs, load))]
    # CPU cores per process over exactly the window: the main process samples while the load runs.
    time.sleep(max(0.0, begin + args.warmup_s - time.time()))
    before = {name: _cpu(name, pid) for name, pid in pids.items()}
    counted = _generated(args.replica_urls)
    spies = _spy(args, pids, tag) if args.py_spy and rnd == args.rounds - 1 else {}
    time.sleep(args.window_s)
    after = _generated(args.replica_urls)
    generated = after - counted if after is not None and counted is not None else None
    cores = {f"{name}_cores": round((_cpu(name, pid) - before[name]) / args.window_s, 2) for name, pid in pids.items()}
    profiles = {f"profile_{name}": _folded(proc, out, name) for name, (proc, out) in spies.items()}
    results = [f.result() for f in futures]
    drain_s = _drain(args.replica_urls)
    ttft = [t * 1000 for r in results for t in r["ttft"]]
    latency = [t * 1000 for r in results for t in r["latency"]]
    delivered = sum(r["tokens"] for r in results) / args.window_s
    out = {"path": path, "load": load, "calls": len(latency), "errors": sum(r["errors"] for r in results),
           "tokens_per_s": round(generated / args.window_s, 1) if generated is not None else delivered,
           "delivered_tokens_per_s": round(delivered, 1),
           "chunks_per_s": round(sum(r["chunks"] for r in results) / args.window_s, 1), "ttft_ms_p50": _pct(ttft, 0.5),
           "ttft_ms_p99": _pct(ttft, 0.99), "latency_ms_p50": _pct(latency, 0.5),
           "latency_ms_p99": _pct(latency, 0.99), **cores, "drain_s": drain_s, **profiles}
    print(json.dumps(out), flush=True)
    return out


def _cpu(name: str, pid: int) -> float:
    """CPU seconds so far: one process for `replica_api`, `replica_engine` and `replica_api0`, else the process with
    its children."""
    return tree_cpu_seconds(pid) if name in ("proxy", "replica") else cpu_seconds(pid)


def _vllm_processes(pid: int) -> dict[str, int]:
    """A vLLM server's engine core and first API server process, by the titles vLLM gives them
    (`VLLM::EngineCore`, `VLLM::ApiServer_0`; with one API server the server's own process is it)."""
    found: dict[str, int] = {}
    for child in descendants(pid) - {pid}:
        try:
            title = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineCore" in title:
            found.setdefault("replica_engine", child)
        elif b"ApiServer_0" in title:
            found["replica_api0"] = child
    return found


def _spy(args: argparse.Namespace, pids: dict[str, int], tag: str) -> dict[str, tuple[subprocess.Popen[bytes], Path]]:
    """py-spy on the path's proxy (with its workers) and the replica's API server, for the window."""
    spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for name in ("proxy", "replica_api", "replica_api0", "replica_engine"):
        if name in pids:
            out = args.logs / f"py-spy-{tag}-{name}.txt"
            cmd = [args.py_spy, "record", "--pid", str(pids[name]), "--duration", str(int(args.window_s)),
                   "--rate", "50", "--format", "raw", "--output", str(out), "--nonblocking"]
            spies[name] = (subprocess.Popen(cmd + (["--subprocesses"] if name == "proxy" else []),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
    return spies


def _folded(proc: subprocess.Popen[bytes], out: Path, name: str) -> dict[str, float]:
    """The top of one py-spy profile: share of samples (%) by our module and library (the proxy), or by
    vLLM module and library (the replica's API server)."""
    proc.wait(60)
    if not out.is_file():
        return {}
    shares = fold(out.read_text(), **({} if name == "proxy" else {"bucket": module_bucket}))
    return dict(list(shares.items())[:10])


def _generated(replicas: list[str]) -> float | None:
    """Tokens the replicas have generated so far (vLLM's `generation_tokens_total`); None where one has no such
    counter (the instant replica), and the client's count is used instead."""
    total = 0.0
    for replica in replicas:
        found = [float(m.group(1)) for m in _GENERATED.finditer(_metrics(replica))]
        if not found:
            return None
        total += sum(found)
    return total


def _busy(replica: str) -> float:
    """Requests running or waiting on a replica, from vLLM's Prometheus text (0 where it has none)."""
    return sum(float(m.group(1)) for m in _BUSY.finditer(_metrics(replica)))


def _metrics(replica: str) -> str:
    answer = http_get(replica, "/metrics", 5.0)
    return answer[1].decode() if answer is not None else ""


def _drain(replicas: list[str], timeout_s: float = 120.0) -> float:
    """Wait until no replica runs or queues a request (the window's cut-off calls are gone); seconds waited."""
    started = time.monotonic()
    while any(_busy(r) for r in replicas) and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    return round(time.monotonic() - started, 2)


def _start_proxy(setting: str, args: argparse.Namespace, port: int, logs: Path, replicas: list[str],
                 name: str, lora: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROLLTAP_PROXY__OPEN_ACCESS": "true", "ROLLTAP_PROXY__ROLLOUT_LOGPROBS": setting,
           "ROLLTAP_PROXY__ROLLOUT_LOGPROBS_RATE": str(args.sample_rate), "ROLLTAP_PROXY__LOG_LEVEL": "warning",
           "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(logs / f"spool-{name}")}
    if lora:
        env |= {"ROLLTAP_PROXY__ADMIN_TOKEN": ADMIN_TOKEN, "ROLLTAP_PROXY__POOL__WEIGHT_MODE": "lora"}
    log = open(logs / f"proxy-{name}.log", "wb")  # noqa: SIM115
    db = args.lora_db or args.db if lora else args.db
    cmd = [sys.executable, "-m", "proxy.main", "--port", str(port), "--db", db.format(name=name),
           "--workers", str(args.proxy_workers)]
    for url in replicas:
        cmd += ["--replica", url]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)


def _per_group(parser: argparse.ArgumentParser, entries: list[str], groups: dict[str, Any], flag: str,
               shape: str) -> dict[str, list[str]]:
    """`NAME=REST` entries of a per-group flag, by --server group; REST must be non-empty (and hold a key)."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        name, _, rest = entry.partition("=")
        if name not in groups or not rest or (shape.count("=") == 2 and not rest.partition("=")[0]):
            parser.error(f"{flag} {entry}: {shape} for a --server group")
        found.setdefault(name, []).append(rest)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", action="append", default=[], help="a running vLLM replica's base URL (no /v1), or NAME=URL "
                        "(a group, for paths KIND@NAME); repeatable: direct calls are spread over them as the proxy "
                        "spreads its own")
    parser.add_argument("--model", required=True, help="the replica's served model name")
    parser.add_argument("--start-replica", type=Path, default=None, metavar="MODEL_DIR",
                        help="instead of --replica: start --replicas of them (tools.replica, as scripts.learn does) "
                        "serving this model")
    parser.add_argument("--replicas", type=int, default=1, help="with --start-replica: how many (one GPU shared)")
    parser.add_argument("--server", action="append", default=[], metavar="NAME=COUNT[xAPI]",
                        help="with --start-replica, instead of --replicas: a group of COUNT servers with API "
                        "API-server processes each, for paths KIND@NAME (repeatable)")
    parser.add_argument("--start-together", action="store_true", help="start every server at once (give each "
                        "an explicit KV cache, --replica-arg=--kv-cache-memory=BYTES: a server's memory profile "
                        "would count the others' allocations); default: one after the other, each healthy first")
    parser.add_argument("--proxy-workers", type=int, default=1, help="each proxy's --workers (more than 1: PostgreSQL)")
    parser.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                        help="extra vLLM argument for --start-replica (repeatable, e.g. --replica-arg=--api-server-count=4)")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM --dtype for --start-replica")
    parser.add_argument("--vllm-serve", action="store_true", help="start replicas with `vllm serve` (needed for "
                        "--api-server-count; the default entrypoint ignores it)")
    parser.add_argument("--db", default="sqlite:////tmp/rolltap-throughput-{name}.db",
                        help="database URL per proxy; `{name}` becomes its setting (one PostgreSQL URL may serve all)")
    parser.add_argument("--loads", default="64,256", help="concurrent streaming agents, comma-separated")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=8.0, help="agents start staggered over it; make it at "
                        "least one call's duration so the window sees a steady mix")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of all paths per load")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sample-rate", type=float, default=0.0625)
    parser.add_argument("--procs", type=int, default=8, help="load-generating processes")
    parser.add_argument("--py-spy", default=None, metavar="BIN", help="profile the last round's windows with this "
                        "py-spy: the path's proxy, the replica's API server (its first, with several) and its engine "
                        "core (shares by module in the JSON)")
    parser.add_argument("--paths", default="direct,direct_same_ask,proxy_on,proxy_off,proxy_sample")
    parser.add_argument("--lora-group", default=None, metavar="NAME", help="a server group with runtime LoRA whose "
                        "calls are served by adapters pushed through its first proxy path (one API server each)")
    parser.add_argument("--lora-rank", type=int, default=8, help="the pushed adapters' rank (trainer.lora_rank's default)")
    parser.add_argument("--pushes", type=int, default=3, help="adapter versions pushed, each timed")
    parser.add_argument("--lora-model-dir", default=None, help="with --replica and --lora-group: the served "
                        "model's folder (the adapters' shapes)")
    parser.add_argument("--lora-db", default=None, help="database URL for the LoRA group's proxies (default --db)")
    parser.add_argument("--group-arg", action="append", default=[], metavar="NAME=ARG",
                        help="a vLLM argument for group NAME's servers only, after --replica-arg (the last wins), "
                        "e.g. a=--kv-cache-memory=11000000000 or s=--stream-interval=8; repeatable")
    parser.add_argument("--group-env", action="append", default=[], metavar="NAME=KEY=VALUE",
                        help="an environment variable for group NAME's servers only, e.g. "
                        "n=ROLLTAP_VLLM_LOGPROBS_WIRE=numpy; repeatable")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/rolltap-throughput"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.start_replica is None:
        if not args.replica:
            parser.error("give --replica URL or --start-replica MODEL_DIR")
        args.groups = {}
        for entry in args.replica:  # NAME=URL puts a running replica in group NAME (paths KIND@NAME)
            name, _, url = entry.rpartition("=") if "=" in entry else ("", "", entry)
            args.groups.setdefault(name, []).append(url)
        args.replica_urls, args.replica_pids = [u for urls in args.groups.values() for u in urls], {}
        return _run(args)
    from tools.replica import VllmReplica

    groups = dict(_server_spec(spec) for spec in args.server) or {"": (args.replicas, 1)}
    group_args = _per_group(parser, args.group_arg, groups, "--group-arg", "NAME=ARG")
    group_env = {name: {key: value for key, _, value in (pair.partition("=") for pair in pairs)}
                 for name, pairs in _per_group(parser, args.group_env, groups, "--group-env", "NAME=KEY=VALUE").items()}
    replicas: list[VllmReplica] = []
    args.groups = {}
    for name, (count, api) in groups.items():
        extra = [*args.replica_arg, *group_args.get(name, [])]
        lora = name == args.lora_group
        if lora and api > 1:  # vLLM refuses runtime LoRA with several API servers
            parser.error(f"--lora-group {name}: its servers take one API server each")
        if lora:
            extra += ["--max-lora-rank", str(args.lora_rank)]  # after VllmReplica's own: the last one counts
        mine = [VllmReplica(args.start_replica, served_model_name=args.model, dtype=args.dtype, max_model_len=1024,
                            extra_args=extra, log_path=args.logs / f"replica-{name or 'all'}-{i}.log",
                            serve_cli=args.vllm_serve, api_servers=api, enable_lora=lora,
                            extra_env=group_env.get(name))
                for i in range(count)]
        args.groups[name] = mine
        replicas += mine
    try:
        for replica in replicas:
            replica.start()
            if not args.start_together:  # its memory profile must not see the next one's allocation
                replica.wait_healthy(900)
        for replica in replicas:
            replica.wait_healthy(900)
        args.groups = {name: [r.url for r in mine] for name, mine in args.groups.items()}
        args.replica_urls = [r.url for r in replicas]
        args.replica_pids = {r.url: r.proc.pid for r in replicas if r.proc is not None}
        return _run(args)
    finally:
        for replica in replicas:
            replica.stop()


def _slug(path: str) -> str:
    """A path's name as rollout ids and file names take it (`proxy_on@c:1` -> `proxy_on-c-1`)."""
    return path.replace("@", "-").replace(":", "-")


def _server_spec(spec: str) -> tuple[str, tuple[int, int]]:
    """`NAME=COUNT[xAPI]` -> (NAME, (COUNT, API))."""
    name, _, size = spec.partition("=")
    count, _, api = size.partition("x")
    if not name or not count.isdigit() or (api and not api.isdigit()):
        raise SystemExit(f"--server {spec!r}: want NAME=COUNT[xAPI], e.g. a=1x4 or c=3")
    return name, (int(count), int(api or 1))


def _group(path: str) -> str:
    """The server group a path runs against (`` for a plain KIND)."""
    return path.partition("@")[2].partition(":")[0]


def _push(args: argparse.Namespace, proxies: list[str]) -> dict[str, Any]:
    """Push the adapters through the LoRA group's first proxy and check every front end serves the last.
    A push that misses a front end raises (throughput on a half-pushed group would measure something
    else); a check that fails after a whole push is reported, and the run measures on."""
    if not proxies:
        raise SystemExit(f"--lora-group {args.lora_group}: give it a proxy path, the pushes go through one")
    from bench.lora_push import push_and_check

    fronts = args.groups[args.lora_group]
    model_dir = args.start_replica or args.lora_model_dir
    if model_dir is None:
        raise SystemExit("--lora-group with running replicas: give --lora-model-dir (the served model's config)")
    found = push_and_check(proxies[0], ADMIN_TOKEN, fronts, Path(model_dir), args.logs, rank=args.lora_rank,
                           pushes=args.pushes, base_model=args.model, tag="bench")
    print(json.dumps({"lora_push": {k: found[k] for k in ("rank", "front_ends", "push_s", "checks")}}), flush=True)
    if not found["ok"]:
        print(f"the LoRA push check failed: {found['checks']}", file=sys.stderr, flush=True)
    return found


def _target(path: str, groups: dict[str, list[str]]) -> tuple[str, list[str]]:
    """`KIND@NAME[:N]` -> (KIND, the replica URLs it runs against); a plain KIND runs against all."""
    kind, _, where = path.partition("@")
    if not where:
        return kind, [url for urls in groups.values() for url in urls]
    name, _, first = where.partition(":")
    if name not in groups:
        raise SystemExit(f"path {path!r}: no server group {name!r} (--server)")
    return kind, groups[name][:int(first)] if first else groups[name]


def _run(args: argparse.Namespace) -> int:
    paths = args.paths.split(",")
    targets: dict[str, tuple[list[str], dict[str, Any]]] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    proxies: dict[str, str] = {}
    lora_paths = [p for p in paths if args.lora_group and _group(p) == args.lora_group]
    args.lora_push = None  # what `_push` found, once the LoRA group's pushes are done
    try:
        for path in paths:
            kind, replicas = _target(path, args.groups)
            if kind in ("direct", "direct_same_ask"):
                ask: dict[str, Any] = {}
                if kind == "direct_same_ask":
                    FORMATS[Route.CHAT].ask_for_tokens(ask, logprobs=True)
                targets[path] = ([f"{url}/v1/chat/completions" for url in replicas], ask)
            elif kind.startswith("proxy_") and kind[6:] in SETTINGS:
                # One proxy per path, one after the other: proxies migrating one fresh database at once race.
                port, name = free_port(), _slug(path)
                procs[path] = _start_proxy(kind[6:], args, port, args.logs, replicas, name, path in lora_paths)
                proxies[path] = f"http://127.0.0.1:{port}"
                wait_ready(proxies[path], "/readyz", procs[path], 120.0,
                           log_path=args.logs / f"proxy-{name}.log", poll_s=0.3)
                targets[path] = ([f"{proxies[path]}/rollout/{{rollout}}/attempt/{{attempt}}/v1/chat/completions"], {})
            else:
                raise SystemExit(f"path {path!r}: not a known kind (direct, direct_same_ask, proxy_on|off|sample)")
        models = {path: args.model for path in paths}
        if lora_paths:
            args.lora_push = _push(args, [proxies[p] for p in lora_paths if p in proxies])
            models |= {p: lora_name(args.pushes) for p in lora_paths if p not in proxies}
        windows: list[dict[str, Any]] = []
        with ProcessPoolExecutor(args.procs) as pool:
            for load in (int(x) for x in args.loads.split(",")):
                for rnd in range(args.rounds):
                    for path in paths:
                        # CPU is charged to the proxy of the path (if any) and to the path's first replica.
                        pids = {"proxy": procs[path].pid} if path in procs else {}
                        first = _target(path, args.groups)[1][0]
                        if first in args.replica_pids:
                            pids |= {"replica_api": args.replica_pids[first], "replica": args.replica_pids[first],
                                     **_vllm_processes(args.replica_pids[first])}
                        windows.append({**_window(path, *targets[path], models[path], args, load, rnd, pool, pids),
                                        "round": rnd})
                        _write(args, windows, paths)
        print(json.dumps(_summary(windows, paths), indent=1))
        return 0 if args.lora_push is None or args.lora_push["ok"] else 1
    finally:
        for proc in procs.values():
            stop_process(proc, 90.0)


def _write(args: argparse.Namespace, windows: list[dict[str, Any]], paths: list[str]) -> None:
    """Write the JSON so far (after every window: a run cut short by a time limit keeps what it measured)."""
    if args.out:
        result = {"args": {k: str(v) for k, v in vars(args).items() if k != "lora_push"}, "machine": machine(),
                  "lora_push": args.lora_push, "windows": windows,
                  "summary": _summary(windows, paths)}
        args.out.write_text(json.dumps(result, indent=1))


def _summary(windows: list[dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    """Per load and path: medians over rounds, and each path's pooled ratio to both direct paths with its
    90% interval (`bench.throughput_report`, which pools several runs the same way)."""
    out: dict[str, Any] = {}
    for load in sorted({w["load"] for w in windows}):
        rows = tagged([w for w in windows if w["load"] == load], "", 1.0)  # one run: windows of one length
        per: dict[str, Any] = {}
        for path in paths:
            mine = [w for w in rows if w["path"] == path]
            entry = {k: statistics.median(w[k] for w in mine if w[k] is not None)
                     for k in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50", "latency_ms_p99")
                     if any(w[k] is not None for w in mine)}
            entry["errors"] = sum(w["errors"] for w in mine)
            for base in baselines(paths):
                found = pooled_ratio(rows, path, base) if path != base else None
                if found:
                    entry[f"x_{base}"] = [round(x, 3) for x in found]
            per[path] = entry
        out[str(load)] = per
    return out


if __name__ == "__main__":
    raise SystemExit(main())
