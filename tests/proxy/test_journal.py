"""The call journal on its own: what a dead process leaves is recovered, a live one's is not touched."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from proxy.journal import Journal, recover
from shared.types import CallRecord, CallStatus

ROOT = Path(__file__).resolve().parents[2]

# A process that journals two calls (one ended, one not), then waits to be killed.
WRITER = textwrap.dedent("""
    import sys, time
    from datetime import UTC, datetime
    from pathlib import Path
    from proxy.journal import Journal
    from shared.types import CallRecord
    j = Journal(Path(sys.argv[1]))
    j.open()
    now = datetime.now(UTC)
    j.started("call-done", "r", "a", "chat/completions", now, 0)
    j.request("call-done", b'{"messages":[{"role":"user","content":"hi\\\\u0000"}],"stream":true}')
    j.ended(CallRecord(call_id="call-done", rollout_id="r", attempt_id="a", route="chat/completions",
                       is_streaming=True, status="ok", started_at=now, ended_at=now,
                       response={"choices": [{"message": {"content": "yo"}}]}, completion_token_ids=[1, 2]))
    j.started("call-cut", "r", "a", "chat/completions", now, 1)
    j.request("call-cut", b'{"messages":[],"stream":true}')
    print("ready", flush=True)
    time.sleep(60)
