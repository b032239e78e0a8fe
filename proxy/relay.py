"""The hot path: one call from client to replica and back, recorded exactly once.

    route -> Relay.handle -> admission -> balancer.pick -> upstream.post -> Response | RelayStream
                                                                          -> recorder.submit(record)

Whatever the end (answer, replica error, replica gone, client gone, bad request), the
record is built and submitted exactly once: in `handle`'s `finally`, or, for streams,
in `RelayStream`'s. Connect errors, 429 and 503 are retried on another replica with
backoff, only before anything reached the client. Streamed bytes go to the client as
they arrive, untouched; a bounded copy is parsed after the last byte was sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy import metrics
from proxy.admission import Admission
from proxy.assemble import assemble_stream, extract
from proxy.balancer import Balancer, ReplicaState
from proxy.policy import ActivePolicy
from proxy.recorder import Recorder
from proxy.sampling import check_sampling
from proxy.sse import SseParser
from proxy.stream import RelayStream
from proxy.upstream import Upstream, forwardable_headers
from shared.errors import InvalidRequest, RolltapError, UpstreamUnavailable
from shared.settings import ProxySettings
from shared.types import CallRecord, CallStatus, Route

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.hosted import HostedModels
    from proxy.tracing import Tracing

__all__ = ["CallState", "Relay"]

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

_RETRY_STATUSES = (429, 503)
_children: dict[tuple[object, ...], Any] = {}


def _metric(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once per label set (`labels()` costs more than `inc()`)."""
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child


@dataclass(slots=True)
class CallState:
    """What is known about one call while it runs; becomes its `CallRecord`."""

    route: str
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
    span: Span | None = None  # its trace span, when tracing is on

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


