"""Admin API (bearer-token protected): replicas, the active policy, admission pause/resume,
and the replicas' own control routes (the only way to them through the proxy).

Used by operators and by the trainer around weight pushes. Refused (403) when no
`proxy.admin_token` is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated, Any, Literal
from urllib.parse import urlencode, urlsplit

import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.ext.asyncio import AsyncConnection

from proxy import store
from proxy.balancer import ReplicaState
from proxy.upstream import JSON_HEADERS
from shared.errors import Forbidden, InvalidRequest, RolltapError, ServiceUnavailable, Unauthorized

__all__ = ["router"]


def require_admin(request: Request) -> None:
    token = request.app.state.settings.proxy.admin_token
    if token is None:
        raise Forbidden("admin API disabled: set proxy.admin_token (ROLLTAP_PROXY__ADMIN_TOKEN)", code="admin_disabled")
    given = request.headers.get("authorization", "")
    expected = "Bearer " + token.get_secret_value()
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("missing or wrong admin bearer token", code="invalid_admin_token")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])

WeightMode = Literal["none", "lora", "full"]

# What the columns admin bodies land in hold (shared/db/models.py): past these the database
# refuses the row, which answered 500 before they were checked here.
INT_MAX = 2**31 - 1  # policy_versions.version: INTEGER
URL_MAX = 512  # replicas.url: VARCHAR(512)
NAME_MAX = 256  # policy_versions.served_name, base_model: VARCHAR(256)
TIMEOUT_MAX_S = 86_400.0  # a wait longer than a day is a mistake (and Infinity parses as JSON here)


def _storable(value: str) -> str:
    # PostgreSQL text holds no U+0000, and neither backend stores a lone surrogate (JSON's
    # "\ud800" escape parses to one): both failed at insert.
    if "\x00" in value:
        raise ValueError("must not contain U+0000")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


Storable = Annotated[str, AfterValidator(_storable)]


class ReplicaIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    weight_mode: WeightMode | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = value.rstrip("/").removesuffix("/v1")
        if not value.startswith(("http://", "https://")):
            raise ValueError("replica URL must start with http:// or https://")
        # Not printable: control characters, U+0000 and lone surrogates, which no database stores.
        if len(value) > URL_MAX or not value.isprintable() or " " in value:
            raise ValueError(f"replica URL must be at most {URL_MAX} printable characters without spaces")
        try:
            parts = urlsplit(value)
            host, _port = parts.hostname, parts.port  # .port raises past 0-65535
        except ValueError as exc:  # also an unclosed "[" of an IPv6 address
            raise ValueError(f"replica URL does not parse: {exc}") from None
        if not host:
            raise ValueError("replica URL has no host")
        return value


class DrainIn(ReplicaIn):
    wait: bool = False
    timeout_s: float = Field(default=60.0, gt=0, le=TIMEOUT_MAX_S)


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0, le=INT_MAX)
    served_name: Storable = Field(min_length=1, max_length=NAME_MAX)
    kind: Literal["base", "lora", "full"] = "lora"
    base_model: Storable | None = Field(default=None, max_length=NAME_MAX)
    path: Storable | None = None


# A replica's control routes (vLLM's server), by action name: the fixed set this API reaches.
CONTROL_PATHS = {
    "load_lora_adapter": "/v1/load_lora_adapter",
    # vLLM asks its LoRA resolvers (the Rolltap plugin, which fetches `GET /adapters/{name}`) about a
    # model it does not serve only on an inference call, never on /v1/load_lora_adapter: a
    # one-token completion naming the adapter is what makes the replica fetch and load it.
    "resolve_lora_adapter": "/v1/completions",
    "unload_lora_adapter": "/v1/unload_lora_adapter",
    "pause": "/pause",
    "resume": "/resume",
    "collective_rpc": "/collective_rpc",
    "reset_prefix_cache": "/reset_prefix_cache",
    "sleep": "/sleep",
    "wake_up": "/wake_up",
    # vLLM's weight-transfer engine (a replica started with `--weight-transfer-config`): full weights
    # handed over in memory (CUDA IPC, host shared memory) instead of re-read from a folder.
    "init_weight_transfer_engine": "/init_weight_transfer_engine",
    "start_weight_update": "/start_weight_update",
    "update_weights": "/update_weights",
    "finish_weight_update": "/finish_weight_update",
}
ControlAction = Literal["load_lora_adapter", "resolve_lora_adapter", "unload_lora_adapter", "pause", "resume",
                        "collective_rpc", "reset_prefix_cache", "sleep", "wake_up", "init_weight_transfer_engine",
                        "start_weight_update", "update_weights", "finish_weight_update"]


class ReplicaRefused(RolltapError):
    status_code = 502
    type = "upstream_error"
    code = "replica_refused"


class ControlIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="A replica in the pool (as `GET /admin/replicas` lists it)")
    action: ControlAction
    body: dict[str, Any] | None = Field(default=None, description="JSON body for the replica, e.g. "
                                        "`{\"lora_name\", \"lora_path\"}` or `{\"method\", \"kwargs\"}`; "
                                        "for `resolve_lora_adapter`, `{\"lora_name\"}`")
    params: dict[Storable, Storable] | None = Field(default=None,
                                                    description="Query parameters, e.g. `{\"mode\": \"wait\"}`")

    @field_validator("body")
    @classmethod
    def _encodable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # What orjson cannot write (integers past 64 bits, lone surrogates, nesting past 254) failed
        # only when the route encoded it for the replica: a 500.
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError as exc:
            raise ValueError(f"body cannot be sent as JSON: {exc}") from None
        return value


class PauseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wait: bool = True
    timeout_s: float = Field(default=60.0, gt=0, le=TIMEOUT_MAX_S)


async def _persist_replica(request: Request, url: str, weight_mode: str, state: str) -> None:
    async def op(conn: AsyncConnection) -> None:
        await store.upsert_replica(conn, url, weight_mode, state)

    await request.app.state.recorder.run(op, 30.0)


@router.get("/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    """The replicas, their health, load and weight mode, and the pool's policy."""
    balancer = request.app.state.balancer
    return {"object": "list", "policy": request.app.state.settings.proxy.pool.policy,
            "data": [r.describe() for r in balancer.replicas]}


