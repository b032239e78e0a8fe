"""Admin API (bearer-token protected): replicas, the active policy, admission pause/resume.

Used by operators and by the trainer around weight pushes. Refused (403) when no
`proxy.admin_token` is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.ext.asyncio import AsyncConnection

from proxy import store
from shared.errors import Forbidden, ServiceUnavailable, Unauthorized

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
        return value


class DrainIn(ReplicaIn):
    wait: bool = False
    timeout_s: float = Field(default=60.0, gt=0)


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    served_name: str = Field(min_length=1, max_length=256)
    kind: Literal["base", "lora", "full"] = "lora"
    base_model: str | None = None
    path: str | None = None


class PauseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wait: bool = True
    timeout_s: float = Field(default=60.0, gt=0)


async def _persist_replica(request: Request, url: str, weight_mode: str, state: str) -> None:
    async def op(conn: AsyncConnection) -> None:
        await store.upsert_replica(conn, url, weight_mode, state)

    await request.app.state.recorder.run(op, 30.0)


@router.get("/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    balancer = request.app.state.balancer
    return {"object": "list", "policy": request.app.state.settings.proxy.pool.policy,
            "data": [r.describe() for r in balancer.replicas]}


@router.post("/replicas", status_code=201)
async def add_replica(body: ReplicaIn, request: Request) -> dict[str, Any]:
    replica = request.app.state.balancer.add(body.url, body.weight_mode)
    await _persist_replica(request, replica.url, replica.weight_mode, "active")
    return replica.describe()


@router.delete("/replicas")
async def remove_replica(url: str, request: Request) -> dict[str, Any]:
    replica = request.app.state.balancer.remove(url.rstrip("/").removesuffix("/v1"))
    await _persist_replica(request, replica.url, replica.weight_mode, "removed")
    return {**replica.describe(), "state": "removed"}


@router.post("/replicas/drain")
async def drain_replica(body: DrainIn, request: Request) -> dict[str, Any]:
    replica = request.app.state.balancer.drain(body.url)
    await _persist_replica(request, replica.url, replica.weight_mode, "draining")
    if body.wait:
        try:
            await asyncio.wait_for(replica.drained.wait(), body.timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"replica {body.url} still has {replica.in_flight} call(s) in flight",
                                     code="drain_timeout", retry_after_s=1.0) from None
    state = "removed" if replica.drained.is_set() else "draining"
    if state == "removed":
        await _persist_replica(request, replica.url, replica.weight_mode, "removed")
    return {**replica.describe(), "state": state}


@router.get("/policy")
async def get_policy(request: Request) -> dict[str, Any]:
    policy = request.app.state.policy
    return {"object": "rolltap.policy", "version": policy.version, "served_name": policy.served_name}


@router.put("/policy")
async def put_policy(body: PolicyIn, request: Request) -> dict[str, Any]:
    """Make a policy version active: new calls are rewritten to it and stamped with it."""
    async def op(conn: AsyncConnection) -> None:
        await store.set_active_policy(conn, body.version, body.served_name, body.kind, body.base_model, body.path)

    await request.app.state.recorder.run(op, 30.0)
    request.app.state.policy.set(body.version, body.served_name)
    return {"object": "rolltap.policy", "version": body.version, "served_name": body.served_name}


@router.post("/pause")
async def pause(body: PauseIn, request: Request) -> dict[str, Any]:
    """Stop admitting new calls; with `wait`, return once the calls in flight have ended."""
    state = request.app.state
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
    request.app.state.admission.resume()
    return {"object": "rolltap.admission", "paused": False, "in_flight": request.app.state.balancer.in_flight}
