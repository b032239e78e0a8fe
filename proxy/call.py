"""One call while it runs: what is known about it, changed only through its transitions; it seals into its `CallRecord`.

Kept apart from the relay so that what serves a call (the relay, `RelayStream`) shares this
type without importing one another. Every change that alters what the record would say
marks the call `dirty`; `seal()` builds the record and clears it, so whether a record must
be built again is a flag, not a guess.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from proxy.formats import Extract, Format, StreamTail, parse_events
from proxy.sse import iter_data
from shared.errors import RolltapError, UpstreamTimeout, UpstreamUnavailable
from shared.types import CallRecord, CallStatus
from shared.verbatim import ExactJsonError, loads_exact

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.access import AgentKey
    from proxy.balancer import ReplicaSeat

__all__ = ["CallState", "parse_whole"]

logger = logging.getLogger(__name__)

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
    """What is known about one call while it runs; `seal()` makes it a `CallRecord`.

    The request side (`request`, `requested_model`, ...) is filled once by the relay's parse;
    everything that happens after (answered, kept bytes, failures, the client leaving) goes
    through a method below, each of which marks the call `dirty`.
    """

    route: str
    format: Format  # the route's wire format (`proxy.formats.for_route`)
    rollout_id: str | None
    attempt_id: str | None
    max_kept: int  # bytes of the response the record keeps (`recorder.max_body_bytes`)
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
    truncated: bool = False
    # When the kept body is cut (`truncated`): the token fields of the whole answer, read from all
    # of a whole response at once, or from a stream as it passes.
    whole: Extract | StreamTail | None = None
    request_body: bytes | None = None  # exactly what the client sent
    request_journaled: bool = False  # its request line is on disk: the journal's end line leaves it out
    span: Span | None = None  # its trace span, when tracing is on
    agent: AgentKey | None = None  # the caller's key (None with open access)
    has_slot: bool = False  # counted in `Slots` until recorded
    has_left: bool = False  # the client disconnected before the end
    source_failed: bool = False  # the replica failed after its headers: ejected when the call is recorded
    lease: asyncio.Future[bool] | None = None  # its `call_leases` row being written (`proxy.cluster`)
    replica_seat: ReplicaSeat | None = None  # its place on the replica that answers, until recorded
    sealed: CallRecord | None = None  # the record last built, journaled before the end reached the client
    dirty: bool = True  # something changed since `sealed` was built
    _kept: list[bytes] = field(default_factory=list)  # the response's bytes the record keeps
    _kept_bytes: int = 0

    @property
    def key(self) -> tuple[str, str] | None:
        return (self.rollout_id, self.attempt_id) if self.rollout_id and self.attempt_id else None

    # -- transitions ------------------------------------------------------------------------------

    def fail(self, status: str, error: RolltapError | dict[str, Any], http_status: int | None = None) -> None:
        self.status = status
        self.error = error.body()["error"] if isinstance(error, RolltapError) else error
        if http_status is not None:
            self.http_status = http_status
        self.dirty = True

    def client_left(self, before: str) -> None:
        """The client disconnected `before` (what it did not wait for)."""
        self.fail(CallStatus.CLIENT_DISCONNECTED, {"message": f"client disconnected before {before}",
                                                   "type": "client_disconnected"})
        self.has_left = True

    def interrupted(self, what: str) -> None:
        """The proxy shut down before `what` ended."""
        self.fail(CallStatus.INTERRUPTED, {"message": f"the proxy shut down before {what} ended",
                                           "type": "interrupted", "code": "proxy_shutdown"})

    def answered(self, http_status: int, sent_at: float) -> None:
        """The replica's status line and headers arrived (its first bytes), `sent_at` after the request left."""
        self.t_first_byte = time.perf_counter()
        self.upstream_s += self.t_first_byte - sent_at
        self.http_status = http_status
        self.dirty = True

    def keep_whole(self, body: bytes) -> None:
        """The whole final response, kept up to `max_kept`; the token fields of a cut one are read from all
        of it first. An error status makes the call `upstream_error` (the body says which)."""
        if self.http_status is not None and self.http_status >= 400:
            self.status = CallStatus.UPSTREAM_ERROR
        if len(body) > self.max_kept:
            self._kept, self._kept_bytes, self.truncated = [body[:self.max_kept]], self.max_kept, True
            self.whole = self.format.extract(parse_whole(body))
        else:
            self._kept, self._kept_bytes = [body], len(body)
        self.dirty = True

    def keep_chunk(self, chunk: bytes) -> None:
        """One chunk of a stream. Past `max_kept` the record's copy is cut, and a `StreamTail` reads the
        whole stream from its first byte (an event may straddle the cut) for the token fields."""
        self.dirty = True
        if not self.truncated:
            if self._kept_bytes + len(chunk) <= self.max_kept:
                self._kept.append(chunk)
                self._kept_bytes += len(chunk)
                return
            self.truncated = True
            self.whole = StreamTail(self.format)
            for piece in self._kept:
                self.whole.feed(piece)
        assert isinstance(self.whole, StreamTail)
        self.whole.feed(chunk)

    def stream_failed(self, error: RolltapError) -> bytes:
        """The stream's source failed: the call is `failed`, and the final error event the client
        gets (and the record keeps, when not cut) is returned."""
        body = error.body()["error"]
        self.fail(CallStatus.FAILED, body)
        self.source_failed = isinstance(error, (UpstreamUnavailable, UpstreamTimeout))  # not a bug of ours
        event = b"data: " + orjson.dumps({"error": body}) + b"\n\n"
        if not self.truncated:
            self._kept.append(event)  # the record keeps the bytes the client got, this event too
        return event

    def seal(self) -> CallRecord:
        """The record of what the call left so far; clean until the next transition."""
        self.sealed = record = self._build()
        self.dirty = False
        return record

    # -- the answer's headers and the record -------------------------------------------------------

    def headers(self) -> dict[str, str]:
        overhead_ms = (time.perf_counter() - self.t0 - self.upstream_s) * 1000
        headers = {"x-rolltap-call-id": self.call_id, "x-rolltap-overhead-ms": f"{overhead_ms:.3f}"}
        if self.policy_version is not None:
            headers["x-rolltap-policy-version"] = str(self.policy_version)
        return headers

    def _build(self) -> CallRecord:
        ended = time.perf_counter()
        body = self._kept[0] if len(self._kept) == 1 else b"".join(self._kept)
        record = CallRecord(
            call_id=self.call_id,
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            route=self.route,
            is_streaming=self.is_streaming,
            status=self.status,
            started_at=self.started_at,
            ended_at=self.started_at + timedelta(seconds=ended - self.t0),
            first_byte_at=(self.started_at + timedelta(seconds=self.t_first_byte - self.t0))
            if self.t_first_byte is not None else None,
            http_status=self.http_status,
            error=self.error,
            request=self.request,
            response_truncated=self.truncated,
            request_body=self.request_body,
            response_body=body or None,
            replica=self.replica,
            policy_version=self.policy_version,
            requested_model=self.requested_model,
            served_model=self.served_model,
            arrival=self.arrival,
        )
        if body or self.whole is not None:  # a stream cut before its first kept byte has its token fields
            try:
                self._fill_response(record, body)
            except Exception as exc:  # noqa: BLE001 - a record is written whatever the replica sent
                # A shape no format reads (a broken or hostile replica): without this the call could
                # never be sealed, so never recorded, and its attempt's `finish` would wait for it.
                # The record keeps the exact bytes and says why it has no token fields.
                logger.warning("call %s: the replica's response could not be read (%s: %s)", self.call_id,
                               exc.__class__.__name__, exc)
                _unreadable(record, exc)
        return record

    def _fill_response(self, record: CallRecord, body: bytes) -> None:
        """The record's parsed response (of the bytes kept) and token fields (of the whole answer)."""
        if self.is_streaming and self.http_status == 200:
            response: Any = self.format.assemble(parse_events(iter_data(body)))
        else:
            response = parse_whole(body)
        record.response = response if body else None
        if isinstance(self.whole, StreamTail):
            fields = self.whole.fields()
        elif self.whole is not None:
            fields = self.whole
        else:
            fields = self.format.extract(response)
        record.prompt_token_ids = fields.prompt_token_ids
        record.completion_token_ids = fields.completion_token_ids
        record.completion_logprobs = fields.completion_logprobs
        record.finish_reason = fields.finish_reason
        record.usage = fields.usage
        if fields.error is not None and record.status == CallStatus.OK:
            # The replica reported an error inside a 200 stream.
            record.status = CallStatus.UPSTREAM_ERROR
            record.error = fields.error if isinstance(fields.error, dict) else {"message": str(fields.error)}
        elif record.status == CallStatus.UPSTREAM_ERROR and isinstance(response, dict):
            error = fields.error if fields.error is not None else response.get("error", response)
            record.error = error if isinstance(error, dict) else {"message": str(error)}


def _unreadable(record: CallRecord, exc: Exception) -> None:
    record.response = record.prompt_token_ids = record.completion_token_ids = None
    record.completion_logprobs = record.finish_reason = record.usage = None
    if record.status != CallStatus.OK:
        return  # it failed for a reason of its own first: that is what it says
    record.status = CallStatus.UPSTREAM_ERROR
    record.error = {"message": f"the replica's response could not be read ({exc.__class__.__name__}); its bytes "
                               "are kept in response_body", "type": "upstream_error", "code": "unreadable_response"}


def parse_whole(body: bytes) -> Any:
    """A whole (not streamed) response's JSON; a body that is not JSON (or was cut) as its first 4 KiB of text."""
    try:
        return loads_exact(body)
    except ExactJsonError:
        return {"raw": body[:4096].decode("utf-8", "replace")}
