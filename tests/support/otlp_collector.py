"""An OTLP/HTTP trace receiver on loopback: what a collector would be sent, decoded.

    with OtlpCollector() as collector:       # exporter endpoint: collector.endpoint
        ...
        spans = collector.spans()             # every span received so far, as protobuf Span

It speaks the protocol's binary (protobuf) encoding, the one OpenTelemetry's HTTP exporter
sends by default, and answers 200 with an empty ExportTraceServiceResponse.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpCollector", "attributes"]


class OtlpCollector:
    def __init__(self) -> None:
        self._requests: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector._lock:
                    collector._requests.append(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) for every span received."""
        with self._lock:
            requests = list(self._requests)
        return [(attributes(rs.resource.attributes), span)
                for request in requests for rs in request.resource_spans
                for ss in rs.scope_spans for span in ss.spans]


def attributes(kvs: Any) -> dict[str, Any]:
    """OTLP KeyValue list -> plain dict (scalars and arrays of scalars)."""
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind) if kind else None

    return {kv.key: value(kv.value) for kv in kvs}
