"""Benchmark: a vLLM server's CPU per streamed token, by what the call asks for.

vLLM's API server is what logprobs cost (docs/gpu-results.md): each token's logprob is decoded to
text, checked, turned into bytes and a pydantic object, then JSON. This starts one real
`vllm serve` (the tiny test model unless `--model`; the Rolltap plugin as installed) and streams
chat calls at it with each ask in turn, interleaved over `--rounds`:

- `plain`: what an agent asks (nothing more);
- `token_ids`: `return_token_ids`, what the proxy always adds;
- `logprobs_decoded`: token IDs and logprobs as vLLM answers an agent asking for them (each
  token's text and bytes);
- `proxy_ask`: what the proxy adds when the agent asked for no logprobs (`proxy.formats`' chat ask:
  logprobs as token IDs, marked so the plugin skips decoding them).

Per ask: tokens/s, and each of the server's processes' CPU (from /proc) per streamed token; the
median over rounds. On a shared 2-core machine the engine competes with the API server for the
CPU, so compare the API server's column between asks of one run, not absolute figures.

    .venv/bin/python -m bench.frontend_cost --streams 32 --seconds 12 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import cpu_seconds, descendants, machine
from proxy.formats import FORMATS
from shared.types import Route


def asks() -> dict[str, dict[str, Any]]:
    proxy: dict[str, Any] = {}
    FORMATS[Route.CHAT].ask_for_tokens(proxy, logprobs=True)
    return {"plain": {}, "token_ids": {"return_token_ids": True},
            "logprobs_decoded": {"return_token_ids": True, "logprobs": True}, "proxy_ask": proxy}


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


async def _stream(url: str, ask: dict[str, Any], streams: int, seconds: float, max_tokens: int) -> int:
    """Streamed chat calls from `streams` agents for `seconds`; content chunks received."""
    tokens = 0
    stop = time.monotonic() + seconds
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count on."}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, **ask}

    async def agent(http: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while time.monotonic() < stop:
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        tokens += 1

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(agent(http) for _ in range(streams)))
    return tokens


def measure(url: str, server_pid: int, streams: int, seconds: float, rounds: int,
            max_tokens: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per ask, per measure: the median, least and most over the rounds."""
    processes = {server_pid, *descendants(server_pid)}
    names = {pid: ("api_server" if pid == server_pid else _name(pid)) for pid in processes}
    found: dict[str, dict[str, list[float]]] = {}
    asyncio.run(_stream(url, {}, streams, 3.0, max_tokens))  # warm-up
    for _ in range(rounds):
        for ask_name, ask in asks().items():
            before = {pid: cpu_seconds(pid) for pid in processes}
            started = time.monotonic()
            tokens = asyncio.run(_stream(url, ask, streams, seconds, max_tokens))
            wall = time.monotonic() - started
            row = found.setdefault(ask_name, {"tokens_per_s": []})
            row["tokens_per_s"].append(tokens / wall)
            for pid in processes:
                spent = cpu_seconds(pid) - before[pid]
                if spent > 0.01:
                    row.setdefault(f"{names[pid]}_us_per_token", []).append(spent / max(tokens, 1) * 1e6)
    return {ask: {key: (statistics.median(values), min(values), max(values)) for key, values in row.items()}
            for ask, row in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: the tiny test model, built here)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--wire", default="auto", help="ROLLTAP_VLLM_LOGPROBS_WIRE for the server (auto, bytes, numpy)")
    args = parser.parse_args(argv)
    from tools.replica import VllmReplica
    from tools.tiny_model import build_tiny_model

    model = args.model or build_tiny_model(Path("/tmp/rolltap-bench-tiny-model"))
    with VllmReplica(model, served_model_name="tiny", extra_env={"ROLLTAP_VLLM_LOGPROBS_WIRE": args.wire}) as replica:
        replica.wait_healthy(600)
        assert replica.proc is not None
        result = measure(replica.url, replica.proc.pid, args.streams, args.seconds, args.rounds, args.max_tokens)
    print(f"# {machine()}; {args.streams} streams, {args.seconds:g} s a window, {args.rounds} rounds, "
          f"median (least-most); wire={args.wire}")
    columns = sorted({key for row in result.values() for key in row})
    print("| ask | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for ask, row in result.items():
        print(f"| {ask} | " + " | ".join("{:,.0f} ({:,.0f}-{:,.0f})".format(*row.get(c, (0, 0, 0))) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
