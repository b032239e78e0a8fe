"""The replica pool: which replicas exist, their health and load, and which one serves a call.

`pick()` is on the hot path: no I/O, no awaits. Health is learned two ways: an active
probe loop (`GET /health`, and `/metrics` for the replica's own queue and KV signals) and
passive marks from the relay (connection errors eject at once, repeated 5xx after
`eject_after_errors`). An ejected replica is re-admitted when its probe passes again
(no sooner than `eject_hold_s` after the ejection: 0 for one process).
With several proxies, `proxy.cluster` shares ejections: `on_health_change` tells it when
this proxy ejects or re-admits a replica, and it sets `is_ejected_elsewhere` on the
replicas another live proxy holds ejected.

Policies (`proxy.pool.policy`):
- `sticky_least_loaded` (default): a rollout's first call goes to the healthy replica with
  the fewest rollouts bound to it (then the fewest calls in flight, then the lowest replica
  gauges), and the rollout stays there while it has unfinished attempts and is not idle,
  so multi-turn prefixes hit one prefix cache.
- `least_outstanding`: per call, the least-loaded replica.
- `round_robin`: per call, in turn.
- `consistent_hash`: rollout id on a hash ring (256 virtual nodes per replica: with 2 to 8
  replicas the busiest gets at most ~1.2x the rollouts of the least busy).
With several proxies on one database (`proxy.cluster`), `sticky_least_loaded` binds rollouts
by the hash ring too: a rule every proxy computes alike from the rollout id and the healthy
replicas, where "fewest rollouts bound" would differ from proxy to proxy.
Per-call load = the calls this proxy has in flight there; ties go to the replica whose own
`/metrics` show fewer running + waiting requests and less KV-cache use (they also count
other proxies' calls, but lag by vLLM's stats interval), then to fewer bound rollouts.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from proxy.upstream import Upstream, shown_url
from shared.errors import Conflict, NotFound, RolltapError, UpstreamTimeout, UpstreamUnavailable
from shared.settings import PoolSettings

__all__ = ["Balancer", "ReplicaSeat", "ReplicaState"]

logger = logging.getLogger(__name__)

_METRIC_LINE = re.compile(
    rb"^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)\{[^}]*\} ([0-9.eE+-]+)$", re.M
)
_VNODES = 256


@dataclass(slots=True, eq=False)
class ReplicaState:
    url: str
    weight_mode: str = "none"
    is_healthy: bool = False
    is_draining: bool = False
    in_flight: int = 0
    models: list[str] = field(default_factory=list)
    consecutive_errors: int = 0
    probe_timeouts: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    rollouts: int = 0  # rollouts bound to it (sticky policy)
    calls_total: int = 0
    ejection: str | None = None  # why this proxy ejected it (it saw it healthy, then failing)
    ejected_at: float = 0.0  # monotonic
    is_ejected_elsewhere: bool = False  # another live proxy holds it ejected (`proxy.cluster`)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    shown_url: str = field(init=False)  # what logs, metrics and the admin API show (no credentials)

    def __post_init__(self) -> None:
        self.shown_url = shown_url(self.url)

    @property
    def is_available(self) -> bool:
        return self.is_healthy and not self.is_draining and not self.is_ejected_elsewhere

    def describe(self) -> dict[str, object]:
        return {
            "url": self.shown_url, "weight_mode": self.weight_mode, "healthy": self.is_healthy,
            "ejected_elsewhere": self.is_ejected_elsewhere,
            "state": "draining" if self.is_draining else "active", "in_flight": self.in_flight,
            "rollouts": self.rollouts, "calls_total": self.calls_total, "models": self.models,
            "replica_running": self.running, "replica_waiting": self.waiting, "kv_cache_usage": self.kv_usage,
        }


@dataclass(slots=True)
class _Binding:
    replica: ReplicaState
    last_used: float
    attempts: set[str] = field(default_factory=set)


class Balancer:
    def __init__(self, urls: list[str], upstream: Upstream, settings: PoolSettings, probe_interval_s: float) -> None:
        self._settings = settings
        self._replicas: dict[str, ReplicaState] = {}
        self._upstream = upstream
        self._probe_interval_s = probe_interval_s
        self._turn = itertools.count()
        self._sticky: dict[str, _Binding] = {}
        self._ring: list[tuple[int, str]] = []
        self._task: asyncio.Task[None] | None = None
        self._first_probe = asyncio.Event()
        self.hash_rollouts = False  # set by the app in a cluster: see the module docstring
        self.eject_hold_s = 0.0  # set by the app in a cluster: see `proxy.cluster`
        self.on_health_change: Callable[[], None] | None = None
        for url in urls:
            self._replicas[url] = ReplicaState(url, weight_mode=settings.weight_mode)
        self._rebuild_ring()

    # -- reading the pool ----------------------------------------------------------------

    @property
    def replicas(self) -> list[ReplicaState]:
        return list(self._replicas.values())

    @property
    def has_healthy(self) -> bool:
        return any(r.is_available for r in self._replicas.values())

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self._replicas.values())

    def base_model(self) -> str | None:
        """The model the first healthy replica serves (the first entry of its `/v1/models`)."""
        for replica in self._replicas.values():
            if replica.is_healthy and replica.models:
                return replica.models[0]
        return None

    # -- the hot path --------------------------------------------------------------------

    def pick(self, rollout_id: str | None = None, attempt_id: str | None = None,
             exclude: frozenset[str] = frozenset()) -> ReplicaState:
        """The replica for the next call; `exclude` holds replicas that just failed this call."""
        candidates = [r for r in self._replicas.values() if r.is_available and r.url not in exclude]
        if not candidates:
            raise UpstreamUnavailable("no healthy replica", code="no_healthy_replica", retry_after_s=1.0)
        policy = self._settings.policy
        if rollout_id is not None and (policy == "consistent_hash" or (
                self.hash_rollouts and policy == "sticky_least_loaded")):
            return self._hash_pick(rollout_id, candidates)
        if rollout_id is not None and policy == "sticky_least_loaded":
            return self._sticky_pick(rollout_id, attempt_id, candidates)
        if policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        return self._least_loaded(candidates)

    @staticmethod
    def _call_rank(r: ReplicaState) -> tuple[int, float, int]:
        # This proxy's own in-flight count first: exact and immediate. vLLM's gauges lag by
        # its stats interval (seconds), so they only break ties.
        return (r.in_flight, r.running + r.waiting + r.kv_usage, r.rollouts)

    @staticmethod
    def _rollout_rank(r: ReplicaState) -> tuple[int, int, float]:
        # A new rollout goes where the fewest rollouts are bound. By calls in flight alone,
        # agents drift to whichever replica answers a little faster (a batching server barely
        # slows as it fills), and stickiness turns the drift into one replica holding them all.
        return (r.rollouts, r.in_flight, r.running + r.waiting + r.kv_usage)

    def _least_loaded(self, candidates: list[ReplicaState], *, for_rollout: bool = False) -> ReplicaState:
        rank = self._rollout_rank if for_rollout else self._call_rank
        low = min(rank(r) for r in candidates)
        best = [r for r in candidates if rank(r) == low]
        return best[next(self._turn) % len(best)]

    def _sticky_pick(self, rollout_id: str, attempt_id: str | None, candidates: list[ReplicaState]) -> ReplicaState:
        now = time.monotonic()
        binding = self._sticky.get(rollout_id)
        if binding is not None and binding.replica in candidates:
            binding.last_used = now
            if attempt_id is not None:
                binding.attempts.add(attempt_id)
            return binding.replica
        if binding is not None:  # its replica left, drains or failed: move the rollout
            binding.replica.rollouts -= 1
        replica = self._least_loaded(candidates, for_rollout=True)
        replica.rollouts += 1
        self._sticky[rollout_id] = _Binding(replica, now, {attempt_id} if attempt_id else set())
        return replica

    def _hash_pick(self, rollout_id: str, candidates: list[ReplicaState]) -> ReplicaState:
        allowed = {r.url for r in candidates}
        point = _hash(rollout_id)
        start = bisect.bisect(self._ring, (point, ""))
        for i in range(len(self._ring)):
            url = self._ring[(start + i) % len(self._ring)][1]
            if url in allowed:
                return self._replicas[url]
        return candidates[0]

    def seat(self, replica: ReplicaState) -> ReplicaSeat:
        """Count a call in flight on `replica` until its seat is released."""
        replica.in_flight += 1
        replica.calls_total += 1
        return ReplicaSeat(self, replica)

    def _call_ended(self, replica: ReplicaState, http_status: int | None) -> None:
        """Account for a finished call; 5xx answers count towards ejection."""
        replica.in_flight -= 1
        if http_status is not None and http_status >= 500:
            replica.consecutive_errors += 1
            if replica.consecutive_errors >= self._settings.eject_after_errors:
                self.mark_unreachable(replica, f"{replica.consecutive_errors} consecutive {http_status} answers")
        elif http_status is not None:
            replica.consecutive_errors = 0
        if replica.is_draining and replica.in_flight == 0:
            self._finish_drain(replica)

    def mark_unreachable(self, replica: ReplicaState, reason: str) -> None:
        if replica.is_healthy:
            logger.warning("replica %s ejected: %s", replica.shown_url, reason)
            replica.ejection, replica.ejected_at = reason, time.monotonic()
            if self.on_health_change is not None:
                self.on_health_change()
        replica.is_healthy = False

    def own_ejections(self) -> dict[str, str]:
        """The replicas this proxy ejected and has not re-admitted: url -> reason."""
        return {r.url: r.ejection for r in self._replicas.values() if r.ejection is not None}

    def set_ejected_elsewhere(self, urls: set[str]) -> None:
        for replica in self._replicas.values():
            if replica.is_ejected_elsewhere != (replica.url in urls):
                replica.is_ejected_elsewhere = replica.url in urls
                logger.warning("replica %s %s by another proxy", replica.shown_url,
                               "ejected" if replica.is_ejected_elsewhere else "re-admitted")

    def attempt_finished(self, rollout_id: str, attempt_id: str) -> None:
        """Release a rollout's binding once none of its attempts is left running."""
        binding = self._sticky.get(rollout_id)
        if binding is None:
            return
        binding.attempts.discard(attempt_id)
        if not binding.attempts:
            self._unbind(rollout_id)

    def _unbind(self, rollout_id: str) -> None:
        binding = self._sticky.pop(rollout_id, None)
        if binding is not None:
            binding.replica.rollouts -= 1

    # -- administration ----------------------------------------------------------------

    def add(self, url: str, weight_mode: str | None = None) -> ReplicaState:
        if url in self._replicas:
            raise Conflict(f"replica {shown_url(url)} is already in the pool", code="replica_exists")
        replica = ReplicaState(url, weight_mode=weight_mode or self._settings.weight_mode)
        self._replicas[url] = replica
        self._rebuild_ring()
        asyncio.get_running_loop().create_task(self._probe(replica))
        logger.info("replica %s added (%s)", replica.shown_url, replica.weight_mode)
        return replica

    def get(self, url: str) -> ReplicaState:
        """The replica by its URL, or by the URL the admin API shows (credentials hidden) when
        that names one replica: what a client read from `GET /admin/replicas` finds it again."""
        replica = self._replicas.get(url)
        if replica is None:
            shown = [r for r in self._replicas.values() if r.shown_url == url]
            replica = shown[0] if len(shown) == 1 else None
        if replica is None:
            raise NotFound(f"no replica {shown_url(url)} in the pool", param="url", code="unknown_replica")
        return replica

    def remove(self, url: str) -> ReplicaState:
        """Remove at once; calls in flight there run to their end."""
        replica = self.get(url)
        del self._replicas[replica.url]
        for rollout_id in [rid for rid, b in self._sticky.items() if b.replica is replica]:
            self._unbind(rollout_id)
        self._rebuild_ring()
        replica.drained.set()
        if replica.ejection is not None and self.on_health_change is not None:
            self.on_health_change()  # its shared ejection goes with it
        logger.info("replica %s removed", replica.shown_url)
        return replica

    def drain(self, url: str) -> ReplicaState:
        """No new calls; when those in flight have ended, the replica leaves the pool."""
        replica = self.get(url)
        replica.is_draining = True
        logger.info("replica %s draining (%d in flight)", replica.shown_url, replica.in_flight)
        if replica.in_flight == 0:
            self._finish_drain(replica)
        return replica

    def _finish_drain(self, replica: ReplicaState) -> None:
        if self._replicas.get(replica.url) is replica:
            self.remove(replica.url)

    def _rebuild_ring(self) -> None:
        self._ring = sorted((_hash(f"{url}#{i}"), url) for url in self._replicas for i in range(_VNODES))

    # -- probes ------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._probe_loop(), name="rolltap-replica-probe")

    async def wait_first_probe(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._first_probe.wait(), timeout_s)
        except TimeoutError:
            pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(r) for r in list(self._replicas.values())))
            self._first_probe.set()
            self._forget_idle_rollouts()
            await asyncio.sleep(self._probe_interval_s)

    def _forget_idle_rollouts(self) -> None:
        horizon = time.monotonic() - self._settings.sticky_idle_s
        for rollout_id in [rid for rid, b in self._sticky.items() if b.last_used < horizon]:
            self._unbind(rollout_id)

    async def _probe(self, replica: ReplicaState) -> None:
        try:
            status, _, _ = await self._upstream.get(replica.url, "/health", timeout_s=10.0)
            if status != 200:
                raise UpstreamUnavailable(f"/health answered {status}")
            if not replica.models:
                status, body, _ = await self._upstream.get(replica.url, "/v1/models", timeout_s=5.0)
                replica.models = [m["id"] for m in orjson.loads(body).get("data", [])] if status == 200 else []
        except UpstreamTimeout as exc:
            # A slow answer from a loaded replica is not a dead one: eject on the second in a row.
            replica.probe_timeouts += 1
            if replica.probe_timeouts >= 2:
                self.mark_unreachable(replica, str(exc))
            return
        except (RolltapError, ValueError, KeyError) as exc:
            self.mark_unreachable(replica, str(exc))
            return
        replica.probe_timeouts = 0
        if not replica.is_healthy:
            if replica.ejection is not None and time.monotonic() < replica.ejected_at + self.eject_hold_s:
                return  # held out (a cluster): see `proxy.cluster`
            logger.info("replica %s healthy (models: %s)", replica.shown_url, ", ".join(replica.models))
            replica.consecutive_errors = 0
            if replica.ejection is not None:
                replica.ejection = None
                if self.on_health_change is not None:
                    self.on_health_change()
        replica.is_healthy = True
        if self._settings.use_replica_metrics:
            await self._scrape(replica)

    async def _scrape(self, replica: ReplicaState) -> None:
        """Refresh the replica's queue and KV signals. Only `/health` decides health: a busy
        replica answers `/metrics` slowly, and ejecting it for that would move its rollouts."""
        try:
            status, body, _ = await self._upstream.get(replica.url, "/metrics", timeout_s=2.0)
        except RolltapError as exc:
            logger.debug("replica %s: /metrics not read (%s); using calls in flight only", replica.shown_url, exc)
            replica.running = replica.waiting = replica.kv_usage = 0.0
            return
        if status == 200:
            self._read_metrics(replica, body)

    @staticmethod
    def _read_metrics(replica: ReplicaState, body: bytes) -> None:
        values = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
        for name, value in _METRIC_LINE.findall(body):
            values[name.decode()] += float(value)  # summed over engines
        replica.running = values["num_requests_running"]
        replica.waiting = values["num_requests_waiting"]
        replica.kv_usage = min(1.0, values["kv_cache_usage_perc"])


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ReplicaSeat:
    """One call's place on one replica, from `Balancer.seat` until `release`: the only owner of
    that call's share of the replica's in-flight count, so it is given back exactly once."""

    __slots__ = ("_balancer", "_released", "replica")

    def __init__(self, balancer: Balancer, replica: ReplicaState) -> None:
        self._balancer = balancer
        self.replica = replica
        self._released = False

    def release(self, http_status: int | None) -> None:
        """The call is over on this replica (`http_status` None: no answer); later calls do nothing."""
        if not self._released:
            self._released = True
            self._balancer._call_ended(self.replica, http_status)  # noqa: SLF001 - the seat is the balancer's
