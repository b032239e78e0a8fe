"""The call journal: what a `kill -9` of the proxy would otherwise lose, on local disk.

Each proxy process appends to its own files (`<owner>.<n>.jsonl`, owner = pid and 32
random bits) and holds an exclusive `flock` on `<owner>.lock` for its whole life:

    {"s": call_id, ...}       a call started (before admission: it may never get further)
    {"q": call_id, "request"} the request as sent upstream (the bytes already encoded for it)
    {"e": record}             the call's record, written before its last byte reaches the client
                              (without the request when its "q" line holds it)

Writes are plain `os.write` on an `O_APPEND` descriptor: the data is in the kernel's
page cache when `write` returns, so it survives the death of the process without an
fsync; only a machine crash needs `journal_fsync` (grouped: one fsync in a thread
serves every call waiting at that moment).

Lines written while the event loop runs are grouped: each goes into the current batch,
and the batch is written with one `os.write` when the loop next turns (the write was a
third of the journal's CPU, one syscall per line). A call that must not go on before its
line is on disk (before its request goes upstream, before its end reaches the client)
awaits the batch's future (`written`). With no running loop, lines are written at once.

A file is rotated at `journal_segment_bytes` and deleted once every call with a line in
it is committed or spooled (`durable`): a call's request and end lines go to whatever file
is current then, which may be a later one than its start's. On start, `recover` claims the files of owners
whose lock is free (their process is dead: the kernel drops a dead process's locks),
and turns them into records: the journaled record of a call that ended, an
`interrupted` record for a call that started and never ended. They are written
before the proxy serves, idempotently (by call id), and the files removed after.

It must not touch the database or HTTP: the recorder writes what `recover` returns.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

import orjson

from shared.types import CallRecord, CallStatus
from shared.verbatim import ExactJsonError, dumps_exact, loads_exact

__all__ = ["Journal", "Recovery", "recover"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_LOCK_SUFFIX = ".lock"
_FIELDS = tuple(f.name for f in dataclasses.fields(CallRecord))
_values = attrgetter(*_FIELDS)
_TIME_FIELDS = ("started_at", "ended_at", "first_byte_at")
_BYTE_FIELDS = ("request_body", "response_body")


_IOV_MAX = 1024  # buffers one `writev` takes (Linux)


def _write_all(fd: int, pieces: list[bytes], size: int) -> None:
    """Write `pieces` (`size` bytes in all) in order with no copy to join them: a call's request
    and answer go to the disk from the buffers that already hold them."""
    done = 0
    if len(pieces) <= _IOV_MAX:
        done = os.writev(fd, pieces)
        if done == size:
            return
    # More buffers than one call takes, or a short write (a signal, a disk filling up): the rest
    # from one buffer, until it is all out or the disk refuses.
    view = memoryview(b"".join(pieces))[done:]
    while view:
        view = view[os.write(fd, view):]


def _bytes(value: Any) -> str:
    """orjson's `default` for a record's exact bodies: base64, as `CallRecord.from_json` reads them."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError


def _dumps_row_exact(row: dict[str, Any]) -> bytes:
    """A record's row through `dumps_exact` (lone surrogates, wide numbers), which writes no datetimes
    or bytes: those are made text first, as orjson would write them."""
    row = dict(row)
    for name in _TIME_FIELDS:
        if row[name] is not None:
            row[name] = row[name].isoformat()
    for name in _BYTE_FIELDS:
        if row[name] is not None:
            row[name] = _bytes(row[name])
    try:
        return dumps_exact(row)
    except ExactJsonError:  # nested too deep to write: the exact bodies carry it
        row["response"] = None
        if "request" in row:  # left out when the request line holds it
            row["request"] = None
        return dumps_exact(row)


class _Batch(asyncio.Future[None]):
    """The future of one batch of lines, shared by every call in it: a waiter's cancellation (its
    client left) must not cancel it for the others. That waiter is cancelled once the batch is
    written instead, a loop turn later (`asyncio.Task.cancel` defers when its future refuses)."""

    def cancel(self, msg: Any = None) -> bool:
        return False


