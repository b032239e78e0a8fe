"""Benchmark: rollout throughput through the proxy against vLLM directly, per `proxy.rollout_logprobs`.

Against one running vLLM replica it starts one `rolltap-proxy` per logprob setting (`on`, `off`,
`sample`; open access, each on its own database or all on one PostgreSQL database), then, for
each load (concurrent streaming agents), runs windows of the same streamed chat calls (fixed
prompts, `ignore_eos`, `max_tokens` tokens each) alternating between the paths, `--rounds` times:

- `direct`: the replica as an agent would call it;
- `direct_same_ask`: the replica asked what the proxy asks with logprobs on (token IDs, logprobs);
- `proxy_on`, `proxy_off`, `proxy_sample`: through the proxy's templated route, one attempt per call.

Per window: generated tokens/s (calls that started after the warm-up and ended inside the
window), time to first content p50/p99, whole-call latency p50/p99. The load comes from
`--procs` processes so the client is not the bottleneck. Ratios are taken against both direct
paths in the same round. Prints and writes JSON (`--out`).

    python -m bench.rollout_throughput --replica http://127.0.0.1:8100 --model tiny \\
        --db 'sqlite:////tmp/rt-{name}.db' --loads 8 --window-s 5 --rounds 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import free_port, machine, stop_process, wait_ready

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("on", "off", "sample")
PROMPTS = [f"Write a short story about a {thing}." for thing in
           ("lighthouse", "fox", "violin", "glacier", "market", "comet", "river", "clockmaker")]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _load(urls: list[str], extra: dict[str, Any], model: str, agents: int, first: int, warmup_s: float,
          window_s: float, max_tokens: int) -> dict[str, Any]:
    """One load process: `agents` agents streaming back to back, cut off at the window's end.

    Throughput counts the content chunks (one per generated token) that arrive inside the
    window, so calls longer than the window count too; latency counts calls that started and
    ended inside it, time to first token calls that started inside it."""
    tokens = 0
    ttft: list[float] = []
    latency: list[float] = []
    errors = 0

    async def main() -> None:
        nonlocal errors, tokens
        t0 = time.monotonic()
        start, end = t0 + warmup_s, t0 + warmup_s + window_s
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            async def agent(i: int) -> None:
                nonlocal errors, tokens
                n = 0
                while True:
                    url = urls[0].format(rollout=f"bench-{first + i}", attempt=n)
                    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[(first + i + n) % len(PROMPTS)]}],
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
                                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                                    now = time.monotonic()
                                    if start <= now <= end:
                                        tokens += 1
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

            tasks = [asyncio.ensure_future(agent(i)) for i in range(agents)]
            await asyncio.sleep(end - time.monotonic())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    return {"tokens": tokens, "ttft": ttft, "latency": latency, "errors": errors}


def _window(path: str, urls: list[str], extra: dict[str, Any], args: argparse.Namespace, load: int,
            pool: ProcessPoolExecutor) -> dict[str, Any]:
    per = [load // args.procs + (1 if p < load % args.procs else 0) for p in range(args.procs)]
    firsts = [sum(per[:p]) for p in range(args.procs)]
    futures = [pool.submit(_load, urls, extra, args.model, n, firsts[p] + load * 1000, args.warmup_s,
                           args.window_s, args.max_tokens) for p, n in enumerate(per) if n]
    results = [f.result() for f in futures]
    ttft = [t * 1000 for r in results for t in r["ttft"]]
    latency = [t * 1000 for r in results for t in r["latency"]]
    out = {"path": path, "load": load, "calls": len(latency), "errors": sum(r["errors"] for r in results),
           "tokens_per_s": sum(r["tokens"] for r in results) / args.window_s, "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
           "latency_ms_p50": _pct(latency, 0.5), "latency_ms_p99": _pct(latency, 0.99)}
    print(json.dumps(out), flush=True)
    return out


def _start_proxy(setting: str, args: argparse.Namespace, port: int, logs: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROLLTAP_PROXY__OPEN_ACCESS": "true", "ROLLTAP_PROXY__ROLLOUT_LOGPROBS": setting,
           "ROLLTAP_PROXY__ROLLOUT_LOGPROBS_RATE": str(args.sample_rate), "ROLLTAP_PROXY__LOG_LEVEL": "warning",
           "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(logs / f"spool-{setting}")}
    log = open(logs / f"proxy-{setting}.log", "wb")  # noqa: SIM115
    return subprocess.Popen([sys.executable, "-m", "proxy.main", "--replica", args.replica, "--port", str(port),
                             "--db", args.db.format(name=setting)], env=env, cwd=ROOT, stdout=log, stderr=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", default=None, help="a running vLLM replica's base URL (no /v1)")
    parser.add_argument("--model", required=True, help="the replica's served model name")
    parser.add_argument("--start-replica", type=Path, default=None, metavar="MODEL_DIR",
                        help="instead of --replica: start one (tools.replica, as scripts.learn does) serving this model")
    parser.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                        help="extra vLLM argument for --start-replica (repeatable, e.g. --replica-arg=--api-server-count=4)")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM --dtype for --start-replica")
    parser.add_argument("--db", default="sqlite:////tmp/rolltap-throughput-{name}.db",
                        help="database URL per proxy; `{name}` becomes its setting (one PostgreSQL URL may serve all)")
    parser.add_argument("--loads", default="64,256", help="concurrent streaming agents, comma-separated")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of all paths per load")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sample-rate", type=float, default=0.0625)
    parser.add_argument("--procs", type=int, default=8, help="load-generating processes")
    parser.add_argument("--paths", default="direct,direct_same_ask,proxy_on,proxy_off,proxy_sample")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/rolltap-throughput"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.start_replica is None:
        if args.replica is None:
            parser.error("give --replica URL or --start-replica MODEL_DIR")
        return _run(args)
    from tools.replica import VllmReplica

    with VllmReplica(args.start_replica, served_model_name=args.model, dtype=args.dtype, max_model_len=1024,
                     extra_args=args.replica_arg, log_path=args.logs / "replica.log") as replica:
        args.replica = replica.url
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    paths = args.paths.split(",")
    ports = {s: free_port() for s in SETTINGS if f"proxy_{s}" in paths}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    direct = f"{args.replica}/v1/chat/completions"
    targets: dict[str, tuple[list[str], dict[str, Any]]] = {
        "direct": ([direct], {}),
        "direct_same_ask": ([direct], {"return_token_ids": True, "logprobs": True}),
        **{f"proxy_{s}": ([f"http://127.0.0.1:{p}/rollout/{{rollout}}/attempt/{{attempt}}/v1/chat/completions"], {})
           for s, p in ports.items()},
    }
    try:
        for s, port in ports.items():  # one after the other: proxies migrating one fresh database at once race
            procs[s] = _start_proxy(s, args, port, args.logs)
            wait_ready(f"http://127.0.0.1:{port}", "/readyz", procs[s], 120.0,
                       log_path=args.logs / f"proxy-{s}.log", poll_s=0.3)
        windows: list[dict[str, Any]] = []
        with ProcessPoolExecutor(args.procs) as pool:
            for load in (int(x) for x in args.loads.split(",")):
                for rnd in range(args.rounds):
                    for path in paths:
                        windows.append({**_window(path, *targets[path], args, load, pool), "round": rnd})
        summary = _summary(windows, paths)
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
                  "windows": windows, "summary": summary}
        text = json.dumps(result, indent=1)
        print(json.dumps(summary, indent=1))
        if args.out:
            args.out.write_text(text)
        return 0
    finally:
        for proc in procs.values():
            stop_process(proc, 90.0)


def _summary(windows: list[dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    """Per load and path: medians over rounds, and each path's ratio to both direct paths per round."""
    out: dict[str, Any] = {}
    for load in sorted({w["load"] for w in windows}):
        rows = [w for w in windows if w["load"] == load]
        per: dict[str, Any] = {}
        for path in paths:
            mine = [w for w in rows if w["path"] == path]
            entry = {k: statistics.median(w[k] for w in mine if w[k] is not None)
                     for k in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50", "latency_ms_p99")
                     if any(w[k] is not None for w in mine)}
            entry["errors"] = sum(w["errors"] for w in mine)
            for base in ("direct", "direct_same_ask"):
                ratios = [w["tokens_per_s"] / b["tokens_per_s"] for w in mine for b in rows
                          if b["path"] == base and b["round"] == w["round"] and b["tokens_per_s"]]
                if ratios and path != base:
                    entry[f"x_{base}"] = round(statistics.median(ratios), 3)
            per[path] = entry
        out[str(load)] = per
    return out


if __name__ == "__main__":
    raise SystemExit(main())
