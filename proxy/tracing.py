"""OpenTelemetry traces of relayed calls: one span per call, joined to the agent's trace.

Off unless `proxy.tracing.otlp_endpoint` is set; then, and only then, the SDK is imported.
Each recorded or untracked relayed call gets a SERVER span that

- continues the trace of the caller when the request carries a W3C `traceparent` (an agent
  instrumented with OpenTelemetry sees the proxy's span under its own LLM call);
- passes its own context on to the replica (`traceparent` upstream), so a vLLM started with
  `--otlp-traces-endpoint` adds its spans below it;
- starts when the call reaches the proxy and ends when the call's record is built (for a
  stream, after its last byte), with the record's ids, replica, policy version, status and
  token counts as attributes (`rolltap.*`, and OpenTelemetry's `gen_ai.*` names where one
  exists), so a span can be looked up in the database by `rolltap.call_id` and back.

The provider is the proxy's own (not the process-global one): several proxies in one process
(tests) do not share exporters, and an application embedding the proxy keeps its own.
Spans leave through a batch processor on a thread of its own: the event loop never waits
on the collector, and an unreachable collector loses spans, never calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.settings import TracingSettings
from shared.types import CallRecord, CallStatus, Route

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["Tracing", "load_tracing"]

_OPERATION: dict[str, str] = {Route.CHAT: "chat", Route.COMPLETIONS: "text_completion", Route.MESSAGES: "chat"}


class Tracing:
    def __init__(self, settings: TracingSettings) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s),
            schedule_delay_millis=int(settings.export_interval_s * 1000),
        ))
        self._tracer: Tracer = self._provider.get_tracer("rolltap.proxy")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._ok, self._error = Status(StatusCode.OK), StatusCode.ERROR
        self._status = Status
        self._in_context = set_span_in_context

    def start(self, route: str, headers: Any, started_ns: int) -> Span:
        """A span for a call that just arrived, child of the caller's `traceparent` if it sent one."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        return self._tracer.start_span(f"rolltap {route}", context=parent, kind=self._server,
                                       start_time=started_ns)

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        """Add the span's `traceparent` (and `tracestate`) to the headers sent to the replica."""
        self._propagator.inject(headers, context=self._in_context(span))

    def finish(self, span: Span, record: CallRecord) -> None:
        """Stamp what the record holds on the span and end it; once per call, like the record."""
        if span.is_recording():
            span.set_attributes(_attributes(record))
            if record.status == CallStatus.OK:
                span.set_status(self._ok)
            else:
                message = (record.error or {}).get("message") if isinstance(record.error, dict) else None
                span.set_status(self._status(self._error, f"{record.status}: {message or ''}".rstrip(": ")))
        span.end()

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the export thread."""
        self._provider.shutdown()


def _attributes(record: CallRecord) -> dict[str, Any]:
    usage = record.usage if isinstance(record.usage, dict) else {}  # OpenAI's names, or Anthropic's
    attrs: dict[str, Any] = {
        "rolltap.call_id": record.call_id,
        "rolltap.route": record.route,
        "rolltap.status": record.status,
        "rolltap.streaming": record.is_streaming,
        "gen_ai.operation.name": _OPERATION.get(record.route, record.route),
    }
    optional = {
        "rolltap.rollout_id": record.rollout_id,
        "rolltap.attempt_id": record.attempt_id,
        "rolltap.replica": record.replica,
        "rolltap.policy_version": record.policy_version,
        "http.response.status_code": record.http_status,
        "gen_ai.request.model": record.requested_model,
        "gen_ai.response.model": record.served_model,
        "gen_ai.usage.input_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
        "gen_ai.usage.output_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
        "gen_ai.response.finish_reasons": [record.finish_reason] if record.finish_reason else None,
        "error.type": (record.error or {}).get("type") if isinstance(record.error, dict) else None,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    if record.first_byte_at is not None:
        attrs["rolltap.time_to_first_byte_ms"] = (record.first_byte_at - record.started_at).total_seconds() * 1000
    return attrs


def load_tracing(settings: TracingSettings) -> Tracing | None:
    """The proxy's tracing, or None when no collector is configured (then nothing is imported)."""
    return Tracing(settings) if settings.otlp_endpoint else None