class Journal:
    """This process's journal. `open()` before the first call; `close()` after the last record is durable."""

    def __init__(self, directory: Path, *, fsync: bool = False, segment_bytes: int = 64 * 1024 * 1024) -> None:
        self.directory = directory
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._owner = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._lock_fd = -1
        self._fd = -1
        self._segment = 0
        self._size = 0
        self._open_calls: dict[str, int] = {}  # call id -> the segment its start is in
        # Call id -> the later segments its request or end line went to, after a rotation (rare).
        self._later_segments: dict[str, list[int]] = {}
        self._segment_calls: dict[int, int] = {}  # segment -> calls not yet durable with a line in it
        self._written = 0  # writes so far, and the count the last fsync covered
        self._synced = 0
        self._pending: list[bytes] = []  # the pieces of the batch's lines, not yet written
        self._pending_bytes = 0
        self._batch: asyncio.Future[None] | None = None  # resolved once `_pending` is written
        self._sync_task: asyncio.Task[None] | None = None
        self.error: str | None = None  # the last write's `OSError` while the disk refuses writes

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def open_calls(self) -> int:
        return len(self._open_calls)

    def open(self) -> None:
        """Start journaling. Raises `OSError` when the disk refuses (a full disk at start): the
        journal is then failing, and each new call tries again (`started`)."""
        self._guard(self._open)

    def _open(self) -> None:
        if self._lock_fd < 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Locked under a temporary name, then renamed: a recovering process never sees our
            # lock file unlocked and takes us for dead.
            tmp = self.directory / f".{self._owner}.lock-new"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(tmp, self.directory / f"{self._owner}{_LOCK_SUFFIX}")
            except BaseException:
                os.close(fd)  # nothing half-made stays behind to block the next try
                tmp.unlink(missing_ok=True)
                raise
            self._lock_fd = fd
        self._open_segment()

    def _segment_path(self, n: int) -> Path:
        return self.directory / f"{self._owner}.{n:06d}.jsonl"

    def _open_segment(self) -> None:
        # The new file first: when the disk refuses it, the current segment stays open.
        fd = self._guard(os.open, self._segment_path(self._segment + 1), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o644)
        if self._fd >= 0:
            os.close(self._fd)
            if self._segment_calls.get(self._segment, 0) == 0:
                self._remove_segment(self._segment)
        self._segment += 1
        self._size = 0
        self._segment_calls[self._segment] = 0
        self._fd = fd

    def _remove_segment(self, n: int) -> None:
        self._segment_calls.pop(n, None)
        self._segment_path(n).unlink(missing_ok=True)

    def _guard(self, write: Callable[..., _T], *args: Any) -> _T:
        """Run a disk write; an `OSError` (disk full, read-only, I/O error) marks the journal failing."""
        try:
            result = write(*args)
        except OSError as exc:
            if self.error is None:
                logger.error("journal: %s refuses writes (%s); new calls are refused until it takes them again",
                             self.directory, exc)
            self.error = f"{exc.__class__.__name__}: {exc.strerror or exc}"
            raise
        if self.error is not None:
            logger.info("journal: %s takes writes again", self.directory)
            self.error = None
        return result

    def probe(self) -> None:
        """While failing: try a page-sized write (then take it back), so readiness sees the disk has room
        again without waiting for a call. A smaller probe could fit in a page the disk already gave us."""
        if self.error is None:
            return
        if self._fd < 0:
            with contextlib.suppress(OSError):
                self.open()
            return
        with contextlib.suppress(OSError):
            self._guard(_write_all, self._fd, [b"\n" * 4096], 4096)
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)

    def _append(self, pieces: list[bytes], size: int) -> None:
        """Write whole lines (`pieces`, `size` bytes in all) at the end of the segment."""
        try:
            self._guard(_write_all, self._fd, pieces, size)
        except OSError:
            # A full disk can take part of a line: cut it off, or the next line would be glued to it
            # (and both lost to recovery). Truncating frees space, so it works on a full disk.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += size
        self._written += 1

    # -- the hot path ---------------------------------------------------------------------

    def _enqueue(self, *pieces: bytes) -> asyncio.Future[None] | None:
        """Add a line (in `pieces`, written one after the other) to the current batch; its future, or None
        once the line is written (no loop running, or a failing disk, where each line tries the disk itself
        and a refusal raises `OSError` here)."""
        size = sum(map(len, pieces))
        if self.error is not None:
            self.flush()
            self._append(list(pieces), size)
            return None
        if self._batch is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._append(list(pieces), size)
                return None
            self._batch = _Batch(loop=loop)
            loop.call_soon(self.flush)
        self._pending += pieces
        self._pending_bytes += size
        return self._batch

    def flush(self) -> None:
        """Write the current batch now (the loop does this on its next turn); its waiters learn how it went."""
        batch, self._batch = self._batch, None
        pieces, size, self._pending, self._pending_bytes = self._pending, self._pending_bytes, [], 0
        try:
            if pieces:
                self._append(pieces, size)
        except OSError as exc:
            if batch is not None and not batch.done():
                batch.set_exception(exc)
                batch.exception()  # retrieved here: a call refused before it went upstream never awaits it
            return
        if batch is not None and not batch.done():
            batch.set_result(None)

    @staticmethod
    async def written(batch: asyncio.Future[None] | None) -> None:
        """Return once a line's batch is on disk (page cache); raises its `OSError` when the disk refused it."""
        if batch is not None:
            await batch

    def started(self, call_id: str, rollout_id: str | None, attempt_id: str | None, route: str,
                started_at: datetime, arrival: int) -> asyncio.Future[None] | None:
        """Journal a call's start (see `_enqueue`: the call must not go upstream before it is `written`)."""
        if self._fd < 0:
            self.open()  # it could not be opened at start
        elif self._size + self._pending_bytes >= self._segment_bytes:
            self.flush()  # the batch belongs to the segment its calls were counted in
            self._open_segment()
        batch = self._enqueue(orjson.dumps({"s": call_id, "r": rollout_id, "a": attempt_id, "route": route,
                                            "t": started_at, "n": arrival}), b"\n")
        self._open_calls[call_id] = self._segment
        self._segment_calls[self._segment] += 1
        return batch

    def request(self, call_id: str, payload: bytes) -> asyncio.Future[None] | None:
        """The request as sent upstream: `payload` is already JSON, spliced in without re-encoding."""
        self._held_here(call_id)
        return self._enqueue(b'{"q":' + orjson.dumps(call_id) + b',"request":', payload, b"}\n")

    def _held_here(self, call_id: str) -> None:
        """A line of `call_id` goes to the current segment: keep it until the call is durable."""
        start = self._open_calls.get(call_id)
        if start is None or start == self._segment:
            return  # recovered or durable already, or in its start's segment (the common case)
        later = self._later_segments.setdefault(call_id, [])
        if self._segment not in later:
            later.append(self._segment)
            self._segment_calls[self._segment] += 1

    def ended(self, record: CallRecord, *, request_journaled: bool = False) -> asyncio.Future[None] | None:
        """Journal a call's record. `request_journaled`: its request line (`request`) is on disk, so this
        line leaves the request out and recovery takes it from there (an agent's request holds its whole
        context: written once, not twice)."""
        # A shallow dict in `CallRecord.from_json`'s encoding, made by orjson itself (RFC 3339 datetimes,
        # base64 bytes through `_bytes`) rather than `to_json`, whose deep copy (`asdict`) cost ~100x the
        # encoding. `dumps_exact`: what a client or model sent (lone surrogates, huge numbers) is
        # journaled exactly too.
        row = dict(zip(_FIELDS, _values(record), strict=True))
        if request_journaled and row["request"] is not None:
            del row["request"]
        try:
            line = orjson.dumps(row, default=_bytes)
        except TypeError:  # orjson's JSONEncodeError too: what only `dumps_exact` writes
            line = _dumps_row_exact(row)
        self._held_here(record.call_id)
        return self._enqueue(b'{"e":', line, b"}\n")

    async def sync(self) -> None:
        """With `journal_fsync`: return once everything written so far is fsynced (group commit)."""
        if not self._fsync:
            return
        self.flush()
        target = self._written
        while self._synced < target:
            if self._sync_task is None or self._sync_task.done():
                self._sync_task = asyncio.get_running_loop().create_task(self._sync_once())
            await asyncio.shield(self._sync_task)

    async def _sync_once(self) -> None:
        upto = self._written
        await asyncio.get_running_loop().run_in_executor(None, self._guard, os.fsync, self._fd)
        self._synced = max(self._synced, upto)

    def durable(self, records: list[CallRecord]) -> None:
        """These records are committed or spooled: their journal lines are no longer needed."""
        for record in records:
            segment = self._open_calls.pop(record.call_id, None)
            if segment is None:
                continue  # recovered from an earlier process, or already durable
            self._let_go(segment)
            for later in self._later_segments.pop(record.call_id, ()):
                self._let_go(later)

    def _let_go(self, segment: int) -> None:
        left = self._segment_calls[segment] - 1
        self._segment_calls[segment] = left
        if left == 0 and segment != self._segment:
            self._remove_segment(segment)

    def close(self) -> None:
        """Stop journaling; the files go when nothing in them is still needed (a clean stop)."""
        if self._lock_fd < 0:
            return
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1
        if self._open_calls:
            logger.warning("journal: %d call(s) not durable at stop; %s kept for the next start",
                           len(self._open_calls), self.directory)
        else:
            for n in list(self._segment_calls):
                self._remove_segment(n)
            (self.directory / f"{self._owner}{_LOCK_SUFFIX}").unlink(missing_ok=True)
        os.close(self._lock_fd)  # releases the lock: what is left is recovered by the next start
        self._lock_fd = -1


