"""The SIGTERM drain: whether the proxy still takes relayed calls, and how many are in flight.

On SIGTERM (`proxy.main`) the proxy stops taking relayed calls (503 `proxy_draining`, so a
load balancer or client retries elsewhere) while the lifecycle routes (reward, finish,
GET attempt, health) keep answering; once no relayed call is in flight and nothing was
heard for `grace_s` (an agent's `finish` follows its last call's end), or the deadline
passed, the server is told to exit and the recorder flushes. It owns no I/O.
"""

from __future__ import annotations

import logging
import time

__all__ = ["Drain"]

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self) -> None:
        self.is_draining = False
        self.in_flight = 0  # relayed calls started and not yet recorded
        self._deadline = 0.0
        self._grace_s = 0.0
        self._last_activity = 0.0

    def call_started(self) -> None:
        self.in_flight += 1

    def call_ended(self) -> None:
        self.in_flight -= 1
        if self.is_draining:
            self._last_activity = time.monotonic()

    def touch(self) -> None:
        """A lifecycle call arrived: while draining, the grace period starts again."""
        if self.is_draining:
            self._last_activity = time.monotonic()

    def begin(self, timeout_s: float, grace_s: float = 0.0) -> None:
        if self.is_draining:
            return
        self.is_draining = True
        self._last_activity = time.monotonic()
        self._deadline = self._last_activity + timeout_s
        self._grace_s = grace_s
        logger.info("draining: %d relayed call(s) in flight, up to %.0f s; new calls get 503", self.in_flight,
                    timeout_s)

    @property
    def is_done(self) -> bool:
        """Draining and nothing left in flight, or out of time."""
        if not self.is_draining:
            return False
        now = time.monotonic()
        if self.in_flight <= 0 and now - self._last_activity >= self._grace_s:
            return True
        if now >= self._deadline:
            logger.warning("drain deadline passed with %d call(s) in flight; they end as interrupted",
                           self.in_flight)
            return True
        return False
