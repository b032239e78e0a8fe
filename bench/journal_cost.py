"""Benchmark: what the crash journal (`proxy.journal`) costs per call.

Two measurements:

1. In process: the journal's own work per call (start line, request line, record line:
   `started` + `request` + `ended`) for a 16-token chat record and for one with a 16 KB
   prompt, and one `os.fsync` of the journal file on this disk (what `journal_fsync`
   adds per group of calls).
2. End to end: three `rolltap-proxy` processes (`python -m proxy.main`) on SQLite in front
   of the instant replica (`bench.instant_replica`): journal off, on (default, no fsync),
   and on with `journal_fsync`. One client sends calls one at a time, round robin over the
   three so that background load hits them alike; median and p90 latency per target,
   streamed and not.

    .venv/bin/python -m bench.journal_cost [--calls 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.instant_replica import start_instant_replica
from proxy.journal import Journal
from shared.types import CallRecord
from tests.support.proxy_process import ProxyProcess
from tests.support.servers import free_port


def _record(prompt_chars: int) -> tuple[CallRecord, bytes]:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "x" * prompt_chars}], "stream": True,
               "return_token_ids": True, "logprobs": True}
    import orjson

    now = datetime.now(UTC)
    record = CallRecord(
        call_id="call-0123456789abcdef0000000000000000", rollout_id="rollout-1", attempt_id="0",
        route="chat/completions", is_streaming=True, status="ok", started_at=now, ended_at=now, first_byte_at=now,
        http_status=200, request=request,
        response={"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 16},
                               "finish_reason": "length"}], "usage": {"prompt_tokens": 20, "completion_tokens": 16}},
        prompt_token_ids=list(range(20 + prompt_chars // 4)), completion_token_ids=list(range(16)),
        completion_logprobs=[-0.5] * 16, finish_reason="length", usage={"prompt_tokens": 20}, replica="http://r",
        policy_version=0, requested_model="m", served_model="tiny",
    )
    return record, orjson.dumps(request)


def in_process(n: int = 20000) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(Path(tmp), segment_bytes=1 << 30)
        journal.open()
        for label, chars in (("16-token chat record", 40), ("16 KB prompt", 16384)):
            record, payload = _record(chars)
            started = time.perf_counter()
            for i in range(n):
                journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, i)
                journal.request(record.call_id, payload)
                journal.ended(record, request_journaled=True)  # as the relay does: the request line has it
            per_call_us = (time.perf_counter() - started) / n * 1e6
            print(f"journal, {label}: {per_call_us:.1f} us per call (start + request + record lines, no fsync)")
        fd = os.open(Path(tmp) / "fsync-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        times = []
        for _ in range(200):
            os.write(fd, b"x" * 600)
            started = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - started)
        os.close(fd)
        print(f"os.fsync after a 600-byte append: median {statistics.median(times) * 1e3:.3f} ms, "
              f"p90 {sorted(times)[int(len(times) * 0.9)] * 1e3:.3f} ms")
        journal.durable([])


def end_to_end(calls: int) -> None:
    replica, stop_replica = start_instant_replica(port=0)
    configs = {"journal off": {"ROLLTAP_PROXY__RECORDER__JOURNAL": "false"},
               "journal on": {},
               "journal + fsync": {"ROLLTAP_PROXY__RECORDER__JOURNAL_FSYNC": "true"}}
    proxies: dict[str, ProxyProcess] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, env in configs.items():
                work = Path(tmp) / name.replace(" ", "_").replace("+", "")
                work.mkdir()
                proxies[name] = proxy = ProxyProcess(work, f"sqlite:///{work / 'db.sqlite'}", [replica], free_port(),
                                                     ROLLTAP_PROXY__LOG_LEVEL="warning", **env)
                proxy.start()
            with httpx.Client(timeout=30) as client:
                for is_streaming in (False, True):
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                            "stream": is_streaming}
                    latencies: dict[str, list[float]] = {name: [] for name in proxies}
                    for i in range(calls + 50):
                        for name, proxy in proxies.items():
                            url = f"{proxy.url}/rollout/bench-{int(is_streaming)}/attempt/{i % 8}/v1/chat/completions"
                            started = time.perf_counter()
                            response = client.post(url, json=body)
                            elapsed = time.perf_counter() - started
                            assert response.status_code == 200, response.text
                            if i >= 50:  # warm-up left out
                                latencies[name].append(elapsed)
                    kind = "streamed" if is_streaming else "non-streamed"
                    base = statistics.median(latencies["journal off"])
                    for name, values in latencies.items():
                        values.sort()
                        median = statistics.median(values)
                        print(f"{kind:13s} {name:16s} median {median * 1e3:.3f} ms "
                              f"(+{(median - base) * 1e6:.0f} us), p90 {values[int(len(values) * 0.9)] * 1e3:.3f} ms, "
                              f"n={len(values)}")
        finally:
            for proxy in proxies.values():
                proxy.stop()
            stop_replica()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="measured calls per target and mode")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    in_process()
    end_to_end(args.calls)


if __name__ == "__main__":
    main()
