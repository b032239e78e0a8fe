"""One call while it runs: what is known about it, and the ids it is given; it becomes its `CallRecord`.

Kept apart from the relay so that what serves a call (the relay, hosted models) shares this
type without importing one another.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from shared.errors import RolltapError
from shared.types import CallRecord, CallStatus

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.access import AgentKey
    from proxy.balancer import ReplicaLease
    from proxy.formats import Extract, Format, StreamTail

__all__ = ["CallState"]

_arrivals = itertools.count()
# Call ids: 64 random bits per process, then a counter: unique across proxies sharing a
# database, the same 37 characters as a "call-" + uuid4 hex, and no entropy syscall per call.
_CALL_PREFIX = "call-" + os.urandom(8).hex()
_call_numbers = itertools.count()


def _new_call_prefix() -> None:
    global _CALL_PREFIX
    _CALL_PREFIX = "call-" + os.urandom(8).hex()  # a forked worker must not repeat its parent's ids


os.register_at_fork(after_in_child=_new_call_prefix)


@dataclass(slots=True)
class CallState:
    """What is known about one call while it runs; becomes its `CallRecord`."""

    route: str
    format: Format  # the route's wire format (`proxy.formats.for_route`)
    rollout_id: str | None
    attempt_id: str | None
    call_id: str = field(default_factory=lambda: f"{_CALL_PREFIX}{next(_call_numbers):016x}")
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.perf_counter)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    is_streaming: bool = False
    request: Any = None
    requested_model: str | None = None
    served_model: str | None = None
    policy_version: int | None = None
    replica: str | None = None
    t_first_byte: float | None = None
    upstream_s: float = 0.0  # time spent waiting on the replica, excluded from the proxy's overhead
    status: str = CallStatus.OK
    http_status: int | None = None
    error: dict[str, Any] | None = None
    body: bytes = b""
    truncated: bool = False
    # When `body` is cut (`truncated`): the token fields of the whole answer, read from all of a
    # whole response at once, or from a stream as it passes.
    whole: Extract | StreamTail | None = None
    request_body: bytes | None = None  # exactly what the client sent
    span: Span | None = None  # its trace span, when tracing is on
    agent: AgentKey | None = None  # the caller's key (None with open access)
    has_slot: bool = False  # counted in `Slots` until recorded
    has_left: bool = False  # the client disconnected before the end
    sealed: CallRecord | None = None  # the record journaled before the stream's last byte
    sealed_len: int = 0  # bytes of body the sealed record was built from
    lease: asyncio.Future[bool] | None = None  # its `call_leases` row being written (`proxy.cluster`)
    replica_lease: ReplicaLease | None = None  # its place on the replica that answers, until recorded

    @property
    def key(self) -> tuple[str, str] | None:
        return (self.rollout_id, self.attempt_id) if self.rollout_id and self.attempt_id else None

    def fail(self, status: str, error: RolltapError | dict[str, Any], http_status: int | None = None) -> None:
        self.status = status
        self.error = error.body()["error"] if isinstance(error, RolltapError) else error
        if http_status is not None:
            self.http_status = http_status

    def headers(self) -> dict[str, str]:
        overhead_ms = (time.perf_counter() - self.t0 - self.upstream_s) * 1000
        headers = {"x-rolltap-call-id": self.call_id, "x-rolltap-overhead-ms": f"{overhead_ms:.3f}"}
        if self.policy_version is not None:
            headers["x-rolltap-policy-version"] = str(self.policy_version)
        return headers
