"""The typed SQLAlchemy schema: what Rolltap stores, on SQLite and PostgreSQL alike.

The schema changes only through alembic migrations (`shared/db/migrations`); a test
checks that the migrations produce exactly these models on both backends.
`docs/schema.md` is generated from these classes (`python -m shared.schema_docs`): each class's
docstring says what its table holds, each column's `doc` what it means.

Calls and attempts are keyed by the caller's string ids (`rollout_id`, `attempt_id`)
rather than surrogate keys, so the proxy's writer never needs a lookup round trip
before inserting a batch.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "AgentKey",
    "Attempt",
    "Base",
    "Call",
    "CallDrop",
    "CallLease",
    "ClusterState",
    "Export",
    "ExportAttempt",
    "LoraAdapter",
    "PolicyVersion",
    "Proxy",
    "Replica",
    "ReplicaEjection",
    "Reward",
    "Rollout",
    "TrainingStep",
    "UndurableCall",
    "TrainingStepAttempt",
]

# JSONB on PostgreSQL (indexable, compact); JSON text elsewhere.
Json = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit key.
BigId = BigInteger().with_variant(Integer(), "sqlite")
ID_LEN = 128


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: Json, list[Any]: Json}


def _now() -> Any:
    return func.now()


class Rollout(Base):
    """A task instance. Created by its first call, or registered by `POST /rollouts`."""

    __tablename__ = "rollouts"

    rollout_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(
        String(ID_LEN), index=True, doc="The GRPO group its attempts join; NULL: the rollout is its own group.")
    task: Mapped[Any | None] = mapped_column(Json, doc="As registered; a queryable copy, see `json_exact`.")
    meta: Mapped[dict[str, Any] | None] = mapped_column(
        "metadata", Json, doc="As registered; a queryable copy, see `json_exact`.")
    json_exact: Mapped[str | None] = mapped_column(
        Text, doc='(0008) `{"task", "metadata"}` exactly, as ASCII JSON text, when the queryable copies had to '
        "change to be storable (U+0000, lone surrogates, numbers beyond float64); else NULL.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class Attempt(Base):
    """One try at a rollout; its calls, rewards and status. Attempts of a group are GRPO samples.

    The indexes on (`status`, `id`), (`policy_version`, `id`) and `created_at` (0005) serve the
    dashboard's list, newest first, keyset-paginated.
    """

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("rollout_id", "attempt_id", name="uq_attempts_rollout_attempt"),
        # The dashboard's attempt list: newest first (keyset on `id`) within a status or a version, or by time.
        Index("ix_attempts_status_id", "status", "id"),
        Index("ix_attempts_policy_version_id", "policy_version", "id"),
        Index("ix_attempts_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(
        String(ID_LEN), ForeignKey("rollouts.rollout_id", name="fk_attempts_rollout"), nullable=False
    )
    attempt_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    status: Mapped[str] = mapped_column(
        String(16), nullable=False, server_default="running", index=True,
        doc="`running`, then `succeeded`, `failed` or `cancelled` (set by `finish`).")
    num_calls: Mapped[int] = mapped_column(
        Integer, nullable=False, server_default="0",
        doc="Calls recorded so far: the writer grows it in the transaction that inserts them, before the "
            "insert (the row lock orders writers of one attempt; numbers come from its in-memory counters).")
    policy_version: Mapped[int | None] = mapped_column(Integer, doc="The policy version of its first call.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)


class Call(Base):
    """One relayed call, recorded exactly once whatever its end (`docs/recording.md`)."""

    __tablename__ = "calls"
    __table_args__ = (
        ForeignKeyConstraint(
            ["rollout_id", "attempt_id"],
            ["attempts.rollout_id", "attempts.attempt_id"],
            name="fk_calls_attempt",
        ),
        UniqueConstraint("rollout_id", "attempt_id", "seq", name="uq_calls_attempt_seq"),
        Index("ix_calls_started_at", "started_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    call_id: Mapped[str] = mapped_column(
        String(40), nullable=False, unique=True,
        doc="`call-<uuid hex>`, also sent to the client as `x-rolltap-call-id`.")
    rollout_id: Mapped[str | None] = mapped_column(String(ID_LEN), doc="NULL for untracked `/v1` traffic.")
    attempt_id: Mapped[str | None] = mapped_column(String(ID_LEN), doc="NULL for untracked `/v1` traffic.")
    seq: Mapped[int | None] = mapped_column(
        Integer, doc="0, 1, ... in the attempt (`docs/recording.md`); NULL for untracked traffic.")
    route: Mapped[str] = mapped_column(
        String(64), nullable=False,
        doc="`chat/completions`, `completions`, `messages`, `responses` (or the `/v1` path of an untracked call).")
    is_streaming: Mapped[bool] = mapped_column(Boolean, nullable=False, doc="The client asked for a stream.")
    status: Mapped[str] = mapped_column(
        String(24), nullable=False,
        doc="How it ended: `ok`, `upstream_error`, `failed`, `client_disconnected`, `invalid_request`, `interrupted`.")
    http_status: Mapped[int | None] = mapped_column(Integer, doc="The status the client got.")
    error: Mapped[dict[str, Any] | None] = mapped_column(Json, doc="The error object, if any.")
    request: Mapped[Any | None] = mapped_column(
        Json, doc="The JSON body as sent upstream (after the proxy's additions); a queryable copy, see `json_exact`.")
    response: Mapped[Any | None] = mapped_column(
        Json, doc="The JSON response; for streams, assembled into the non-streamed shape. When `response_truncated`, "
        'parsed from the bytes kept (a whole response as `{"raw": its first 4 KiB}`, a stream from the events '
        "kept). A queryable copy, see `json_exact`.")
    response_truncated: Mapped[bool] = mapped_column(
        Boolean, nullable=False, server_default=false(),
        doc="The response exceeded `max_body_bytes`; the token columns still hold the whole answer's.")
    request_body: Mapped[bytes | None] = mapped_column(
        LargeBinary, doc="(0003) The exact bytes the client sent, whatever they are (invalid JSON and UTF-8 "
        "included); `request` is a parsed copy. NULL for calls recorded before 0003.")
    response_body: Mapped[bytes | None] = mapped_column(
        LargeBinary, doc="(0003) The exact bytes the replica sent, which the client received unchanged (for streams "
        "the SSE bytes, with the proxy's own final error event when it added one); cut at `max_body_bytes`. "
        "NULL before 0003 and for calls that got no answer.")
    json_exact: Mapped[str | None] = mapped_column(
        Text, doc='(0003) `{"request", "response", "error"}` exactly, as ASCII JSON text, when the queryable '
        "copies had to change to be storable (U+0000 and lone surrogates become U+FFFD there, numbers beyond "
        "float64 null); else NULL. Readers (GET attempt, the trainer) overlay it.")
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column(Json, doc="Exact prompt token IDs from the replica.")
    completion_token_ids: Mapped[list[Any] | None] = mapped_column(
        Json, doc="Exact completion token IDs from the replica (first choice).")
    completion_logprobs: Mapped[list[Any] | None] = mapped_column(Json, doc="One logprob per completion token.")
    finish_reason: Mapped[str | None] = mapped_column(String(32), doc="From the response.")
    usage: Mapped[dict[str, Any] | None] = mapped_column(
        Json, doc="From the response; computed from token counts when a stream carried none.")
    replica: Mapped[str | None] = mapped_column(String(512), doc="Where it ran (credentials written `***@`).")
    policy_version: Mapped[int | None] = mapped_column(Integer, doc="The policy version active when it started.")
    requested_model: Mapped[str | None] = mapped_column(
        String(256), doc="The model the client named (made storable, cut to the column; exact in the bodies).")
    served_model: Mapped[str | None] = mapped_column(String(256), doc="The model sent upstream.")
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, doc="Arrival.")
    first_byte_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), doc="The replica's first byte (response headers).")
    ended_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, doc="The last byte.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class UndurableCall(Base):
    """A call record the proxy could not write (not an outage: the database refused this row).

    The record itself waits in the spool's `dead/` folder; `rolltap-proxy spool replay` writes
    it once the cause is fixed and deletes this row. While a row exists, its attempt is not
    durable: `finish` answers 507, GET attempt lists it, and the trainer skips the attempt (0003).
    """

    __tablename__ = "undurable_calls"
    __table_args__ = (Index("ix_undurable_calls_attempt", "rollout_id", "attempt_id"),)

    call_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rollout_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    attempt_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    reason: Mapped[str] = mapped_column(Text, nullable=False, doc="Why the database refused the record.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class Reward(Base):
    """A reward posted for an attempt (several allowed), optionally aimed at one call."""

    __tablename__ = "rewards"
    __table_args__ = (
        ForeignKeyConstraint(
            ["rollout_id", "attempt_id"],
            ["attempts.rollout_id", "attempts.attempt_id"],
            name="fk_rewards_attempt",
        ),
        Index("ix_rewards_attempt", "rollout_id", "attempt_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    attempt_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    value: Mapped[float] = mapped_column(Float, nullable=False)
    name: Mapped[str | None] = mapped_column(String(128), doc="Optional; `final` when given with `finish`.")
    call_id: Mapped[str | None] = mapped_column(String(40), doc="Optional: the call it rewards.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class PolicyVersion(Base):
    """A policy the replicas serve. Version 0 is the base model."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    served_name: Mapped[str] = mapped_column(
        String(256), nullable=False, doc="The model name calls are rewritten to (base model or LoRA adapter).")
    base_model: Mapped[str | None] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(16), nullable=False, doc="`base`, `lora` or `full`.")
    path: Mapped[str | None] = mapped_column(Text, doc="Where its weights or adapter were exported.")
    is_active: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class Replica(Base):
    """A vLLM replica the proxy knows, with the weight-update mode it was started for."""

    __tablename__ = "replicas"

    url: Mapped[str] = mapped_column(String(512), primary_key=True, doc="Credentials in it written `***@`.")
    weight_mode: Mapped[str] = mapped_column(
        String(16), nullable=False, server_default="none", doc="`none`, `lora` or `full`.")
    state: Mapped[str] = mapped_column(
        String(16), nullable=False, server_default="active", doc="`active`, `draining` or `removed`.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=_now(), onupdate=_now()
    )


