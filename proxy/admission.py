"""Admission control: pause new calls (for a full-weight update), resume them.

While paused, a new call waits up to `proxy.pool.pause_wait_s` for `resume`; past the
deadline it gets a 503 with `Retry-After`. Calls already in flight are not touched;
`pause(wait=True)` returns once they have all ended, so weights can be swapped safely.
"""

from __future__ import annotations

import asyncio
import logging

from shared.errors import ServiceUnavailable

__all__ = ["Admission"]

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._open = asyncio.Event()
        self._open.set()

    @property
    def is_paused(self) -> bool:
        return not self._open.is_set()

    async def admit(self) -> None:
        if self._open.is_set():
            return  # the common case costs one attribute check
        try:
            await asyncio.wait_for(self._open.wait(), self._wait_s)
        except TimeoutError:
            raise ServiceUnavailable(
                f"admission paused (weight update in progress) for more than {self._wait_s:g} s; retry",
                code="paused", retry_after_s=max(1.0, self._wait_s / 10),
            ) from None

    def pause(self) -> None:
        if not self.is_paused:
            logger.info("admission paused")
        self._open.clear()

    def resume(self) -> None:
        if self.is_paused:
            logger.info("admission resumed")
        self._open.set()
