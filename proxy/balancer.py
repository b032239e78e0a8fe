"""The replica pool: which replicas exist, which are healthy, and which one serves a call.

`pick()` is on the hot path: no I/O, no awaits. Health is learned two ways: an active
probe loop (`GET /health`) and passive marks from the relay when a replica cannot be
reached. The least-loaded healthy replica wins; ties rotate.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import orjson

from proxy.upstream import Upstream
from shared.errors import RolltapError, UpstreamUnavailable

__all__ = ["Balancer", "ReplicaState"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class ReplicaState:
    url: str
    is_healthy: bool = False
    in_flight: int = 0
    models: list[str] = field(default_factory=list)
    failures: int = 0


class Balancer:
    def __init__(self, urls: list[str], upstream: Upstream, probe_interval_s: float) -> None:
        self._replicas: dict[str, ReplicaState] = {url: ReplicaState(url) for url in urls}
        self._upstream = upstream
        self._probe_interval_s = probe_interval_s
        self._turn = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._first_probe = asyncio.Event()

    @property
    def replicas(self) -> list[ReplicaState]:
        return list(self._replicas.values())

    @property
    def has_healthy(self) -> bool:
        return any(r.is_healthy for r in self._replicas.values())

    def base_model(self) -> str | None:
        """The model the first healthy replica serves (its `/v1/models` root)."""
        for replica in self._replicas.values():
            if replica.is_healthy and replica.models:
                return replica.models[0]
        return None

    def pick(self, rollout_id: str | None = None) -> ReplicaState:
        healthy = [r for r in self._replicas.values() if r.is_healthy]
        if not healthy:
            raise UpstreamUnavailable("no healthy replica", code="no_healthy_replica", retry_after_s=1.0)
        low = min(r.in_flight for r in healthy)
        candidates = [r for r in healthy if r.in_flight == low]
        return candidates[next(self._turn) % len(candidates)]

    def mark_unreachable(self, replica: ReplicaState, reason: str) -> None:
        if replica.is_healthy:
            logger.warning("replica %s ejected: %s", replica.url, reason)
        replica.is_healthy = False
        replica.failures += 1

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
            await asyncio.sleep(self._probe_interval_s)

    async def _probe(self, replica: ReplicaState) -> None:
        try:
            status, _, _ = await self._upstream.get(replica.url, "/health", timeout_s=5.0)
            if status != 200:
                raise UpstreamUnavailable(f"/health answered {status}")
            if not replica.models:
                status, body, _ = await self._upstream.get(replica.url, "/v1/models", timeout_s=5.0)
                replica.models = [m["id"] for m in orjson.loads(body).get("data", [])] if status == 200 else []
        except (RolltapError, ValueError, KeyError) as exc:
            self.mark_unreachable(replica, str(exc))
            return
        if not replica.is_healthy:
            logger.info("replica %s healthy (models: %s)", replica.url, ", ".join(replica.models))
        replica.is_healthy = True
