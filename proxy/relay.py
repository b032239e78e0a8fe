"""The hot path: one call from client to replica and back, recorded exactly once.

    route -> Relay.handle -> admission -> balancer.pick -> upstream.post -> Response | RelayStream
                                                                          -> recorder.submit(record)

Whatever the end (answer, replica error, replica gone, client gone, bad request), the
record is built and submitted exactly once: in `handle`'s `finally`, or, for streams,
in `RelayStream`'s. Connect errors, 429 and 503 are retried on another replica with
backoff, only before anything reached the client. Streamed bytes go to the client as
they arrive, untouched; a bounded copy is parsed before the last byte is sent, so the
record is in the journal (`proxy.journal`) by the time the client sees the call end.
A client that leaves before the end is noticed (streamed or not), the replica's request
is dropped and the call recorded `client_disconnected`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from proxy import metrics
from proxy.access import AgentKey, Slots
from proxy.admission import Admission
from proxy.balancer import Balancer
from proxy.call import CallState
from proxy.cluster import Cluster
from proxy.drain import Drain
from proxy.formats import for_route
from proxy.journal import Journal
from proxy.limits import read_body
from proxy.policy import ActivePolicy
from proxy.recorder import Recorder
from proxy.sampling import check_sampling
from proxy.stream import RelayStream
from proxy.upstream import Upstream, UpstreamResponse, forwardable_headers
from shared.errors import (
    InvalidRequest,
    LocalStorageFailed,
    RolltapError,
    ServiceUnavailable,
    UpstreamUnavailable,
)
from shared.settings import ProxySettings
from shared.types import CallRecord, CallStatus
from shared.verbatim import MAX_DEPTH, ExactJsonError, depth_of, dumps_exact, loads_exact

if TYPE_CHECKING:
    from proxy.hosted import HostedModels
    from proxy.tracing import Tracing

__all__ = ["Relay"]

logger = logging.getLogger(__name__)

_RETRY_STATUSES = (429, 503)
_children: dict[tuple[object, ...], Any] = {}


def _metric(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once per label set (`labels()` costs more than `inc()`)."""
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child


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
        slots: Slots | None = None,
        journal: Journal | None = None,
        drain: Drain | None = None,
        cluster: Cluster | None = None,
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
        self._max_request = settings.limits.max_body_bytes
        self._body_timeout_s = settings.limits.body_timeout_s
        self._slots = slots or Slots(settings.limits.max_calls_in_flight)
        self._journal = journal
        self._drain = drain or Drain()
        self._cluster = cluster

    async def handle(self, request: Request, route: str, rollout_id: str | None, attempt_id: str | None,
                     agent: AgentKey | None = None) -> Response:
        """Relay one call. Tracked calls (with ids) get exact tokens asked for and the model rewritten."""
        call = CallState(route=route, format=for_route(route), rollout_id=rollout_id, attempt_id=attempt_id,
                         max_kept=self._max_body, agent=agent)
        if self._tracing is not None:
            call.span = self._tracing.start(route, request.headers, time.time_ns())
        self._recorder.begin(call.key)
        if self._cluster is not None and rollout_id and attempt_id:
            call.lease = self._cluster.lease(call.call_id, rollout_id, attempt_id, route, call.started_at)
        self._drain.call_started()
        finishes_later = False  # a stream records itself when it ends
        watcher: asyncio.Task[None] | None = None
        journaled: asyncio.Future[None] | None = None  # the batch its start line is written in
        try:
            journaled = self._journal_start(call)
            if self._drain.is_draining:
                raise ServiceUnavailable("the proxy is shutting down and takes no new calls; retry on another "
                                         "proxy or once it is back", code="proxy_draining", retry_after_s=1.0)
            # The body first: a client slow to send it holds no slot (`proxy.limits.body_timeout_s` bounds it).
            raw = call.request_body = await read_body(request, self._max_request, self._body_timeout_s)
            self._slots.take(agent)
            call.has_slot = True
            await self._admission.admit()
            if self._cluster is not None and call.key is not None:
                # Nothing goes upstream before its lease is in the database (if this proxy dies from
                # here on, a live one finds the lease and records the call `interrupted`), or before
                # every other proxy knows to wait for this one (the database is unreachable from here).
                await self._cluster.before_upstream(call.call_id, call.lease)
            watcher = asyncio.get_running_loop().create_task(
                self._watch_disconnect(request, call, asyncio.current_task()))
            if self._hosted is not None and (model := self._hosted.model_of(raw)) is not None:
                await self._written(journaled)  # nothing goes upstream before its start line is on disk
                response = await self._send_hosted(call, raw, model)
            else:
                if not self._policy.is_known and self._on_policy_unknown is not None and rollout_id is not None:
                    await self._on_policy_unknown()  # replicas were down at start; learn the base model now
                body = self._parse(call, raw, rewrite=True)
                headers = forwardable_headers(request.headers)
                if call.span is not None:  # no per-call work at all while tracing is off
                    headers |= self._trace_headers(call)
                payload = self._payload(call, body)
                # Nothing goes upstream before its start and request lines are on disk. The request
                # line is queued before either is awaited: one write for both unless the body came late.
                asked = None if self._journal is None else self._local_write(self._journal.request, call.call_id,
                                                                             payload)
                await self._written(journaled)
                await self._written(asked)
                call.request_journaled = self._journal is not None  # past both awaits: on disk
                response = await self._send(call, payload, headers)
            if response.is_stream:
                finishes_later = True
                return self._stream(call, response)
            return await self._relay_whole(call, response)
        except asyncio.CancelledError:
            # Our watcher's cancel (the client left): the call is recorded below; any other
            # cancellation (server shutdown) goes on up once it is.
            current = asyncio.current_task()
            if not call.has_left or current is None or current.uncancel() > 0:
                if not call.has_left:
                    call.interrupted("the call")
                raise
            return Response(status_code=499)  # nobody reads it: the client is gone
        except ClientDisconnect:
            # Gone before its request was read whole (nothing went upstream): recorded as what it is.
            call.client_left("its request was read")
            return Response(status_code=499)
        except RolltapError as exc:
            status = CallStatus.INVALID_REQUEST if isinstance(exc, InvalidRequest) else CallStatus.FAILED
            call.fail(status, exc, exc.status_code)
            exc.call_id = call.call_id
            raise
        except Exception as exc:
            call.fail(CallStatus.FAILED, {"message": f"proxy error: {exc.__class__.__name__}",
                                          "type": "internal_error"}, 500)
            logger.exception("unhandled error in call %s", call.call_id)
            internal = RolltapError("internal error in the proxy; see its log")
            internal.call_id = call.call_id
            raise internal from exc
        finally:
            if watcher is not None:
                watcher.cancel()  # a stream watches for itself (`RelayStream`)
            if not finishes_later:
                await self.record(call)

    def _journal_start(self, call: CallState) -> asyncio.Future[None] | None:
        """Refuse a new call, before anything goes upstream, while this proxy's disk cannot keep it safe;
        else journal its start (the batch it is written in, to await before going upstream)."""
        if self._recorder.local_storage_error is not None:
            raise _storage_failed(self._recorder.local_storage_error)
        if self._journal is None:
            return None
        return self._local_write(self._journal.started, call.call_id, call.rollout_id, call.attempt_id, call.route,
                                 call.started_at, call.arrival)

    @staticmethod
    def _local_write(write: Callable[..., asyncio.Future[None] | None], *args: Any) -> asyncio.Future[None] | None:
        try:
            return write(*args)
        except OSError as exc:
            raise _storage_failed(f"{exc.__class__.__name__}: {exc.strerror or exc}") from exc

    @staticmethod
    async def _written(batch: asyncio.Future[None] | None) -> None:
        try:
            await Journal.written(batch)
        except OSError as exc:
            raise _storage_failed(f"{exc.__class__.__name__}: {exc.strerror or exc}") from exc

    @staticmethod
    async def _watch_disconnect(request: Request, call: CallState, handler: asyncio.Task[Any] | None) -> None:
        """Cancel the call's task when its client leaves before the answer (the body is read by then)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        call.client_left("the response ended")
        if handler is not None:
            handler.cancel()

    def _trace_headers(self, call: CallState) -> dict[str, str]:
        """The `traceparent` (and `tracestate`) that passes this call's span on; empty without tracing."""
        headers: dict[str, str] = {}
        if call.span is not None:
            self._tracing.inject(call.span, headers)  # type: ignore[union-attr]
        return headers

    async def _send_hosted(self, call: CallState, raw: bytes, model: str) -> UpstreamResponse:
        """A call to a hosted model (`proxy.hosted`): recorded alike, its request as the agent sent it."""
        body = self._parse(call, raw, rewrite=False)
        call.replica = f"litellm:{model}"
        sent = time.perf_counter()
        response = await self._hosted.post(model, call.route, body, self._trace_headers(call))  # type: ignore[union-attr]
        call.answered(response.status, sent)
        return response

    async def _send(self, call: CallState, payload: bytes, headers: dict[str, str]) -> UpstreamResponse:
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
            call.replica = replica.shown_url  # recorded and shown: no credentials
            seat = self._balancer.seat(replica)
            sent = time.perf_counter()
            try:
                upstream = await self._upstream.post(replica.url, "/v1/" + call.route, payload, headers)
            except UpstreamUnavailable as exc:
                call.upstream_s += time.perf_counter() - sent
                seat.release(None)
                self._balancer.mark_unreachable(replica, exc.message)
                tried.add(replica.url)
                if attempt == self._pool.max_retries:
                    raise
                logger.debug("retrying %s after %s", call.call_id, exc.message)
                continue
            except BaseException:
                seat.release(None)
                raise
            call.answered(upstream.status, sent)  # response headers are the replica's first bytes
            if upstream.status in _RETRY_STATUSES and attempt < self._pool.max_retries:
                upstream.release()
                seat.release(upstream.status)
                tried.add(replica.url)
                continue
            call.replica_seat = seat  # given back in `record`, however the call ends
            return upstream
        raise AssertionError("unreachable")  # the loop returns or raises

    def _parse(self, call: CallState, raw: bytes, *, rewrite: bool) -> dict[str, Any]:
        """Validate the body and fill the call's request fields; tracked calls get exact tokens asked for."""
        try:
            body = loads_exact(raw)  # also what orjson refuses but JSON allows (lone surrogates, ...)
        except ExactJsonError as exc:
            call.request = {"raw": raw[:4096].decode("utf-8", "replace")}
            raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            call.request = {"raw": raw[:4096].decode("utf-8", "replace")}
            raise InvalidRequest("request body must be a JSON object", code="invalid_body")
        call.is_streaming = bool(body.get("stream"))
        call.requested_model = body.get("model") if isinstance(body.get("model"), str) else None
        if rewrite and call.key is not None:
            self._ask_for_tokens(call, body)
            if self._policy.served_name is not None:
                body["model"] = self._policy.served_name
            call.policy_version = self._policy.version
        call.served_model = body.get("model") if isinstance(body.get("model"), str) else None
        call.request = body
        if rewrite and call.key is not None:  # after `request` is set: a refused call is recorded with its body
            check_sampling(self._settings.sampling, call.format.choice_fields, body)
        return body

    @staticmethod
    def _payload(call: CallState, body: dict[str, Any]) -> bytes:
        """The body to send upstream. Refused (400, recorded with its exact bytes) only when it
        nests deeper than `MAX_DEPTH` (orjson reads 1024 levels, writes 255; see shared/verbatim.py)."""
        try:
            return orjson.dumps(body)
        except (TypeError, orjson.JSONEncodeError):
            pass  # lone surrogates, wide numbers or deep nesting: the exact writer, within limits
        if depth_of(body) > MAX_DEPTH:
            call.request = None  # the parsed copy is too deep to store as well; `request_body` has it
            raise InvalidRequest(f"request body nests deeper than {MAX_DEPTH} levels", code="nesting_too_deep")
        return dumps_exact(body)

    def _ask_for_tokens(self, call: CallState, body: dict[str, Any]) -> None:
        # vLLM returns exact prompt and completion token IDs on request, at no measurable cost;
        # the sampled tokens' logprobs (for off-policy correction and the mismatch metric) cost
        # a CPU-bound front end throughput, so `proxy.rollout_logprobs` decides. A client's own
        # logprob settings are kept either way.
        logprobs = _wants_rollout_logprobs(self._settings, call.rollout_id, call.attempt_id)
        call.format.ask_for_tokens(body, logprobs=logprobs)

    async def _relay_whole(self, call: CallState, response: UpstreamResponse) -> Response:
        started = time.perf_counter()
        try:
            body = await response.read()  # a failure mid-response is ours already: 503 or 504
        finally:
            call.upstream_s += time.perf_counter() - started
        call.keep_whole(body)
        return Response(body, status_code=response.status, media_type=response.content_type or None,
                        headers=call.headers())

    def _stream(self, call: CallState, response: UpstreamResponse) -> RelayStream:
        headers = [(b"content-type", response.content_type.encode()), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in call.headers().items()]
        return RelayStream(self, call, response, headers)

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

    async def seal(self, call: CallState) -> CallRecord:
        """Build the record and journal it (fsynced with `journal_fsync`): the call survives a crash now."""
        if call.lease is not None:  # calls refused before forwarding: the row must precede its deletion
            await Cluster.held(call.lease)
        record = call.seal()
        if self._journal is not None:
            try:
                await Journal.written(self._journal.ended(record, request_journaled=call.request_journaled))
                await self._journal.sync()
            except OSError:
                # The disk filled (or failed) under a call in progress: the client still gets its
                # answer whole, and the record goes on to the recorder (the database, or the spool and
                # memory), only without the crash copy. The journal logs it; new calls are refused.
                metrics.JOURNAL_WRITE_FAILURES.inc()
        return record

    async def record(self, call: CallState) -> None:
        """Queue the call's record (sealed again if anything changed since it was). Once per call."""
        record = call.sealed if not call.dirty and call.sealed is not None else await self.seal(call)
        self._drain.call_ended()
        if call.replica_seat is not None:
            if call.source_failed:
                self._balancer.mark_unreachable(call.replica_seat.replica, str((call.error or {}).get("message")))
            call.replica_seat.release(call.http_status)
        if call.has_slot:  # given back once, here, however the call ended
            call.has_slot = False
            self._slots.give(call.agent)
        if call.span is not None:
            self._tracing.finish(call.span, record)  # type: ignore[union-attr]
        route = call.route if call.route in metrics.ROUTES else "other"  # labels from a fixed set
        _metric(metrics.REQUESTS, route, record.status).inc()
        _metric(metrics.REQUEST_SECONDS, route).observe((record.ended_at - record.started_at).total_seconds())
        if call.t_first_byte is not None:
            _metric(metrics.TTFB_SECONDS, route).observe(call.t_first_byte - call.t0)
        await self._recorder.submit(record)


def _storage_failed(reason: str) -> LocalStorageFailed:
    return LocalStorageFailed(f"the proxy cannot keep this call safe on its own disk ({reason}); retry shortly, "
                              "or on another proxy", retry_after_s=1.0)


def _wants_rollout_logprobs(settings: ProxySettings, rollout_id: str | None, attempt_id: str | None) -> bool:
    """Whether a recorded call asks the replica for its tokens' logprobs (`proxy.rollout_logprobs`).

    `sample` decides per attempt, from a hash of its ids: all of an attempt's calls carry logprobs
    or none do (the trainer merges an attempt's calls into one sample), and every proxy decides alike.
    """
    mode = settings.rollout_logprobs
    if mode != "sample":
        return mode == "on"
    key = f"{rollout_id}\x00{attempt_id}".encode()
    return zlib.crc32(key) < settings.rollout_logprobs_rate * 2**32