class Relay:
    def __init__(
        self,
        settings: ProxySettings,
        upstream: Upstream,
        balancer: Balancer,
        policy: ActivePolicy,
        recorder: Recorder,
        admission: Admission,
        hosted: HostedModels | None = None,
        on_policy_unknown: Callable[[], Awaitable[None]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._settings = settings
        self._pool = settings.pool
        self._upstream = upstream
        self._balancer = balancer
        self._policy = policy
        self._recorder = recorder
        self._admission = admission
        self._hosted = hosted
        self._on_policy_unknown = on_policy_unknown
        self._tracing = tracing
        self._max_body = settings.recorder.max_body_bytes

    async def handle(self, request: Request, route: str, rollout_id: str | None, attempt_id: str | None) -> Response:
        """Relay one call. Tracked calls (with ids) get exact tokens asked for and the model rewritten."""
        call = CallState(route=route, rollout_id=rollout_id, attempt_id=attempt_id)
        if self._tracing is not None:
            call.span = self._tracing.start(route, request.headers, time.time_ns())
        self._recorder.begin(call.key)
        finishes_later = False  # a stream records itself when it ends
        try:
            await self._admission.admit()
            raw = await request.body()
            if self._hosted is not None and (model := self._hosted.model_of(raw)) is not None:
                response = await self._hosted.handle(self, call, route, raw, model)
                finishes_later = isinstance(response, RelayStream)
                return response
            if not self._policy.is_known and self._on_policy_unknown is not None and rollout_id is not None:
                await self._on_policy_unknown()  # replicas were down at start; learn the base model now
            body = self.parse(call, raw, rewrite=True)
            headers = forwardable_headers(request.headers)
            if call.span is not None:  # no per-call work at all while tracing is off
                headers |= self.trace_headers(call)
            upstream, replica = await self._send(call, orjson.dumps(body), headers)
            content_type = upstream.headers.get("content-type", "")
            if upstream.status == 200 and content_type.startswith("text/event-stream"):
                finishes_later = True
                return self._stream(call, replica, upstream, content_type)
            try:
                return await self._relay_whole(call, upstream, content_type)
            finally:
                self._balancer.call_ended(replica, call.http_status)
        except RolltapError as exc:
            status = CallStatus.INVALID_REQUEST if isinstance(exc, InvalidRequest) else CallStatus.FAILED
            call.fail(status, exc, exc.status_code)
            raise
        except Exception as exc:
            call.fail(CallStatus.FAILED, {"message": f"proxy error: {exc.__class__.__name__}",
                                          "type": "internal_error"}, 500)
            raise
        finally:
            if not finishes_later:
                await self.record(call)

    def trace_headers(self, call: CallState) -> dict[str, str]:
        """The `traceparent` (and `tracestate`) that passes this call's span on; empty without tracing."""
        headers: dict[str, str] = {}
        if call.span is not None:
            self._tracing.inject(call.span, headers)  # type: ignore[union-attr]
        return headers

    async def _send(self, call: CallState, payload: bytes, headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, ReplicaState]:
        """Send to a replica; fail over on connect errors, 429 and 503, with doubling backoff."""
        tried: set[str] = set()
        for attempt in range(self._pool.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._pool.retry_backoff_s * 2 ** (attempt - 1))
            try:
                replica = self._balancer.pick(call.rollout_id, call.attempt_id, exclude=frozenset(tried))
            except UpstreamUnavailable:
                if not tried:
                    raise
                # Every healthy replica was tried: try again where it said "busy" rather than fail.
                replica = self._balancer.pick(call.rollout_id, call.attempt_id)
            call.replica = replica.url
            self._balancer.call_started(replica)
            sent = time.perf_counter()
            try:
                upstream = await self._upstream.post(replica.url, "/v1/" + call.route, payload, headers)
            except UpstreamUnavailable as exc:
                call.upstream_s += time.perf_counter() - sent
                self._balancer.call_ended(replica, None)
                self._balancer.mark_unreachable(replica, exc.message)
                tried.add(replica.url)
                if attempt == self._pool.max_retries:
                    raise
                logger.debug("retrying %s after %s", call.call_id, exc.message)
                continue
            except BaseException:
                self._balancer.call_ended(replica, None)
                raise
            call.t_first_byte = time.perf_counter()  # response headers are the replica's first bytes
            call.upstream_s += call.t_first_byte - sent
            call.http_status = upstream.status
            if upstream.status in _RETRY_STATUSES and attempt < self._pool.max_retries:
                upstream.release()
                self._balancer.call_ended(replica, upstream.status)
                tried.add(replica.url)
                continue
            return upstream, replica
        raise AssertionError("unreachable")  # the loop returns or raises

    def parse(self, call: CallState, raw: bytes, *, rewrite: bool) -> dict[str, Any]:
        """Validate the body and fill the call's request fields; tracked calls get exact tokens asked for."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            call.request = {"raw": raw[:4096].decode("utf-8", "replace")}
            raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            call.request = {"raw": raw[:4096].decode("utf-8", "replace")}
            raise InvalidRequest("request body must be a JSON object", code="invalid_body")
        call.is_streaming = bool(body.get("stream"))
        call.requested_model = body.get("model") if isinstance(body.get("model"), str) else None
        if rewrite and call.key is not None:
            self._ask_for_tokens(call.route, body)
            if self._policy.served_name is not None:
                body["model"] = self._policy.served_name
            call.policy_version = self._policy.version
        call.served_model = body.get("model") if isinstance(body.get("model"), str) else None
        call.request = body
        if rewrite and call.key is not None:  # after `request` is set: a refused call is recorded with its body
            check_sampling(self._settings.sampling, call.route, body)
        return body

    @staticmethod
    def _ask_for_tokens(route: str, body: dict[str, Any]) -> None:
        # vLLM returns exact prompt and completion token IDs on request; logprobs make
        # off-policy correction possible. A client's own logprob settings are kept.
        body["return_token_ids"] = True
        if route == Route.CHAT and not body.get("logprobs"):
            body["logprobs"] = True
        elif route == Route.COMPLETIONS and body.get("logprobs") is None:
            body["logprobs"] = 0  # the sampled token's logprob, no alternatives

    async def _relay_whole(self, call: CallState, upstream: aiohttp.ClientResponse, content_type: str) -> Response:
        started = time.perf_counter()
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            upstream.close()
            call.http_status = 502
            raise UpstreamUnavailable(f"replica {call.replica} failed mid-response: {exc.__class__.__name__}",
                                      code="upstream_disconnected") from exc
        finally:
            call.upstream_s += time.perf_counter() - started
            upstream.release()
        call.body = body
        if upstream.status >= 400:
            call.status = CallStatus.UPSTREAM_ERROR
        return Response(body, status_code=upstream.status, media_type=content_type or None, headers=call.headers())

    def _stream(self, call: CallState, replica: ReplicaState, upstream: aiohttp.ClientResponse,
                content_type: str) -> RelayStream:
        def on_source_error(exc: BaseException) -> dict[str, object]:
            error: dict[str, object] = {"message": f"replica {call.replica} failed mid-stream: {exc.__class__.__name__}",
                                        "type": "upstream_disconnected", "param": None, "code": None}
            call.fail(CallStatus.FAILED, error)
            self._balancer.mark_unreachable(replica, str(exc))
            return error

        async def finish(kept: bytes, truncated: bool) -> None:
            self._balancer.call_ended(replica, call.http_status)
            call.body, call.truncated = kept, truncated
            await self.record(call)

        return self.stream_response(call, upstream.content.iter_any(), content_type, close=upstream.close,
                                    on_source_error=on_source_error, finish=finish)

    def stream_response(self, call: CallState, chunks: AsyncIterator[bytes], content_type: str, *,
                        close: Callable[[], None], on_source_error: Callable[[BaseException], dict[str, object]],
                        finish: Callable[[bytes, bool], Awaitable[None]]) -> RelayStream:
        headers = [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in call.headers().items()]
        return RelayStream(call, chunks, status_code=200, headers=headers, max_kept_bytes=self._max_body,
                           close=close, on_source_error=on_source_error, finish=finish)

    async def models(self) -> Response:
        """The model list of a healthy replica, as it sent it (clients probe it at start)."""
        return await self.passthrough("/v1/models")

    async def passthrough(self, path: str) -> Response:
        """An unrecorded GET (model lists and the like) relayed to a healthy replica."""
        replica = self._balancer.pick()
        try:
            status, body, content_type = await self._upstream.get(replica.url, path,
                                                                  timeout_s=self._settings.connect_timeout_s)
        except UpstreamUnavailable as exc:
            self._balancer.mark_unreachable(replica, exc.message)
            raise
        return Response(body, status_code=status, media_type=content_type)

    async def record(self, call: CallState) -> None:
        """Build the record from what the call left and queue it. Called exactly once per call."""
        ended = time.perf_counter()
        record = CallRecord(
            call_id=call.call_id,
            rollout_id=call.rollout_id,
            attempt_id=call.attempt_id,
            route=call.route,
            is_streaming=call.is_streaming,
            status=call.status,
            started_at=call.started_at,
            ended_at=call.started_at + timedelta(seconds=ended - call.t0),
            first_byte_at=(call.started_at + timedelta(seconds=call.t_first_byte - call.t0))
            if call.t_first_byte is not None else None,
            http_status=call.http_status,
            error=call.error,
            request=call.request,
            response_truncated=call.truncated,
            replica=call.replica,
            policy_version=call.policy_version,
            requested_model=call.requested_model,
            served_model=call.served_model,
            arrival=call.arrival,
        )
        if call.body:
            _fill_response(record, call)
        if call.span is not None:
            self._tracing.finish(call.span, record)  # type: ignore[union-attr]
        _metric(metrics.REQUESTS, call.route, record.status).inc()
        _metric(metrics.REQUEST_SECONDS, call.route).observe(ended - call.t0)
        if call.t_first_byte is not None:
            _metric(metrics.TTFB_SECONDS, call.route).observe(call.t_first_byte - call.t0)
        await self._recorder.submit(record)


def _fill_response(record: CallRecord, call: CallState) -> None:
    if call.is_streaming and call.http_status == 200:
        parser = SseParser()
        events = parser.feed(call.body) + parser.close()
        response: Any = assemble_stream(call.route, events)
    else:
        try:
            response = orjson.loads(call.body)
        except orjson.JSONDecodeError:
            response = {"raw": call.body[:4096].decode("utf-8", "replace")}
    record.response = response
    fields = extract(call.route, response)
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
        error = response.get("error", response)
        record.error = error if isinstance(error, dict) else {"message": str(error)}
