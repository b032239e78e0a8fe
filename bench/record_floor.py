"""Benchmark: the least CPU a recorded call can cost, whatever the proxy around it.

A recording proxy must at least parse the replica's response (to pull out token IDs,
logprobs, finish reason and usage), encode the row, and insert it. This measures exactly
that and nothing else, at its cheapest: orjson, the stdlib `sqlite3` driver with
`executemany` in 32-row batches, WAL, `synchronous=NORMAL`, no ORM, no sequence numbers,
no queue or thread hop. The response is the instant replica's 16-token chat completion
with logprobs (`bench.instant_replica`), the request the one `bench.proxy_overhead` sends.

Together with the uvicorn floor of `bench.proxy_overhead` it bounds the throughput any
uvicorn-served recording proxy can reach against that replica (docs/benchmarks.md).

    .venv/bin/python -m bench.record_floor [--batches 300]
"""

from __future__ import annotations

import argparse
import http.client
import os
import sqlite3
import tempfile
import time

import orjson

from bench.instant_replica import PROMPT_TOKEN_IDS, start_instant_replica
from bench.proxy_overhead import request_body

BATCH = 32


def canned_response() -> bytes:
    """The instant replica's non-streamed answer, as its wire body (16 tokens, logprobs, token IDs)."""
    url, stop = start_instant_replica(model_name="tiny")
    try:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/chat/completions", request_body(False, 16), {"content-type": "application/json"})
        body = conn.getresponse().read()
        conn.close()
        return body
    finally:
        stop()


def measure(raw: bytes, request: bytes, batches: int) -> float:
    """CPU µs per call to parse request and response, encode and insert `batches` x 32 records."""
    workdir = tempfile.mkdtemp(prefix="rolltap-record-floor-")
    con = sqlite3.connect(os.path.join(workdir, "calls.db"), isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("CREATE TABLE calls (id INTEGER PRIMARY KEY, call_id TEXT, rollout_id TEXT, attempt_id TEXT, "
                "request TEXT, response TEXT, prompt_token_ids TEXT, completion_token_ids TEXT, "
                "completion_logprobs TEXT, finish_reason TEXT, usage TEXT, started_at TEXT, ended_at TEXT)")
    sql = ("INSERT INTO calls (call_id, rollout_id, attempt_id, request, response, prompt_token_ids, "
           "completion_token_ids, completion_logprobs, finish_reason, usage, started_at, ended_at) "
           "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")
    started = time.process_time()
    for b in range(batches):
        rows = []
        for i in range(BATCH):
            body = orjson.loads(request)  # the proxy reads the request to route and rewrite it
            response = orjson.loads(raw)
            choice = response["choices"][0]
            logprobs = [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or ()]
            rows.append((f"call-{b}-{i}", "r", f"a{i}", orjson.dumps(body), orjson.dumps(response),
                         orjson.dumps(response.get("prompt_token_ids", PROMPT_TOKEN_IDS)),
                         orjson.dumps(choice.get("token_ids")), orjson.dumps(logprobs), choice.get("finish_reason"),
                         orjson.dumps(response.get("usage")), "2026-01-01 00:00:00.000000",
                         "2026-01-01 00:00:00.000000"))
        con.execute("BEGIN")
        con.executemany(sql, rows)
        con.execute("COMMIT")
    seconds = time.process_time() - started
    con.close()
    return seconds / (batches * BATCH) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.record_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    raw = canned_response()
    request = request_body(False, 16)
    runs = sorted(measure(raw, request, a.batches) for _ in range(a.repeat))
    print(f"response {len(raw)} bytes; parse + encode + sqlite3 insert, {BATCH}-row batches: "
          f"median {runs[len(runs) // 2]:.1f} µs CPU per call (min {runs[0]:.1f}, max {runs[-1]:.1f}; "
          f"{a.repeat} runs of {a.batches * BATCH} calls)")


if __name__ == "__main__":
    main()