@dataclass
class Recovery:
    """Records rebuilt from the journals of dead processes, and the files to remove once they are safe."""

    records: list[CallRecord] = field(default_factory=list)
    interrupted: int = 0
    files: list[Path] = field(default_factory=list)
    _lock_fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        """The records are committed or spooled: remove the journals (locks last) and let go of them."""
        for path in sorted(self.files, key=lambda p: p.suffix == _LOCK_SUFFIX):
            path.unlink(missing_ok=True)
        self.files.clear()
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds.clear()


def recover(directory: Path) -> Recovery:
    """Claim and read the journals of dead owners in `directory` (their locks stay held until `release`)."""
    out = Recovery()
    if not directory.is_dir():
        return out
    for lock in sorted(directory.glob(f"*{_LOCK_SUFFIX}")):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # its owner is alive
            continue
        if not lock.exists():  # another process recovered and removed it meanwhile
            os.close(fd)
            continue
        out._lock_fds.append(fd)
        owner = lock.name[: -len(_LOCK_SUFFIX)]
        segments = sorted(directory.glob(f"{owner}.*.jsonl"))
        records, interrupted = _read(segments)
        out.records.extend(records)
        out.interrupted += interrupted
        out.files.extend([*segments, lock])
    seen: set[str] = set()
    unique = []
    for record in out.records:
        if record.call_id not in seen:
            seen.add(record.call_id)
            unique.append(record)
    out.records = sorted(unique, key=lambda r: (r.started_at, r.arrival))
    return out