@router.post("/replicas", status_code=201)
async def add_replica(body: ReplicaIn, request: Request) -> dict[str, Any]:
    """Add a replica to the pool (`{"url", "weight_mode"?}`); it serves once its probe passes."""
    replica: ReplicaState = request.app.state.balancer.add(body.url, body.weight_mode)
    await _persist_replica(request, replica.shown_url, replica.weight_mode, "active")
    return replica.describe()


@router.delete("/replicas")
async def remove_replica(url: str, request: Request) -> dict[str, Any]:
    """Remove a replica (`?url=`) from the pool at once."""
    replica = request.app.state.balancer.remove(url.rstrip("/").removesuffix("/v1"))
    await _persist_replica(request, replica.shown_url, replica.weight_mode, "removed")
    return {**replica.describe(), "state": "removed"}


@router.post("/replicas/drain")
async def drain_replica(body: DrainIn, request: Request) -> dict[str, Any]:
    """Send no new calls to a replica; with `wait`, return once its calls in flight have ended."""
    replica = request.app.state.balancer.drain(body.url)
    await _persist_replica(request, replica.shown_url, replica.weight_mode, "draining")
    if body.wait:
        try:
            await asyncio.wait_for(replica.drained.wait(), body.timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"replica {replica.shown_url} still has {replica.in_flight} call(s) in flight",
                                     code="drain_timeout", retry_after_s=1.0) from None
    state = "removed" if replica.drained.is_set() else "draining"
    if state == "removed":
        await _persist_replica(request, replica.shown_url, replica.weight_mode, "removed")
    return {**replica.describe(), "state": state}


@router.get("/policy")
async def get_policy(request: Request) -> dict[str, Any]:
    """The active policy version and the model name calls are rewritten to."""
    policy = request.app.state.policy
    return {"object": "rolltap.policy", "version": policy.version, "served_name": policy.served_name}


