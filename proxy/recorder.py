"""The write path: a bounded queue drained in batches by one writer task.

Guarantees (ARCHITECTURE.md): a request never awaits the database; a full queue makes
callers wait (back-pressure) and never drops; when the database is unreachable,
batches are spooled to local disk and written back, in order, once it answers;
`wait_durable` is the flush barrier behind `finish`. SQLite gets exactly one writer:
lifecycle writes (rewards, finish, registration) go through the same task as records.

It must not parse responses or touch HTTP: records arrive complete.

The writer lingers (`recorder.linger_ms`) after the first record of a batch so that the
records of calls ending close together share one transaction: a commit's fixed cost (the
WAL write and fsync on SQLite, a round trip on PostgreSQL) was most of a call's CPU when
calls came one at a time. Nothing waits on the linger: a `finish` barrier, a lifecycle
write or a stop cuts it short, and a record is in the journal before its call's end
reaches the client, so a crash in that window loses nothing.

On SQLite, record batches are written by a plain `sqlite3` connection in the writer's own
thread, one thread hop per batch: through aiosqlite every statement costs several hops
(cursor, execute, fetch, close), which made a one-record batch cost ~2 ms of CPU, more
than the call it records. Lifecycle writes still use the async engine; both are driven by
the one writer task, one at a time, so SQLite never sees two writers at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy import metrics
from proxy.outage import is_outage, sqlstate
from proxy.store import SeqCounters, add_undurable_sync, release_leases_sync, write_calls, write_calls_sync
from shared.errors import Conflict, DatabaseUnavailable, InvalidRequest, RolltapError
from shared.settings import RecorderSettings
from shared.types import CallRecord
from shared.verbatim import dumps_exact, loads_exact

__all__ = ["DEAD_REASON", "Recorder", "Spool"]

logger = logging.getLogger(__name__)

Key = tuple[str, str]
Op = Callable[[AsyncConnection], Awaitable[Any]]


@dataclass(slots=True)
class _Pending:
    """Calls of one attempt that started but are not yet durable."""

    count: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _OpItem:
    op: Op
    future: asyncio.Future[Any]


class _Stop:
    pass


Item = CallRecord | _OpItem | _Stop


def _write_timed_out() -> DatabaseUnavailable:
    return DatabaseUnavailable("database write did not complete in time", retry_after_s=1.0)


class Spool:
    """Batches waiting on local disk, one fsynced JSON-lines file per batch, replayed in name order."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seq = 0

    def files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("*.jsonl") if p.is_file())

    def write(self, records: list[CallRecord], reason: str | None = None) -> Path:
        """`reason`: why the database refused these records (dead-letter files only)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        path = self.directory / f"{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            for record in records:
                line = record.to_json()
                if reason is not None:
                    line[DEAD_REASON] = reason
                fh.write(dumps_exact(line) + b"\n")  # exact: lone surrogates too
            fh.flush()
            os.fsync(fh.fileno())
        tmp.rename(path)  # atomic: a replay never sees half a batch
        return path

    @staticmethod
    def read(path: Path) -> list[CallRecord]:
        return [CallRecord.from_json(line) for line in Spool.read_lines(path)]

    @staticmethod
    def read_lines(path: Path) -> list[dict[str, Any]]:
        lines = path.read_bytes().splitlines()
        return [loads_exact(line) for line in lines if line.strip()]


DEAD_REASON = "_dead_reason"  # on each line of a dead-letter file: why the database refused it


class Recorder:
    def __init__(self, settings: RecorderSettings, engine: AsyncEngine, sync_engine: Engine | None = None,
                 on_durable: Callable[[list[CallRecord]], None] | None = None, *, release_leases: bool = False) -> None:
        """`sync_engine`: write record batches through it, in a thread of their own (SQLite).

        `on_durable(records)`: told when records are committed or spooled (the journal lets go of them).
        """
        self._on_durable = on_durable
        # Told when records are in the database (or noted there as refused); `proxy.cluster` sets it.
        self.on_committed: Callable[[list[CallRecord]], None] | None = None
        self._release_leases = release_leases  # `proxy.cluster`: a record's commit ends its call's lease
        self._settings = settings
        self._engine = engine
        self._sync_engine = sync_engine
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rolltap-writer") if sync_engine is not None else None
        self._queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=settings.queue_size)
        self._pending: dict[Key, _Pending] = {}
        self._seqs = SeqCounters()  # sequence numbers, handed out here (`proxy.store.write_calls_sync`)
        self._spool = Spool(settings.spool_dir)
        self._task: asyncio.Task[None] | None = None
        self._next_retry = 0.0
        self._outage = asyncio.Event()  # set while the database is unreachable: wakes `finish` barriers
        self._lingering: asyncio.Future[None] | None = None  # the writer's linger, while it lingers
        self._barriers = 0  # `wait_durable` callers waiting now: the writer does not linger for them
        self._has_spool = False
        # Records neither the database nor the disk took (an outage on a full disk), oldest first:
        # kept here, retried every `retry_interval_s`, and new calls are refused meanwhile.
        self._held: list[CallRecord] = []
        self._dead_held: list[tuple[CallRecord, str]] = []  # dead letters the disk refused
        self._storage_error: str | None = None
        self.written_total = 0

    # -- the hot path -------------------------------------------------------------------

    def begin(self, key: Key | None) -> None:
        """A call of `key` started: `finish` must now wait for its record."""
        if key is None:
            return
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
        pending.count += 1
        pending.idle.clear()

    async def submit(self, record: CallRecord) -> None:
        """Queue a finished call's record. Waits while the queue is full; never drops."""
        if self._task is None or self._task.done():
            raise DatabaseUnavailable("recorder is not running")
        await self._queue.put(record)
        metrics.RECORDER_QUEUE.set(self._queue.qsize())

    # -- lifecycle writes and barriers ----------------------------------------------------

    async def run(self, op: Op, timeout_s: float) -> Any:
        """Run `op(conn)` in the writer's next transaction and return its result, within `timeout_s`
        in all (a full queue counts against it too: an outage must be answered, not waited out)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        item = _OpItem(op, future)

        async def queued_and_done() -> Any:
            await self._queue.put(item)
            self._hurry()  # a caller waits for this write: a lingering batch goes now
            return await asyncio.shield(future)

        try:
            return await asyncio.wait_for(queued_and_done(), timeout_s)
        except TimeoutError as exc:
            future.cancel()  # the writer skips an op whose caller gave up
            raise _write_timed_out() from exc

    async def run_beside(self, op: Op, timeout_s: float) -> Any:
        """`run` for a long write that calls' records must not queue behind (a LoRA adapter of
        hundreds of MB: 4-10 s on PostgreSQL). Where the database takes concurrent writers
        (PostgreSQL) it runs at once on a connection of its own; on SQLite, one writer, it goes
        through the queue like `run`."""
        if self._sync_engine is not None:
            return await self.run(op, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._in_transaction(op)
        except TimeoutError as exc:
            raise _write_timed_out() from exc

    async def wait_durable(self, key: Key, timeout_s: float) -> bool:
        """Wait until every call of `key` that started so far is committed. False on timeout, and at
        once while the database is unreachable (or an outage begins meanwhile): nothing would commit
        before it returns, and the caller answers 503 with Retry-After rather than hang."""
        pending = self._pending.get(key)
        if pending is None or pending.count == 0:
            return True
        if not self.is_db_healthy:
            return False
        waits = [asyncio.ensure_future(pending.idle.wait()), asyncio.ensure_future(self._outage.wait())]
        self._barriers += 1  # until it returns, no batch lingers: its calls may still be in flight
        self._hurry()
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._barriers -= 1
            for wait in waits:
                wait.cancel()
        return pending.idle.is_set()

    def _hurry(self) -> None:
        """Someone waits on the writer: a batch lingering for companions is written now."""
        if self._lingering is not None and not self._lingering.done():
            self._lingering.set_result(None)

    async def _linger(self, seconds: float) -> None:
        """Wait `seconds` for more records to join the batch, or less when `_hurry` says so."""
        loop = asyncio.get_running_loop()
        self._lingering = waiter = loop.create_future()
        timer = loop.call_later(seconds, self._hurry)
        try:
            await waiter
        finally:
            timer.cancel()
            self._lingering = None

    def _done(self, records: list[CallRecord]) -> None:
        if self._on_durable is not None:
            self._on_durable(records)
        if self.on_committed is not None:
            self.on_committed(records)
        for record in records:
            key = record.attempt_key
            pending = self._pending.get(key) if key is not None else None
            if pending is None:
                continue  # replayed from a spool written by an earlier process
            pending.count -= 1
            if pending.count <= 0:
                pending.idle.set()
                # Forget idle attempts so the map does not grow with every attempt ever seen.
                del self._pending[key]  # type: ignore[arg-type]

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def is_db_healthy(self) -> bool:
        return not self._outage.is_set()

    @property
    def local_storage_error(self) -> str | None:
        """Why records wait in memory (the spool's disk refuses writes); None when none do."""
        return self._storage_error if self._held or self._dead_held else None

    async def recover(self, records: list[CallRecord]) -> None:
        """Before `start`: write records a dead process journaled, ahead of any new call.

        Idempotent (records already committed are skipped), so a crash during recovery only
        repeats it. Behind batches spooled earlier, or when the database is down, they are
        spooled, keeping their order.
        """
        if not records:
            return
        if self._spool.files():
            self._spool_write(records)
            return
        try:
            await self._write(records, skip_existing=True)
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_outage(exc):
                await self._write_one_by_one(records)
                return
            self._on_outage(exc)
            self._spool_write(records)
            return
        self.written_total += len(records)
        metrics.RECORDS_WRITTEN.inc(len(records))

    # -- the writer task --------------------------------------------------------------------

    async def start(self) -> None:
        # Batches spooled by an earlier process are written back first.
        self._has_spool = bool(self._spool.files())
        self._task = asyncio.create_task(self._run(), name="rolltap-recorder")

    async def stop(self, timeout_s: float) -> None:
        """Write what is queued (until the deadline), then spool whatever is left."""
        if self._task is None:
            return
        await self._queue.put(_Stop())
        self._hurry()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            logger.warning("recorder: flush deadline passed; spooling the rest to %s", self._spool.directory)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._spool_leftovers()
        self._task = None
        if self._thread is not None and self._sync_engine is not None:
            # Closed in the thread that opened it (sqlite3 connections belong to their thread).
            try:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    self._thread, self._sync_engine.dispose), timeout_s)
            except Exception:  # noqa: BLE001 - shutting down; the process exits next
                logger.warning("recorder: the writer thread did not close its connection", exc_info=True)
            self._thread.shutdown(wait=False)

    def _spool_leftovers(self) -> None:
        records: list[CallRecord] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, CallRecord):
                records.append(item)
            elif isinstance(item, _OpItem) and not item.future.done():
                item.future.set_exception(DatabaseUnavailable("proxy shutting down"))
        if records:
            self._spool_write(records)

    async def _run(self) -> None:
        linger_s = self._settings.linger_ms / 1000
        while True:
            if self._has_spool:
                # During an outage, retry the spool even when no new records arrive.
                try:
                    item = await asyncio.wait_for(self._queue.get(), self._settings.retry_interval_s)
                except TimeoutError:
                    await self._replay_spool()
                    continue
            else:
                item = await self._queue.get()
            batch: list[Item] = [item]
            if linger_s and isinstance(item, CallRecord) and not self._barriers:
                await self._linger(linger_s)
            # Whatever queued while the last batch was being written joins this one.
            while len(batch) < self._settings.batch_max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            metrics.RECORDER_QUEUE.set(self._queue.qsize())
            stop = any(isinstance(i, _Stop) for i in batch)
            await self._write_batch([i for i in batch if not isinstance(i, _Stop)])
            if stop:
                # Leftovers that arrived after the stop marker are written too.
                rest = []
                while not self._queue.empty():
                    rest.append(self._queue.get_nowait())
                await self._write_batch([i for i in rest if not isinstance(i, _Stop)])
                if self._held:
                    logger.error("recorder: stopping with %d record(s) that neither the database nor the disk "
                                 "took; only the journal (if it could be written) keeps them", len(self._held))
                return

    async def _write_batch(self, batch: list[Item]) -> None:
        """Write a batch; whatever goes wrong, the writer lives on and no record is let go of."""
        try:
            await self._write_items(batch)
        except Exception:  # noqa: BLE001 - a bug here must not stop every later write
            logger.exception("recorder: writing a batch failed; its records are held and retried")
            records = [i for i in batch if isinstance(i, CallRecord)]
            self._held.extend(r for r in records if r not in self._held)
            self._has_spool = True
            self._storage_error = self._storage_error or "the writer failed (see the log)"
            for item in batch:
                if isinstance(item, _OpItem) and not item.future.done():
                    item.future.set_exception(DatabaseUnavailable("database write failed", retry_after_s=1.0))

    async def _write_items(self, batch: list[Item]) -> None:
        records = [i for i in batch if isinstance(i, CallRecord)]
        ops = [i for i in batch if isinstance(i, _OpItem)]
        if self._has_spool:
            await self._replay_spool()
        if records:
            await self._write_records(records)
        for item in ops:
            await self._run_op(item)

    async def _write_records(self, records: list[CallRecord]) -> None:
        if self._has_spool:
            # Older batches still wait on disk: queue behind them there, keeping order.
            self._spool_write(records)
            return
        started = time.perf_counter()
        try:
            await self._write(records)
        except Exception as exc:  # noqa: BLE001 - classified below, never swallowed silently
            if is_outage(exc):
                self._on_outage(exc)
                self._spool_write(records)
                return
            logger.exception("recorder: batch of %d failed; writing one by one", len(records))
            await self._write_one_by_one(records)
            return
        metrics.RECORDER_WRITE_SECONDS.observe(time.perf_counter() - started)
        self._mark_healthy()
        self.written_total += len(records)
        metrics.RECORDS_WRITTEN.inc(len(records))
        self._done(records)

    async def _write(self, records: list[CallRecord], *, skip_existing: bool = False) -> None:
        """Write `records` in one transaction: in the writer thread (SQLite) or on the async engine."""
        try:
            if self._thread is not None:
                await asyncio.get_running_loop().run_in_executor(self._thread, self._write_sync, records,
                                                                 skip_existing)
            else:
                async with self._engine.begin() as conn:
                    await write_calls(conn, records, skip_existing=skip_existing,
                                      release_leases=self._release_leases, seqs=self._seqs)
        except BaseException:
            self._seqs.forget()  # whatever it numbered did not commit, or may not have
            raise
        self._seqs.commit()

    def _write_sync(self, records: list[CallRecord], skip_existing: bool) -> None:
        assert self._sync_engine is not None
        with self._sync_engine.begin() as conn:
            write_calls_sync(conn, records, skip_existing=skip_existing, seqs=self._seqs)

    def _spool_write(self, records: list[CallRecord]) -> None:
        """Spool `records` behind any held in memory; when the disk refuses them, hold them in memory."""
        self._has_spool = True
        batch = [*self._held, *records]
        if not batch:
            return
        try:
            self._spool.write(batch)
        except OSError as exc:
            if not self._held:
                logger.error("recorder: the spool's disk refuses writes (%s); %d record(s) held in memory, new "
                             "calls refused until the database or the disk takes them", exc, len(batch))
            self._held = batch
            self._storage_error = f"spool: {exc.__class__.__name__}: {exc.strerror or exc}"
            metrics.RECORDS_HELD.set(len(self._held))
            return
        self._held = []
        metrics.RECORDS_HELD.set(0)
        metrics.RECORDS_SPOOLED.inc(len(records))
        if self._on_durable is not None:
            self._on_durable(batch)  # fsynced on disk: as safe as the journal

    async def _write_one_by_one(self, records: list[CallRecord]) -> None:
        for record in records:
            try:
                await self._write([record], skip_existing=True)
            except Exception as exc:  # noqa: BLE001
                if is_outage(exc):
                    self._on_outage(exc)
                    self._spool_write([record])
                    continue
                await self._dead_letter(record, exc)
            self._done([record])

    async def _dead_letter(self, record: CallRecord, exc: BaseException) -> None:
        """Keep a record the database refused on disk for a human, and say so everywhere.

        Never dropped, never retried forever: `rolltap-proxy spool replay` writes it once the
        cause is fixed. Its `undurable_calls` row makes `finish` and GET attempt say so.
        """
        reason = f"{exc.__class__.__name__}: {(str(getattr(exc, 'orig', None) or exc).splitlines() or [''])[0][:500]}"
        dead = self._spool.directory / "dead"
        logger.error("recorder: call %s cannot be written (%s); kept in %s", record.call_id, reason, dead)
        self._keep_dead(record, reason)
        metrics.RECORDS_UNDURABLE.inc()
        try:
            if self._thread is not None and self._sync_engine is not None:
                await asyncio.get_running_loop().run_in_executor(self._thread, self._note_undurable_sync,
                                                                 record, reason)
            else:
                async with self._engine.begin() as conn:
                    await conn.run_sync(add_undurable_sync, [record], reason)
                    if self._release_leases:  # noted as undurable: `finish` reports it instead of waiting
                        await conn.run_sync(release_leases_sync, [record.call_id])
        except Exception:  # noqa: BLE001 - the dead-letter file is kept; /readyz counts it
            logger.exception("recorder: could not note undurable call %s in the database", record.call_id)

    def _keep_dead(self, record: CallRecord, reason: str) -> bool:
        """Write a dead letter to disk; held in memory (and retried) while the disk refuses it."""
        try:
            Spool(self._spool.directory / "dead").write([record], reason)
        except OSError as exc:
            self._dead_held.append((record, reason))
            self._storage_error = f"dead-letter spool: {exc.__class__.__name__}: {exc.strerror or exc}"
            self._has_spool = True
            return False
        return True

    def _note_undurable_sync(self, record: CallRecord, reason: str) -> None:
        assert self._sync_engine is not None
        with self._sync_engine.begin() as conn:
            add_undurable_sync(conn, [record], reason)

    @property
    def dead_letter_records(self) -> int:
        """Records in the dead-letter spool (a directory listing: cheap enough for /readyz)."""
        return len(Spool(self._spool.directory / "dead").files())

    def _on_outage(self, exc: BaseException) -> None:
        if self.is_db_healthy:
            logger.error("recorder: database unreachable (%s); spooling to %s", exc, self._spool.directory)
        self._outage.set()
        self._next_retry = time.monotonic() + self._settings.retry_interval_s

    def _mark_healthy(self) -> None:
        if not self.is_db_healthy:
            logger.info("recorder: database reachable again")
        self._outage.clear()

    async def _replay_spool(self) -> bool:
        """Write spooled batches back in order, then those held in memory. True when none is left."""
        if time.monotonic() < self._next_retry:
            return False
        waiting, self._dead_held = self._dead_held, []
        for record, reason in waiting:
            self._keep_dead(record, reason)  # back on the list, once, if the disk still refuses it
        for path in self._spool.files():
            records = Spool.read(path)
            try:
                await self._write(records, skip_existing=True)
            except Exception as exc:  # noqa: BLE001
                if is_outage(exc):
                    self._on_outage(exc)
                    return False
                logger.exception("recorder: spooled batch %s failed; writing one by one", path.name)
                path.unlink()
                await self._write_one_by_one(records)
                continue
            path.unlink()
            self.written_total += len(records)
            metrics.RECORDS_WRITTEN.inc(len(records))
            self._done(records)
        if self._held and not await self._write_held():
            return False
        if self._dead_held:
            self._next_retry = time.monotonic() + self._settings.retry_interval_s
            return False
        self._mark_healthy()
        self._has_spool = False
        return True

    async def _write_held(self) -> bool:
        """Records held in memory: to the database, else to the disk if it takes them again."""
        held = self._held
        try:
            await self._write(held, skip_existing=True)
        except Exception as exc:  # noqa: BLE001 - classified below
            if is_outage(exc):
                self._on_outage(exc)
                self._spool_write([])  # at least onto the disk, if it has room again
                return False
            self._held = []
            await self._write_one_by_one(held)
        else:
            self._held = []
            self.written_total += len(held)
            metrics.RECORDS_WRITTEN.inc(len(held))
            self._done(held)
        metrics.RECORDS_HELD.set(0)
        logger.info("recorder: %d record(s) held in memory are written", len(held))
        return True

    def _op_error(self, exc: Exception) -> Exception:
        """What a lifecycle call answers when its write failed: an outage is a 503 with Retry-After
        (durability not confirmed). Any other database error fails the same way on every retry, so
        it is never a 503 (a client honouring Retry-After would retry forever): a value the database
        refuses is the request's fault (400), a constraint a conflict (409), anything else a 500
        in OpenAI's shape (never an unhandled one that closes the client's connection)."""
        if is_outage(exc):
            self._on_outage(exc)
            return DatabaseUnavailable(f"database unreachable: {exc.__class__.__name__}", retry_after_s=1.0)
        if not isinstance(exc, DBAPIError):
            return exc
        code = sqlstate(exc) or ""
        reason = (str(exc.orig if exc.orig is not None else exc).strip().splitlines() or [""])[0][:300]
        if isinstance(exc, DataError) or code.startswith("22"):  # class 22: data exception
            return InvalidRequest(f"the database refused a value of this request: {reason}", code="invalid_value")
        if isinstance(exc, IntegrityError) or code.startswith("23"):  # class 23: integrity constraint
            return Conflict(f"the database refused this write: {reason}", code="constraint_violation")
        logger.error("recorder: lifecycle write failed: %s", exc)
        return RolltapError(f"database write failed: {exc.__class__.__name__}", code="database_error")

    async def _in_transaction(self, op: Op) -> Any:
        """`op` in a transaction of its own; a failure raised as the lifecycle call answers it (`_op_error`)."""
        try:
            async with self._engine.begin() as conn:
                return await op(conn)
        except Exception as exc:  # noqa: BLE001 - mapped, never swallowed
            raise self._op_error(exc) from None

    async def _run_op(self, item: _OpItem) -> None:
        if item.future.done():
            return  # its caller gave up waiting
        try:
            result = await self._in_transaction(item.op)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
            if not item.future.done():
                item.future.set_exception(exc)
            return
        self._mark_healthy()
        if not item.future.done():
            item.future.set_result(result)
