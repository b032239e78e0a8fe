"""Prometheus metrics of the proxy, served on `GET /metrics`.

Module-level collectors in the default registry, as prometheus_client intends. Label
values come from fixed sets: `route` is one of `ROUTES` (else "other"), `status` a
`CallStatus`, `replica` a configured replica URL; never a client's path or id, so no
request can add a series.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.types import Route

__all__ = [
    "DEAD_LETTER_RECORDS",
    "JOURNAL_WRITE_FAILURES",
    "RECORDS_HELD",
    "RECORDER_QUEUE",
    "RECORDER_WRITE_SECONDS",
    "RECORDS_SPOOLED",
    "RECORDS_UNDURABLE",
    "RECORDS_WRITTEN",
    "REQUESTS",
    "ROUTES",
    "REQUEST_SECONDS",
    "TTFB_SECONDS",
]

# Every route the relay serves (`proxy.routes.relayed`); anything else is counted as "other".
ROUTES = frozenset({*(r.value for r in Route), "embeddings", "responses"})

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter("rolltap_requests_total", "Calls relayed, by route and record status", ["route", "status"])
REQUEST_SECONDS = Histogram(
    "rolltap_request_seconds", "Call duration in the proxy, start to last byte", ["route"], buckets=_LATENCY_BUCKETS
)
TTFB_SECONDS = Histogram(
    "rolltap_ttfb_seconds", "Time to the replica's first byte", ["route"], buckets=_LATENCY_BUCKETS
)
RECORDER_QUEUE = Gauge("rolltap_recorder_queue_depth", "Records waiting for the writer")
RECORDER_WRITE_SECONDS = Histogram(
    "rolltap_recorder_write_seconds", "Time to write one batch of records", buckets=_LATENCY_BUCKETS
)
RECORDS_WRITTEN = Counter("rolltap_records_written_total", "Call records committed to the database")
RECORDS_SPOOLED = Counter("rolltap_records_spooled_total", "Call records spooled to disk during an outage")
RECORDS_UNDURABLE = Counter(
    "rolltap_records_undurable_total",
    "Call records the database refused (not an outage), kept in the dead-letter spool until replayed",
)
DEAD_LETTER_RECORDS = Gauge(
    "rolltap_dead_letter_records", "Call records waiting in the dead-letter spool (`rolltap-proxy spool list`)"
)
JOURNAL_WRITE_FAILURES = Counter(
    "rolltap_journal_write_failures_total",
    "Call records the proxy's disk refused to journal (full, read-only, I/O error); each still went to the recorder",
)
RECORDS_HELD = Gauge(
    "rolltap_records_held_in_memory",
    "Call records waiting in memory because neither the database nor the proxy's disk took them",
)
