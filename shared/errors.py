"""Rolltap's error tree. Each error knows its HTTP status and OpenAI error `type`.

    RolltapError (500, internal_error)
    ├── InvalidRequest (400, invalid_request_error)
    │   └── InvalidId (400, invalid_request_error, code=invalid_id)
    │   ├── PayloadTooLarge (413, invalid_request_error, code=body_too_large)
    │   ├── RequestTimeout (408, invalid_request_error, code=header_timeout|body_timeout)
    │   └── HeadersTooLarge (431, invalid_request_error, code=headers_too_large)
    ├── Unauthorized (401, authentication_error)
    ├── Forbidden (403, permission_error)
    ├── NotFound (404, not_found_error)
    ├── Conflict (409, conflict_error)
    ├── TooManyRequests (429, rate_limit_error)
    ├── ServiceUnavailable (503, service_unavailable)
    │   ├── UpstreamUnavailable (503, upstream_unavailable): no replica could be reached
    │   │   └── UpstreamDisconnected (503, upstream_disconnected): it went away mid-answer
    │   └── DatabaseUnavailable (503, database_unavailable)
    ├── UpstreamTimeout (504, upstream_timeout)
    ├── NotDurable (507, storage_error, code=attempt_not_durable): a call record of the
    │   attempt was refused by the database (not an outage); it waits in the dead-letter spool
    └── LocalStorageFailed (507, storage_error, code=local_storage_unavailable): the proxy's own
        disk (journal, spool) refuses writes; new calls are refused until it takes them again

The proxy renders them as `{"error": {"message", "type", "param", "code"}}` in one
handler (`proxy/errors.py`); nothing here imports a web framework.
"""

from __future__ import annotations

__all__ = [
    "Conflict",
    "DatabaseUnavailable",
    "Forbidden",
    "HeadersTooLarge",
    "InvalidId",
    "InvalidRequest",
    "LocalStorageFailed",
    "NotDurable",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "RolltapError",
    "ServiceUnavailable",
    "TooManyRequests",
    "Unauthorized",
    "UpstreamDisconnected",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]


class RolltapError(Exception):
    status_code = 500
    type = "internal_error"
    code: str | None = None
    # The recorded call this error answers, if any: its answer carries `x-rolltap-call-id`.
    call_id: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(RolltapError):
    status_code = 400
    type = "invalid_request_error"


class InvalidId(InvalidRequest):
    code = "invalid_id"


class PayloadTooLarge(InvalidRequest):
    status_code = 413
    code = "body_too_large"


class RequestTimeout(InvalidRequest):
    # The client was too slow sending its request (a header block or body dripped, or stalled).
    status_code = 408
    code = "body_timeout"


class HeadersTooLarge(InvalidRequest):
    status_code = 431
    code = "headers_too_large"


class Unauthorized(RolltapError):
    status_code = 401
    type = "authentication_error"


class Forbidden(RolltapError):
    status_code = 403
    type = "permission_error"


class NotFound(RolltapError):
    status_code = 404
    type = "not_found_error"


class Conflict(RolltapError):
    status_code = 409
    type = "conflict_error"


class TooManyRequests(RolltapError):
    status_code = 429
    type = "rate_limit_error"


class ServiceUnavailable(RolltapError):
    status_code = 503
    type = "service_unavailable"


class UpstreamUnavailable(ServiceUnavailable):
    type = "upstream_unavailable"


class UpstreamDisconnected(UpstreamUnavailable):
    # The replica went away after its headers: a stream ends with this as its last event.
    type = "upstream_disconnected"
    code = "upstream_disconnected"


class DatabaseUnavailable(ServiceUnavailable):
    type = "database_unavailable"


class UpstreamTimeout(RolltapError):
    status_code = 504
    type = "upstream_timeout"


class NotDurable(RolltapError):
    # 507 Insufficient Storage: "unable to store the representation needed to complete the
    # request". Not 500 (nothing crashed) and not 503 (retrying does not help until the cause
    # is fixed and the record replayed).
    status_code = 507
    type = "storage_error"
    code = "attempt_not_durable"


class LocalStorageFailed(RolltapError):
    # 507 as well, but with Retry-After: the proxy's disk (full, read-only, I/O errors) cannot
    # journal a new call, so it is refused before anything goes upstream; it passes once the
    # disk takes writes again, with nothing to replay by hand.
    status_code = 507
    type = "storage_error"
    code = "local_storage_unavailable"