""")


def _record(call_id: str) -> CallRecord:
    now = datetime.now(UTC)
    return CallRecord(call_id=call_id, rollout_id="r", attempt_id="a", route="chat/completions",
                      is_streaming=False, status="ok", started_at=now, ended_at=now)


def test_dead_owner_recovered_live_owner_left_alone(tmp_path: Path) -> None:
    live = Journal(tmp_path)
    live.open()
    live.started("call-live", "r", "b", "chat/completions", datetime.now(UTC), 0)

    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    assert recover(tmp_path).records == []  # its owner is alive: not ours to take
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # The dead process's last line is half written.
    (segment,) = [p for p in tmp_path.glob(f"{proc.pid}-*.jsonl")]
    with open(segment, "ab") as fh:
        fh.write(b'{"e": {"call_id": "call-torn", "rol')

    recovery = recover(tmp_path)
    done, cut = recovery.records
    assert (done.call_id, done.status, done.completion_token_ids) == ("call-done", "ok", [1, 2])
    assert done.response == {"choices": [{"message": {"content": "yo"}}]}
    assert (cut.call_id, cut.status, cut.error["code"]) == ("call-cut", CallStatus.INTERRUPTED, "proxy_interrupted")
    assert cut.request == {"messages": [], "stream": True} and cut.is_streaming
    assert cut.ended_at >= cut.started_at
    assert recovery.interrupted == 1
    # A second recoverer cannot take the same files while the first holds them.
    assert recover(tmp_path).records == []
    recovery.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.glob(f"{live.owner}*"))
    assert recover(tmp_path).records == []  # nothing left but the live journal
    live.durable([_record("call-live")])
    live.close()
    assert list(tmp_path.iterdir()) == []  # a clean stop leaves nothing


def test_segments_go_once_their_calls_are_durable(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=4096)
    journal.open()
    records = [_record(f"call-{i}") for i in range(200)]
    for i, record in enumerate(records):
        journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, i)
        journal.ended(record)
    segments = sorted(tmp_path.glob("*.jsonl"))
    assert len(segments) > 3  # rotated
    journal.durable(records[:100])
    left = sorted(tmp_path.glob("*.jsonl"))
    assert segments[0] not in left and len(left) < len(segments)  # the early ones are gone
    journal.durable(records[100:])
    assert len(list(tmp_path.glob("*.jsonl"))) == 1  # only the one being written
    assert journal.open_calls == 0
    journal.close()
    assert list(tmp_path.iterdir()) == []


def test_lines_of_one_loop_turn_share_one_write_and_a_cancelled_waiter_leaves_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Counting the kernel writes (os.writev and os.write are the journal's only ways to the disk;
    # nothing of ours is replaced).
    writes: list[int] = []
    real_write, real_writev = os.write, os.writev

    def counting_write(fd: int, data: bytes | memoryview) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    def counting_writev(fd: int, buffers: list[bytes]) -> int:
        writes.append(sum(map(len, buffers)))
        return real_writev(fd, buffers)

    journal = Journal(tmp_path)
    journal.open()
    monkeypatch.setattr(os, "write", counting_write)
    monkeypatch.setattr(os, "writev", counting_writev)

    async def call(i: int) -> None:
        await Journal.written(journal.started(f"call-{i}", "r", "a", "chat/completions", datetime.now(UTC), i))

    async def main() -> list[BaseException | None]:
        tasks = [asyncio.create_task(call(i)) for i in range(50)]
        await asyncio.sleep(0)  # every call has queued its line and waits for the batch
        tasks[0].cancel()  # its client left: the batch is shared, the others must not be cancelled with it
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    monkeypatch.undo()
    assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [None] * 49
    assert len(writes) == 1  # 50 lines, one system call
    (segment,) = tmp_path.glob("*.jsonl")
    assert segment.read_bytes().count(b"\n") == 50  # the cancelled call's line is written too
    journal.durable([_record(f"call-{i}") for i in range(50)])
    journal.close()


def test_a_segment_holding_a_later_line_of_a_call_not_yet_durable_is_kept(tmp_path: Path) -> None:
    """A call's request and end lines land in whatever segment is current then: a segment whose own
    calls are all durable still holds them, and must stay until that call is durable too."""
    journal = Journal(tmp_path, segment_bytes=4096)
    journal.open()
    long = _record("call-long")
    journal.started(long.call_id, "r", "a", "chat/completions", long.started_at, 0)
    others: list[CallRecord] = []

    def rotate() -> None:  # calls that start and end until a new segment is opened
        count = len(list(tmp_path.glob("*.jsonl")))
        while len(list(tmp_path.glob("*.jsonl"))) == count:
            record = _record(f"call-{len(others)}")
            journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, len(others) + 1)
            journal.ended(record)
            others.append(record)

    rotate()
    journal.request(long.call_id, b'{"messages":[],"stream":false}')  # in the second segment
    rotate()
    journal.ended(long)  # in the third
    rotate()
    journal.durable(others)  # every call but the long one is in the database
    journal.close()  # dies before it is: its lines are what the next start recovers

    recovery = recover(tmp_path)
    # The first segment is kept for the long call's start; the durable calls in it come back too,
    # and recovery writes them idempotently (by call id).
    (found,) = [r for r in recovery.records if r.call_id == long.call_id]
    assert found.status == "ok" and recovery.interrupted == 0
    recovery.release()
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_call_keeps_its_request_line_from_a_later_segment(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=4096)
    journal.open()
    journal.started("call-cut", "r", "a", "chat/completions", datetime.now(UTC), 0)
    others: list[CallRecord] = []
    while len(list(tmp_path.glob("*.jsonl"))) < 2:
        record = _record(f"call-{len(others)}")
        journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, len(others) + 1)
        journal.ended(record)
        others.append(record)
    journal.request("call-cut", b'{"messages":[],"stream":true}')
    while len(list(tmp_path.glob("*.jsonl"))) < 3:
        record = _record(f"call-{len(others)}")
        journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, len(others) + 1)
        journal.ended(record)
        others.append(record)
    journal.durable(others)
    journal.close()

    recovery = recover(tmp_path)
    (cut,) = [r for r in recovery.records if r.call_id == "call-cut"]
    assert cut.status == CallStatus.INTERRUPTED and recovery.interrupted == 1
    assert cut.request == {"messages": [], "stream": True} and cut.is_streaming
    recovery.release()


def test_a_batch_of_more_lines_than_one_writev_takes_is_written_whole_and_in_order(tmp_path: Path) -> None:
    # Three buffers a line: 600 request lines are 1,800 buffers, past the kernel's 1,024 for one call.
    journal = Journal(tmp_path)
    journal.open()

    async def main() -> None:
        batches = [journal.request(f"call-{i}", b'{"n":%d}' % i) for i in range(600)]
        await asyncio.gather(*(Journal.written(b) for b in batches))

    asyncio.run(main())
    (segment,) = tmp_path.glob("*.jsonl")
    assert segment.read_bytes().splitlines() == [b'{"q":"call-%d","request":{"n":%d}}' % (i, i) for i in range(600)]
    journal.close()


def test_an_end_line_leaves_a_journaled_request_out_and_recovery_puts_it_back_exactly(tmp_path: Path) -> None:
    from shared.verbatim import dumps_exact, loads_exact

    journal = Journal(tmp_path)
    journal.open()
    request = loads_exact(b'{"messages":[{"role":"user","content":"' + b"ctx " * 1000 + b'\\ud800"}]}')
    as_sent = dumps_exact(request)  # beyond orjson (a lone surrogate): the exact writer's bytes
    plain = {"messages": [], "model": "m"}
    records = [
        CallRecord(call_id="call-wide", rollout_id="r", attempt_id="a", route="chat/completions", is_streaming=False,
                   status="ok", started_at=datetime.now(UTC), ended_at=datetime.now(UTC), request=request),
        # A response orjson cannot write (a lone surrogate): the whole line takes the exact writer.
        CallRecord(call_id="call-odd", rollout_id="r", attempt_id="a", route="chat/completions", is_streaming=False,
                   status="ok", started_at=datetime.now(UTC), ended_at=datetime.now(UTC), request=plain,
                   response=loads_exact(b'{"x":"\\ud800"}')),
        CallRecord(call_id="call-plain", rollout_id="r", attempt_id="a", route="chat/completions", is_streaming=False,
                   status="ok", started_at=datetime.now(UTC), ended_at=datetime.now(UTC), request=plain),
        # Refused before its request line (a hosted model, a full disk): the end line carries the request.
        CallRecord(call_id="call-unsent", rollout_id="r", attempt_id="a", route="chat/completions",
                   is_streaming=False, status="ok", started_at=datetime.now(UTC), ended_at=datetime.now(UTC),
                   request=plain),
    ]
    for record, sent in zip(records, [as_sent, orjson.dumps(plain), orjson.dumps(plain), None], strict=True):
        journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, 0)
        if sent is not None:
            journal.request(record.call_id, sent)
        journal.ended(record, request_journaled=sent is not None)
    journal.close()
    # The context is on disk once: in the request line, not again in the end line.
    assert sum(path.read_bytes().count(b"ctx ") for path in tmp_path.glob("*.jsonl")) == 1000
    recovered = {r.call_id: r for r in recover(tmp_path).records}
    assert recovered["call-wide"].request == request and dumps_exact(recovered["call-wide"].request) == as_sent
    assert recovered["call-odd"].response == records[1].response and recovered["call-odd"].request == plain
    assert recovered["call-plain"].request == plain
    assert recovered["call-unsent"].request == plain


def test_an_end_line_reads_back_as_the_record_field_for_field(tmp_path: Path) -> None:
    """orjson writes the datetimes and `_bytes` the exact bodies: recovery gives back an equal record,
    with a lone surrogate (the exact writer's path) and without."""
    from datetime import timedelta

    from shared.verbatim import loads_exact

    started = datetime(2026, 12, 7, 18, 0, 0, tzinfo=UTC)  # no microseconds: written without them
    full = CallRecord(
        call_id="call-full", rollout_id="r", attempt_id="a", route="chat/completions", is_streaming=True,
        status="ok", started_at=started, ended_at=started + timedelta(microseconds=1234),
        first_byte_at=started + timedelta(microseconds=17), http_status=200, error=None,
        request={"messages": [{"role": "user", "content": "hi\x00"}]}, response={"choices": [{"index": 0}]},
        response_truncated=True, request_body=b'{"messages":\xff\x00}', response_body=b"data: {}\n\n\x80",
        prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5], finish_reason="length",
        usage={"prompt_tokens": 2}, replica="http://***@replica:8000", policy_version=3, requested_model="m",
        served_model="policy-3", arrival=7)
    odd = dataclasses.replace(full, call_id="call-odd", response=loads_exact(b'{"x":"\\ud800"}'))
    journal = Journal(tmp_path)
    journal.open()
    for record in (full, odd):
        journal.started(record.call_id, "r", "a", "chat/completions", record.started_at, record.arrival)
        journal.request(record.call_id, orjson.dumps(record.request))
        journal.ended(record, request_journaled=True)
    journal.close()
    recovered = {r.call_id: r for r in recover(tmp_path).records}
    assert recovered["call-full"] == full
    assert recovered["call-odd"] == odd