class TrainingStep(Base):
    """One trainer update; it commits together with the attempts it consumed."""

    __tablename__ = "training_steps"

    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    policy_version: Mapped[int | None] = mapped_column(Integer, doc="The policy version it produced.")
    metrics: Mapped[dict[str, Any] | None] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class TrainingStepAttempt(Base):
    """Which attempts a step consumed. The primary key on the attempt makes consumption at-most-once."""

    __tablename__ = "training_step_attempts"

    attempt_pk: Mapped[int] = mapped_column(
        BigId, ForeignKey("attempts.id", name="fk_tsa_attempt"), primary_key=True
    )
    step: Mapped[int] = mapped_column(
        Integer, ForeignKey("training_steps.step", name="fk_tsa_step"), nullable=False, index=True
    )


class CallDrop(Base):
    """A call the trainer left out of every triplet, and why. One row per call: the latest reason wins."""

    __tablename__ = "call_drops"

    call_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("calls.call_id", name="fk_call_drops_call"), primary_key=True
    )
    rollout_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    attempt_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    reason: Mapped[str] = mapped_column(
        String(32), nullable=False, index=True,
        doc="`not_ok`, `no_tokens`, `empty_completion`, `logprobs_mismatch`, `prompt_too_long`, "
        "`response_too_long` or `truncated`.")
    detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class Export(Base):
    """A `rolltap-trainer export --mark-consumed`: a file that consumed attempts instead of a training step."""

    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    format: Mapped[str] = mapped_column(String(16), nullable=False)
    path: Mapped[str] = mapped_column(Text, nullable=False)
    num_attempts: Mapped[int] = mapped_column(Integer, nullable=False)
    num_triplets: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class ExportAttempt(Base):
    """Which attempts an export consumed; the primary key on the attempt makes it at-most-once, as for steps."""

    __tablename__ = "export_attempts"

    attempt_pk: Mapped[int] = mapped_column(
        BigId, ForeignKey("attempts.id", name="fk_export_attempts_attempt"), primary_key=True
    )
    export_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("exports.id", name="fk_export_attempts_export"), nullable=False, index=True
    )


