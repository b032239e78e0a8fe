"""The hot path: one call from client to replica and back, recorded exactly once.

    route -> Relay.handle -> balancer.pick -> upstream.post -> Response | RelayStream
                                                            -> recorder.submit(record)

Whatever the end (answer, replica error, replica gone, client gone, bad request), the
record is built and submitted in one `finally`, so it is never lost nor written twice.
Streamed bytes go to the client as they arrive, untouched; a bounded copy is kept and
parsed only after the last byte was sent.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from proxy import metrics
from proxy.assemble import assemble_stream, extract
from proxy.balancer import Balancer, ReplicaState
from proxy.policy import ActivePolicy
from proxy.recorder import Recorder
from proxy.sse import SseParser
from proxy.upstream import Upstream, forwardable_headers
from shared.errors import InvalidRequest, RolltapError, UpstreamUnavailable
from shared.settings import ProxySettings
from shared.types import CallRecord, CallStatus, Route

__all__ = ["Relay"]

logger = logging.getLogger(__name__)

_arrivals = itertools.count()


@dataclass(slots=True)
class CallState:
    """What is known about one call while it runs; becomes its `CallRecord`."""

    route: str
    rollout_id: str | None
    attempt_id: str | None
    call_id: str = field(default_factory=lambda: "call-" + uuid.uuid4().hex)
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
    status: str = CallStatus.OK
    http_status: int | None = None
    error: dict[str, Any] | None = None
    body: bytes = b""
    truncated: bool = False

    @property
    def key(self) -> tuple[str, str] | None:
        return (self.rollout_id, self.attempt_id) if self.rollout_id and self.attempt_id else None

    def fail(self, status: str, error: RolltapError | dict[str, Any], http_status: int | None = None) -> None:
        self.status = status
        self.error = error.body()["error"] if isinstance(error, RolltapError) else error
        if http_status is not None:
            self.http_status = http_status


class Relay:
    def __init__(
        self,
        settings: ProxySettings,
        upstream: Upstream,
        balancer: Balancer,
        policy: ActivePolicy,
        recorder: Recorder,
        on_policy_unknown: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._settings = settings
        self._on_policy_unknown = on_policy_unknown
        self._upstream = upstream
        self._balancer = balancer
        self._policy = policy
        self._recorder = recorder
        self._max_body = settings.recorder.max_body_bytes

    async def handle(self, request: Request, route: str, rollout_id: str | None, attempt_id: str | None) -> Response:
        """Relay one call. Tracked calls (with ids) get exact tokens asked for and the model rewritten."""
        call = CallState(route=route, rollout_id=rollout_id, attempt_id=attempt_id)
        self._recorder.begin(call.key)
        handed_to_stream = False
        replica: ReplicaState | None = None
        try:
            if not self._policy.is_known and self._on_policy_unknown is not None and rollout_id is not None:
                await self._on_policy_unknown()  # replicas were down at start; learn the base model now
            body = self._parse(call, await request.body())
            payload = orjson.dumps(body)
            replica = self._balancer.pick(rollout_id)
            call.replica = replica.url
            replica.in_flight += 1  # from here, released below or by RelayStream
            try:
                upstream = await self._upstream.post(
                    replica.url, "/v1/" + route, payload, forwardable_headers(request.headers)
                )
            except UpstreamUnavailable as exc:
                self._balancer.mark_unreachable(replica, exc.message)
                raise
            call.t_first_byte = time.perf_counter()  # headers are the replica's first bytes
            call.http_status = upstream.status
            content_type = upstream.headers.get("content-type", "")
            if upstream.status == 200 and content_type.startswith("text/event-stream"):
                handed_to_stream = True
                return RelayStream(self, call, replica, upstream)
            return await self._relay_whole(call, upstream, content_type)
        except RolltapError as exc:
            status = CallStatus.INVALID_REQUEST if isinstance(exc, InvalidRequest) else CallStatus.FAILED
            call.fail(status, exc, exc.status_code)
            raise
        except Exception as exc:
            call.fail(CallStatus.FAILED, {"message": f"proxy error: {exc.__class__.__name__}", "type": "internal_error"}, 500)
            raise
        finally:
            if not handed_to_stream:
                if replica is not None:
                    replica.in_flight -= 1
                await self.record(call)

    async def models(self) -> Response:
        """The model list of a healthy replica, as it sent it (clients probe it at start)."""
        return await self.passthrough("/v1/models")

    async def passthrough(self, path: str) -> Response:
        """An unrecorded GET (model lists and the like) relayed to a healthy replica."""
        replica = self._balancer.pick()
        try:
            status, body, content_type = await self._upstream.get(replica.url, path, timeout_s=self._settings.connect_timeout_s)
        except UpstreamUnavailable as exc:
            self._balancer.mark_unreachable(replica, exc.message)
            raise
        return Response(body, status_code=status, media_type=content_type)

    def _parse(self, call: CallState, raw: bytes) -> dict[str, Any]:
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
        if call.key is not None:
            self._ask_for_tokens(call.route, body)
            if self._policy.served_name is not None:
                body["model"] = self._policy.served_name
            call.policy_version = self._policy.version
        call.served_model = body.get("model") if isinstance(body.get("model"), str) else None
        call.request = body
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
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            upstream.close()
            call.fail(CallStatus.FAILED, {"message": f"replica {call.replica} failed mid-response: {exc}",
                                          "type": "upstream_disconnected"}, 502)
            raise UpstreamUnavailable(f"replica {call.replica} failed mid-response") from exc
        finally:
            upstream.release()
        call.body = body
        if upstream.status >= 400:
            call.status = CallStatus.UPSTREAM_ERROR
        return Response(body, status_code=upstream.status, media_type=content_type or None,
                        headers=self._headers(call))

    def _headers(self, call: CallState) -> dict[str, str]:
        headers = {"x-rolltap-call-id": call.call_id}
        if call.policy_version is not None:
            headers["x-rolltap-policy-version"] = str(call.policy_version)
        return headers

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
            self._fill_response(record, call)
        metrics.REQUESTS.labels(call.route, record.status).inc()
        metrics.REQUEST_SECONDS.labels(call.route).observe(ended - call.t0)
        if call.t_first_byte is not None:
            metrics.TTFB_SECONDS.labels(call.route).observe(call.t_first_byte - call.t0)
        await self._recorder.submit(record)

    @staticmethod
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


def _is_terminal(chunk: bytes) -> bool:
    """Does this chunk end the event stream (OpenAI's `[DONE]`, Anthropic's `message_stop`)?

    Both markers are safe from false positives: inside a JSON string, generated text has
    its quotes escaped, and `[DONE]` only counts as a whole final data line.
    """
    return chunk.rstrip().endswith(b"data: [DONE]") or b'{"type":"message_stop"' in chunk


class RelayStream(Response):
    """An ASGI response that relays an SSE stream chunk by chunk and always records it.

    Not a `StreamingResponse` over a generator: a generator abandoned at `yield` when the
    client leaves is finalised whenever the garbage collector gets to it. Here a watcher
    on `receive()` notices the disconnect, cancels the relay, the replica's connection is
    closed (vLLM aborts the request) and the record is written, all before returning.
    """

    def __init__(self, relay: Relay, call: CallState, replica: ReplicaState, upstream: aiohttp.ClientResponse) -> None:
        self._relay = relay
        self._call = call
        self._replica = replica
        self._upstream = upstream
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = [(b"content-type", upstream.headers.get("content-type", "text/event-stream").encode()),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.raw_headers += [(k.encode(), v.encode()) for k, v in relay._headers(call).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self._call
        is_complete = False
        kept: list[bytes] = []
        kept_bytes = 0
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    message: Message = await receive()
                    while message["type"] != "http.disconnect":
                        message = await receive()
                    if not is_complete:
                        call.fail(CallStatus.CLIENT_DISCONNECTED,
                                  {"message": "client disconnected before the response ended",
                                   "type": "client_disconnected"})
                        tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    async for chunk in self._upstream.content.iter_any():
                        if kept_bytes + len(chunk) <= self._relay._max_body:
                            kept.append(chunk)
                            kept_bytes += len(chunk)
                        else:
                            call.truncated = True
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        # Clients hang up on the terminal event without waiting for the
                        # replica to close the stream: from here on, leaving is not a disconnect.
                        if _is_terminal(chunk):
                            is_complete = True
                    is_complete = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    # Too late for another replica: the client has bytes already. End cleanly.
                    is_complete = True
                    error = {"message": f"replica {call.replica} failed mid-stream: {exc.__class__.__name__}",
                             "type": "upstream_disconnected", "param": None, "code": None}
                    call.fail(CallStatus.FAILED, error)
                    self._relay._balancer.mark_unreachable(self._replica, str(exc))
                    await send({"type": "http.response.body",
                                "body": b"data: " + orjson.dumps({"error": error}) + b"\n\n", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            # Closing (not releasing) an unfinished response drops the connection: vLLM aborts.
            self._upstream.close()
            self._replica.in_flight -= 1
            call.body = b"".join(kept)
            with anyio.CancelScope(shield=True):
                await self._relay.record(call)