def _read(segments: list[Path]) -> tuple[list[CallRecord], int]:
    starts: dict[str, dict[str, Any]] = {}
    requests: dict[str, Any] = {}
    ends: dict[str, dict[str, Any]] = {}
    last_write = datetime.fromtimestamp(0, UTC)
    for path in segments:
        last_write = max(last_write, datetime.fromtimestamp(path.stat().st_mtime, UTC))
        for line in path.read_bytes().splitlines():
            try:
                entry = loads_exact(line)
            except ExactJsonError:
                continue  # the last line of a process killed mid-write
            if "e" in entry:
                ends[entry["e"]["call_id"]] = entry["e"]  # its request may be in its "q" line
            elif "s" in entry:
                starts[entry["s"]] = entry
            elif "q" in entry:
                requests[entry["q"]] = entry["request"]
    for call_id, end in ends.items():
        if "request" not in end:
            end["request"] = requests.get(call_id)
    records = [CallRecord.from_json(end) for end in ends.values()]
    interrupted = 0
    for call_id, start in starts.items():
        if call_id in ends:
            continue
        interrupted += 1
        started_at = datetime.fromisoformat(start["t"])
        records.append(CallRecord(
            call_id=call_id, rollout_id=start["r"], attempt_id=start["a"], route=start["route"],
            is_streaming=bool(isinstance(requests.get(call_id), dict) and requests[call_id].get("stream")),
            status=CallStatus.INTERRUPTED,
            started_at=started_at,
            # The journal's last write: the latest the process can have been alive.
            ended_at=max(started_at, last_write),
            error={"message": "the proxy stopped (killed or crashed) before this call ended; "
                              "its answer, if any, was not kept", "type": "interrupted", "param": None,
                   "code": "proxy_interrupted"},
            request=requests.get(call_id),
            arrival=int(start.get("n", 0)),
        ))
    return records, interrupted