class AgentKey(Base):
    """An agent API key, stored as the SHA-256 of the key (the key itself is shown once, at creation).

    Managed by `rolltap-proxy keys` (0004).
    """

    __tablename__ = "agent_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    name: Mapped[str | None] = mapped_column(String(128))
    rollout_prefix: Mapped[str | None] = mapped_column(
        String(ID_LEN), doc="Its scope: calls, rewards, finish and reads of rollouts whose id starts with this; "
        "NULL: every rollout.")
    max_concurrency: Mapped[int | None] = mapped_column(
        Integer, doc="Its calls in flight per proxy process; NULL: `proxy.limits.max_calls_per_key`.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Proxy(Base):
    """A live proxy process (0006): its heartbeat, and the last shared state epoch it applied and drained for.

    Removed on a clean stop, or by a live proxy once silent for `proxy.cluster.dead_after_s`.
    """

    __tablename__ = "proxies"

    proxy_id: Mapped[str] = mapped_column(String(64), primary_key=True, doc="`<host>-<pid>-<random>`.")
    host: Mapped[str] = mapped_column(String(256), nullable=False)
    pid: Mapped[int] = mapped_column(Integer, nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    heartbeat_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=_now(),
        doc="The database's clock at its last heartbeat (every `proxy.cluster.heartbeat_s`).")
    in_flight: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0", doc="Its calls in flight.")
    unleased_calls: Mapped[int] = mapped_column(
        Integer, nullable=False, server_default="0",
        doc="(0009) Calls it sent upstream without a lease row (cut off from the database), not yet committed.")
    seen_epoch: Mapped[int] = mapped_column(
        BigInteger, nullable=False, server_default="0", doc="The shared-state epoch it applied.")
    drained_epoch: Mapped[int] = mapped_column(
        BigInteger, nullable=False, server_default="0", doc="The epoch it drained its calls in flight for.")


class CallLease(Base):
    """A tracked call in flight on some proxy (0006); deleted in the transaction that commits its record.

    `finish` waits until its attempt has none; a dead proxy's leases become `interrupted` records
    (error code `proxy_lost`).
    """

    __tablename__ = "call_leases"
    __table_args__ = (
        Index("ix_call_leases_attempt", "rollout_id", "attempt_id"),
        Index("ix_call_leases_proxy", "proxy_id"),
    )

    call_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    proxy_id: Mapped[str] = mapped_column(String(64), nullable=False)
    rollout_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    attempt_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    route: Mapped[str] = mapped_column(String(64), nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ReplicaEjection(Base):
    """A replica a live proxy ejected (0007, `proxy.cluster`): out of every proxy's pool while any
    live proxy holds a row for it; `pg_notify`d on channel `rolltap_replicas`. Only the ejecting
    proxy deletes its row (its probe passed again, no sooner than `proxy.cluster.eject_hold_s`, or
    it stops); a dead proxy's rows go with its registry row."""

    __tablename__ = "replica_ejections"

    url: Mapped[str] = mapped_column(String(512), primary_key=True)
    proxy_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    reason: Mapped[str] = mapped_column(String(512), nullable=False)
    ejected_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class ClusterState(Base):
    """The one row (`id` 1) of state every proxy on the database shares (0006): the admission pause,
    and an epoch bumped (and `pg_notify`d on channel `rolltap_cluster`) on every change (pause,
    resume, policy) that proxies acknowledge."""

    __tablename__ = "cluster_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    paused: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=false())


class LoraAdapter(Base):
    """A LoRA adapter pushed as bytes (0010, `trainer.lora_transport = "bytes"`): the trainer uploads it
    once (`PUT /admin/adapters/{name}`) and each replica's Rolltap plugin fetches it from any proxy
    (`GET /adapters/{name}`), so replicas need no filesystem shared with the trainer. The newest
    `trainer.keep_loaded_versions` stay (and the active policy's, whatever its age)."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(256), primary_key=True, doc="The served name (`policy-vN`).")
    version: Mapped[int] = mapped_column(Integer, nullable=False, index=True, doc="The policy version it serves.")
    sha256: Mapped[str] = mapped_column(String(64), nullable=False, doc="Hex SHA-256 of `data`.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    data: Mapped[bytes] = mapped_column(
        LargeBinary, nullable=False, doc="The adapter's folder as an uncompressed tar archive.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
