"""Several proxies on one PostgreSQL database acting as one: shared state, registry, leases.

Every proxy process (a `--workers` process, or one on another host) is a member:

- Shared state, with the database as the source of truth: the active policy
  (`policy_versions`) and the admission pause (`cluster_state`, with an epoch bumped on
  every change). A change commits a new epoch and `pg_notify`s it; each member LISTENs,
  re-reads the state and acknowledges the epoch in its `proxies` row (its heartbeat).
  The heartbeat re-reads the state too, so a member whose listener dropped catches up
  within `heartbeat_s`, and a member that (re)connects starts from the current state.
- The registry: `proxies` rows with heartbeats. A pause waits until every live member
  has drained for its epoch, a policy change until every live member applied it; a member
  silent for `dead_after_s` is dead and not waited for.
- Call leases: a tracked call holds a `call_leases` row from its start until the
  transaction that commits its record deletes it, so `finish` on any member can wait for
  calls in flight on the others. Leases are inserted in batches by one task; a call waits
  for its lease row before it goes upstream (`before_upstream`).
- The reaper: each member's heartbeat claims the rows of dead members and turns their
  leases into `interrupted` records, in one transaction (written idempotently by call id;
  the dead member's own journal recovery, if it ever runs, replaces them with the complete
  records it journaled and adds nothing twice).
- Unleased calls: a member that cannot write lease rows (the database is unreachable from
  it) still serves, but only once the others take it for cut off (its heartbeat `stale_s`
  old); `finish` waits while any live member is in that state or reports unleased calls
  not yet committed (`before_upstream`, `wait_accounted`).
- Replica ejections: a member that ejects a replica (it saw it healthy, then connection
  errors, `eject_after_errors` 5xx in a row or failed probes) holds a `replica_ejections`
  row and `pg_notify`s `REPLICA_CHANNEL`; every member re-reads the rows on the
  notification (and each heartbeat) and keeps a replica that any *live* member holds
  ejected out of its pool, so the hash ring of rollouts moves alike everywhere. Only the
  ejecting member lifts its row: when its own probe passes again, and no sooner than
  `eject_hold_s` after the ejection. Why this shape: re-admission by any member's probe
  would let a replica that fails calls but passes `/health` flap in and out as members
  disagree; a shared "until" timestamp alone would re-admit a replica still failing. A
  dead member's rows stop counting once its heartbeat is `dead_after_s` old (and go with its
  registry row), so a crash never pins a replica out.

asyncpg is used directly only here, for LISTEN; everything else goes through
`proxy.store`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy import store
from proxy.admission import Admission
from proxy.balancer import Balancer
from proxy.policy import ActivePolicy
from shared.errors import DatabaseUnavailable, ServiceUnavailable
from shared.settings import ClusterSettings
from shared.types import CallRecord, CallStatus

__all__ = ["CHANNEL", "REPLICA_CHANNEL", "Cluster"]

logger = logging.getLogger(__name__)

CHANNEL = "rolltap_cluster"
REPLICA_CHANNEL = "rolltap_replicas"
_LEASE_WAIT_S = 2.0  # longest a call waits for its lease row, before upstream or before its record


def _listen_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Cluster:
    """This process's membership. `start()` after the recorder and balancer, `stop()` before them."""

    def __init__(self, settings: ClusterSettings, db_url: str, engine: AsyncEngine, policy: ActivePolicy,
                 admission: Admission, balancer: Balancer) -> None:
        self._settings = settings
        self._dsn = _listen_dsn(db_url)
        self._engine = engine
        self._policy = policy
        self._admission = admission
        self._balancer = balancer
        self.proxy_id = f"{socket.gethostname()[:40]}-{os.getpid()}-{os.urandom(4).hex()}"
        self.epoch = -1  # the shared state epoch applied here
        self._sync_lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._listener: Any = None
        self._drain_task: asyncio.Task[None] | None = None
        self._lease_rows: list[dict[str, Any]] = []
        self._lease_waiters: list[asyncio.Future[bool]] = []
        self._lease_kick = asyncio.Event()
        self._leases_ok = True  # False while lease writes fail: calls go unleased (see `before_upstream`)
        self._last_beat_ok = time.monotonic()  # the last heartbeat the database took
        # Another member takes this one for cut off once its heartbeat is this old (and waits for it in
        # `finish`): twice the beat, well inside `dead_after_s`.
        self.stale_s = min(2 * settings.heartbeat_s, settings.dead_after_s / 2)
        self.unleased: set[str] = set()  # calls sent upstream without a lease row, not yet committed
        self._replicas_kick = asyncio.Event()
        balancer.eject_hold_s = settings.eject_hold_s
        balancer.on_health_change = self._replicas_kick.set

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._engine.begin() as conn:
            await store.register_proxy(conn, self.proxy_id, socket.gethostname(), os.getpid())
        self._last_beat_ok = time.monotonic()  # after the commit: the row's time is no later than this
        await self.sync()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen_loop(), name="rolltap-cluster-listen"),
                       loop.create_task(self._sync_loop(), name="rolltap-cluster-sync"),
                       loop.create_task(self._heartbeat_loop(), name="rolltap-cluster-heartbeat"),
                       loop.create_task(self._lease_loop(), name="rolltap-cluster-leases"),
                       loop.create_task(self._replicas_loop(), name="rolltap-cluster-replicas")]
        logger.info("cluster: member %s (epoch %d, %s)", self.proxy_id, self.epoch,
                    "paused" if self._admission.is_paused else "admitting")

    async def stop(self) -> None:
        """Leave the registry (records are flushed by the recorder afterwards; leases go with them)."""
        for task in [*self._tasks, *([self._drain_task] if self._drain_task else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self._close_listener()
        try:
            async with self._engine.begin() as conn:
                await store.deregister_proxy(conn, self.proxy_id)
        except Exception:  # noqa: BLE001 - the row expires on its own after `dead_after_s`
            logger.warning("cluster: could not leave the registry; the row expires in %.0f s", self._settings.dead_after_s)

    # -- shared state -----------------------------------------------------------------------

    async def sync(self) -> None:
        """Read the shared state and apply it here if its epoch moved; acknowledge it."""
        async with self._sync_lock:
            async with self._engine.connect() as conn:
                epoch, paused = await store.read_cluster_state(conn)
                if epoch == self.epoch:
                    return
                active = await store.load_active_policy(conn)
            if active is not None:
                self._policy.set(*active)
            if paused:
                self._admission.pause()
            else:
                self._admission.resume()
            self.epoch = epoch
            async with self._engine.begin() as conn:
                await store.ack_epoch(conn, self.proxy_id, seen=epoch, drained=None if paused else epoch)
            if paused:
                if self._drain_task is not None:
                    self._drain_task.cancel()
                self._drain_task = asyncio.get_running_loop().create_task(self._ack_drained(epoch))

    async def _ack_drained(self, epoch: int) -> None:
        while self._balancer.in_flight > 0:
            await asyncio.sleep(0.005)
        async with self._engine.begin() as conn:
            await store.ack_epoch(conn, self.proxy_id, drained=epoch)

    async def publish(self, paused: bool | None = None,
                      op: Callable[[AsyncConnection], Awaitable[None]] | None = None) -> int:
        """Commit `op` and a new epoch (setting the pause when given), notify every member, apply here."""
        async with self._engine.begin() as conn:
            if op is not None:
                await op(conn)
            epoch = await store.bump_epoch(conn, CHANNEL, paused)
        await self.sync()
        return epoch

    async def wait_applied(self, epoch: int, timeout_s: float, *, drained: bool) -> list[str]:
        """Wait until every live member applied `epoch` (and, with `drained`, has no call in flight).
        Returns the members still lagging at the deadline (empty: all done)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        delay = 0.002
        while True:
            async with self._engine.connect() as conn:
                lagging = await store.lagging_proxies(conn, epoch, self._settings.dead_after_s, drained=drained)
            if not lagging or asyncio.get_running_loop().time() >= deadline:
                return lagging
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def pause(self, wait: bool, timeout_s: float) -> None:
        epoch = await self.publish(paused=True)
        if wait:
            lagging = await self.wait_applied(epoch, timeout_s, drained=True)
            if lagging:
                raise ServiceUnavailable(f"proxies {', '.join(lagging)} still have calls in flight; admission "
                                         "stays paused", code="pause_timeout", retry_after_s=1.0)

    async def resume(self) -> None:
        await self.publish(paused=False)

    # -- leases and the `finish` barrier -------------------------------------------------------

    def lease(self, call_id: str, rollout_id: str, attempt_id: str, route: str,
              started_at: datetime) -> asyncio.Future[bool] | None:
        """Queue the call's lease row; the future says whether it was committed."""
        if not self._leases_ok or not self._tasks:
            return None
        future = asyncio.get_running_loop().create_future()
        self._lease_rows.append({"call_id": call_id, "proxy_id": self.proxy_id, "rollout_id": rollout_id,
                                 "attempt_id": attempt_id, "route": route, "started_at": started_at})
        self._lease_waiters.append(future)
        self._lease_kick.set()
        return future

    @staticmethod
    async def held(lease: asyncio.Future[bool]) -> bool:
        """Before a call's record: its lease is in the database (True) or was given up on (False)."""
        if not lease.done():
            try:
                await asyncio.wait_for(asyncio.shield(lease), _LEASE_WAIT_S)
            except TimeoutError:
                logger.warning("cluster: a call lease took over %.0f s; not waiting for it", _LEASE_WAIT_S)
                return False
        return lease.result()

    async def before_upstream(self, call_id: str, lease: asyncio.Future[bool] | None) -> None:
        """Before a tracked call goes upstream: its lease row is in the database, so that `finish` on any
        member waits for it and a live member records it `interrupted` if this one dies.

        When the row cannot be written (the database is unreachable from here), the call still goes
        (records wait in the spool), but only once every other member takes this one for cut off: its
        heartbeat is `stale_s` old, and `finish` elsewhere waits for a member in that state until it
        reports, in a heartbeat, that none of its unleased calls is left uncommitted.
        """
        if lease is not None and await self.held(lease):
            return
        wait_s = self._last_beat_ok + self.stale_s - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self.unleased.add(call_id)

    def committed(self, records: list[CallRecord]) -> None:
        """The recorder committed these records (the unleased among them are accounted for now)."""
        if self.unleased:
            for record in records:
                self.unleased.discard(record.call_id)

    async def wait_accounted(self, timeout_s: float) -> list[str]:
        """Wait until no other live member may hold unleased calls; the members still unaccounted for
        at the deadline (empty: none)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        delay = 0.01
        while True:
            try:
                async with self._engine.connect() as conn:
                    missing = await store.unaccounted_proxies(conn, self.proxy_id, self._settings.dead_after_s,
                                                              self.stale_s)
            except Exception as exc:  # noqa: BLE001 - any database error here means "cannot confirm now"
                raise DatabaseUnavailable(f"database unreachable: {exc.__class__.__name__}",
                                          retry_after_s=1.0) from exc
            if not missing or asyncio.get_running_loop().time() >= deadline:
                return missing
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _lease_loop(self) -> None:
        while True:
            await self._lease_kick.wait()
            self._lease_kick.clear()
            rows, waiters = self._lease_rows, self._lease_waiters
            self._lease_rows, self._lease_waiters = [], []
            is_written = True
            try:
                async with self._engine.begin() as conn:
                    await store.add_leases(conn, rows)
            except Exception as exc:  # noqa: BLE001 - the calls go unleased (`before_upstream`)
                if self._leases_ok:
                    logger.error("cluster: call leases not written (%s); calls go on unleased, and `finish` on "
                                 "other proxies waits for this one until it reports them committed",
                                 exc.__class__.__name__)
                self._leases_ok = False
                is_written = False
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(is_written)

    async def wait_released(self, key: tuple[str, str], timeout_s: float) -> bool:
        """Wait until no proxy holds a lease of the attempt (its calls are recorded). False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        delay = 0.002
        while True:
            try:
                async with self._engine.connect() as conn:
                    if await store.count_leases(conn, *key) == 0:
                        return True
            except Exception as exc:  # noqa: BLE001 - any database error here means "cannot confirm now"
                raise DatabaseUnavailable(f"database unreachable: {exc.__class__.__name__}",
                                          retry_after_s=1.0) from exc
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    # -- background tasks ----------------------------------------------------------------------

    async def _listen_loop(self) -> None:
        """Hold a LISTEN connection; reconnect after losing it (and re-read the state then)."""
        while True:
            try:
                self._listener = await asyncpg.connect(self._dsn)
                closed = asyncio.Event()
                # Bound now: a late callback from the previous connection must not set this one's event.
                self._listener.add_termination_listener(lambda _conn, closed=closed: closed.set())
                await self._listener.add_listener(CHANNEL, lambda *_args: self._kick.set())
                await self._listener.add_listener(REPLICA_CHANNEL, lambda *_args: self._replicas_kick.set())
                self._kick.set()  # whatever changed while not listening
                self._replicas_kick.set()
                await closed.wait()
                logger.warning("cluster: LISTEN connection lost; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried; the heartbeat still syncs meanwhile
                logger.warning("cluster: LISTEN failed (%s); retrying", exc.__class__.__name__)
            await self._close_listener()
            await asyncio.sleep(self._settings.heartbeat_s)

    async def _close_listener(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            try:
                await asyncio.wait_for(listener.close(), 2.0)
            except Exception:  # noqa: BLE001
                listener.terminate()

    async def _sync_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.sync()
            except Exception as exc:  # noqa: BLE001 - the heartbeat tries again
                logger.warning("cluster: state not read (%s)", exc.__class__.__name__)

    async def _replicas_loop(self) -> None:
        while True:
            await self._replicas_kick.wait()
            self._replicas_kick.clear()
            try:
                await self.sync_replicas()
            except Exception as exc:  # noqa: BLE001 - the heartbeat tries again
                logger.warning("cluster: replica ejections not shared (%s)", exc.__class__.__name__)

    async def sync_replicas(self) -> None:
        """Publish this member's ejections (notifying the others if they changed); apply theirs."""
        async with self._engine.begin() as conn:
            await store.set_ejections(conn, self.proxy_id, self._balancer.own_ejections(), REPLICA_CHANNEL)
        async with self._engine.connect() as conn:
            elsewhere = await store.ejected_elsewhere(conn, self.proxy_id, self._settings.dead_after_s)
        self._balancer.set_ejected_elsewhere(elsewhere)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.heartbeat_s)
            try:
                await self._beat()
            except Exception as exc:  # noqa: BLE001 - retried next beat
                logger.warning("cluster: heartbeat failed (%s: %s)", exc.__class__.__name__, str(exc)[:300])

    async def _beat(self) -> None:
        async with self._engine.begin() as conn:
            if not await store.heartbeat(conn, self.proxy_id, self._balancer.in_flight, len(self.unleased)):
                logger.error("cluster: this proxy was taken for dead (no heartbeat for %.0f s); joining again",
                             self._settings.dead_after_s)
                await store.register_proxy(conn, self.proxy_id, socket.gethostname(), os.getpid())
                self.epoch = -1
        self._last_beat_ok = time.monotonic()
        self._leases_ok = True
        self._kick.set()
        self._replicas_kick.set()
        await self._reap()

    async def _reap(self) -> None:
        """Record the calls of dead proxies as `interrupted` (their leases), in one transaction."""
        async with self._engine.begin() as conn:
            leases = await store.claim_dead_proxies(conn, self._settings.dead_after_s)
            if not leases:
                return
            now = datetime.now(UTC)
            records = [_interrupted(lease, now) for lease in leases]
            written = await store.write_calls(conn, records, skip_existing=True, release_leases=True)
        logger.warning("cluster: %d call(s) in flight on dead proxies %s recorded as interrupted", written,
                       ", ".join(sorted({str(lease["proxy_id"]) for lease in leases})))


def _interrupted(lease: dict[str, Any], now: datetime) -> CallRecord:
    started_at = lease["started_at"]
    return CallRecord(
        call_id=lease["call_id"], rollout_id=lease["rollout_id"], attempt_id=lease["attempt_id"],
        route=lease["route"], is_streaming=False, status=CallStatus.INTERRUPTED, started_at=started_at,
        ended_at=max(now, started_at),
        error={"message": f"proxy {lease['proxy_id']} stopped heartbeating (killed or cut off) while this call "
                          "was in flight; its answer, if any, was not kept", "type": "interrupted", "param": None,
               "code": "proxy_lost"},
    )
