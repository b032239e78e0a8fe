"""Record types and vocabularies shared by the proxy and the trainer.

`CallRecord` is what the proxy hands its recorder for each call; its fields are the
columns of `calls` (see `shared/db/models.py`). It is a plain dataclass so records
can be spooled to disk as JSON and read back unchanged.
"""

from __future__ import annotations

import base64
import re
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any

__all__ = [
    "ID_PATTERN",
    "CallRecord",
    "CallStatus",
    "Route",
    "is_valid_id",
]

# Public contract: 1-128 characters of [A-Za-z0-9._:-].
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def is_valid_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None


class CallStatus(StrEnum):
    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"  # the replica answered with an HTTP error or an error event
    FAILED = "failed"  # no usable answer: replica unreachable, timed out, or died mid-stream
    CLIENT_DISCONNECTED = "client_disconnected"  # the client left before the response ended (or its request did)
    INVALID_REQUEST = "invalid_request"  # rejected by the proxy before reaching a replica
    # The proxy died (kill -9, crash) while the call was in flight: written from its journal on restart.
    INTERRUPTED = "interrupted"


class Route(StrEnum):
    CHAT = "chat/completions"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"


@dataclass(slots=True)
class CallRecord:
    """One call, as the proxy saw it. `seq` is assigned by the writer, not here."""

    call_id: str
    rollout_id: str | None
    attempt_id: str | None
    route: str
    is_streaming: bool
    status: str
    started_at: datetime
    ended_at: datetime
    http_status: int | None = None
    error: dict[str, Any] | None = None
    request: Any = None
    response: Any = None
    response_truncated: bool = False
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    replica: str | None = None
    policy_version: int | None = None
    requested_model: str | None = None
    served_model: str | None = None
    first_byte_at: datetime | None = None
    # The bytes exactly as they crossed the wire: from the client, and from the replica.
    request_body: bytes | None = None
    response_body: bytes | None = None
    # Arrival order inside this proxy process: breaks ties between equal start times.
    arrival: int = field(default=0, compare=False)

    @property
    def attempt_key(self) -> tuple[str, str] | None:
        if self.rollout_id is None or self.attempt_id is None:
            return None
        return (self.rollout_id, self.attempt_id)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("started_at", "ended_at", "first_byte_at"):
            if out[key] is not None:
                out[key] = out[key].isoformat()
        for key in _BYTE_FIELDS:
            if out[key] is not None:
                out[key] = base64.b64encode(out[key]).decode()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("started_at", "ended_at", "first_byte_at"):
            if values.get(key) is not None:
                values[key] = datetime.fromisoformat(values[key])
        for key in _BYTE_FIELDS:
            if values.get(key) is not None:
                values[key] = base64.b64decode(values[key])
        return cls(**values)


_BYTE_FIELDS = ("request_body", "response_body")