@router.put("/policy")
async def put_policy(body: PolicyIn, request: Request) -> dict[str, Any]:
    """Make a policy version active: new calls are rewritten to it and stamped with it."""
    async def op(conn: AsyncConnection) -> None:
        await store.set_active_policy(conn, body.version, body.served_name, body.kind, body.base_model, body.path)

    state = request.app.state
    if state.cluster is not None:
        # Every live proxy applies it before this returns: a call that starts afterwards, wherever
        # it lands, is stamped with this version.
        epoch = await state.cluster.publish(op=op)
        lagging = await state.cluster.wait_applied(epoch, state.settings.proxy.cluster.propagate_timeout_s,
                                                   drained=False)
        if lagging:
            raise ServiceUnavailable(f"policy {body.version} is active, but proxies {', '.join(lagging)} have not "
                                     "applied it yet", code="policy_not_propagated", retry_after_s=1.0)
    else:
        await state.recorder.run(op, 30.0)
        state.policy.set(body.version, body.served_name)
    return {"object": "rolltap.policy", "version": body.version, "served_name": body.served_name}


@router.post("/pause")
async def pause(body: PauseIn, request: Request) -> dict[str, Any]:
    """Stop admitting new calls; with `wait`, return once the calls in flight have ended (on every
    live proxy sharing the database)."""
    state = request.app.state
    if state.cluster is not None:  # every live proxy pauses; with `wait`, until all have drained
        await state.cluster.pause(body.wait, body.timeout_s)
        return {"object": "rolltap.admission", "paused": True, "in_flight": state.balancer.in_flight}
    state.admission.pause()
    if body.wait:
        deadline = time.monotonic() + body.timeout_s
        while state.balancer.in_flight > 0:
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"{state.balancer.in_flight} call(s) still in flight; admission stays "
                                         "paused", code="pause_timeout", retry_after_s=1.0)
            await asyncio.sleep(0.01)
    return {"object": "rolltap.admission", "paused": True, "in_flight": state.balancer.in_flight}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    """Admit new calls again after a pause (on every live proxy sharing the database)."""
    if request.app.state.cluster is not None:
        await request.app.state.cluster.resume()
    else:
        request.app.state.admission.resume()
    return {"object": "rolltap.admission", "paused": False, "in_flight": request.app.state.balancer.in_flight}


def _resolve_payload(body: dict[str, Any] | None) -> bytes:
    name = (body or {}).get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest('resolve_lora_adapter needs body {"lora_name": "..."}', param="body",
                             code="missing_lora_name")
    # Token id 0 exists in every vocabulary: no tokenizer assumption, and one token of work.
    return orjson.dumps({"model": name, "prompt": [0], "max_tokens": 1, "temperature": 0})


@router.post("/replicas/control")
async def control_replica(body: ControlIn, request: Request) -> dict[str, Any]:
    """Call one of a replica's control routes (LoRA load/unload, pause/resume, collective_rpc, ...).

    The relay never forwards these; this is the one way to reach them through the proxy.
    The replica's 4xx/5xx answer becomes a 502 naming its status.
    """
    state = request.app.state
    replica = state.balancer.get(body.url.rstrip("/").removesuffix("/v1"))
    path = CONTROL_PATHS[body.action] + ("?" + urlencode(body.params) if body.params else "")
    if body.action == "resolve_lora_adapter":
        payload = _resolve_payload(body.body)
    else:
        payload = orjson.dumps(body.body) if body.body is not None else b""
    upstream = await state.upstream.post(replica.url, path, payload, JSON_HEADERS)
    try:
        data = await upstream.read()
    finally:
        upstream.release()
    if upstream.status >= 400:
        raise ReplicaRefused(f"replica {replica.shown_url} answered {upstream.status} to {body.action}: "
                             f"{data[:300].decode('utf-8', 'replace')}")
    try:
        answer: Any = orjson.loads(data) if data else None
    except orjson.JSONDecodeError:
        answer = data[:4096].decode("utf-8", "replace")
    return {"object": "rolltap.replica_control", "url": replica.shown_url, "action": body.action,
            "replica_status": upstream.status, "response": answer}
