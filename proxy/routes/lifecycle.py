"""Rollout lifecycle: registration, rewards, finish (a flush barrier) and reading an attempt.

Each needs an agent key whose scope covers the rollout (`proxy.access`), unless the
proxy runs with `proxy.open_access`.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from starlette.responses import Response

from proxy import store
from proxy.recorder import Recorder
from proxy.routes.ids import check_id
from shared.errors import DatabaseUnavailable, Forbidden, InvalidRequest, NotDurable
from shared.verbatim import ExactJsonError, db_safe_text, dumps_exact, loads_exact
from shared.settings import ProxySettings

__all__ = ["router"]

router = APIRouter()


class RolloutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    group_id: str | None = None
    task: Any = None
    metadata: dict[str, Any] | None = None


class RewardIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float
    name: str | None = Field(default=None, max_length=128)
    call_id: str | None = Field(default=None, max_length=40)

    @field_validator("name", "call_id")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        # PostgreSQL's text cannot hold U+0000 and no driver can encode a lone surrogate: a 400
        # naming the field here, never a database error (a 503 the client would retry forever).
        if value is not None and db_safe_text(value) != value:
            raise PydanticCustomError("unstorable_text", "must not contain U+0000 or a lone surrogate")
        return value

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


class FinishIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["succeeded", "failed", "cancelled"] = "succeeded"
    reward: float | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


async def attempt_key(rollout_id: str, attempt_id: str, request: Request) -> tuple[str, str]:
    """Path ids, checked before the body is parsed so a bad id is reported as such; then the caller's key."""
    key = check_id(rollout_id, "rollout_id"), check_id(attempt_id, "attempt_id")
    await request.app.state.keys.authenticate(request.scope["headers"], rollout_id)
    return key


AttemptKey = Annotated[tuple[str, str], Depends(attempt_key)]


async def rollout_body(request: Request) -> RolloutIn:
    """The registration body parsed exactly (`loads_exact`: numbers beyond float64 and lone
    surrogates kept, as in call records), then checked against `RolloutIn`."""
    try:
        value = loads_exact(await request.body())
    except ExactJsonError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    try:
        return RolloutIn.model_validate(value)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc


def _check_reward(value: float | None, param: str, settings: ProxySettings) -> None:
    """Bounded, so that the trainer's sums and spreads of rewards stay finite."""
    limit = settings.limits.max_abs_reward
    if value is not None and abs(value) > limit:
        raise InvalidRequest(f"{param} {value:g} is beyond +-{limit:g} (proxy.limits.max_abs_reward)",
                             param=param, code="reward_out_of_range")


def _collaborators(request: Request) -> tuple[Recorder, ProxySettings]:
    request.app.state.drain.touch()  # during a SIGTERM drain, agents still finish their attempts
    return request.app.state.recorder, request.app.state.settings.proxy


def _left(deadline: float) -> float:
    """What is left of a lifecycle call's one budget (`proxy.finish_timeout_s` for the barrier and the
    write together, so that an outage is answered within it). A floor keeps a write that comes
    right at the end from failing before it is tried."""
    return max(deadline - time.monotonic(), 0.05)


async def _barrier(request: Request, key: tuple[str, str], deadline: float) -> None:
    """This proxy's calls of the attempt committed, then (`proxy.cluster`) every other proxy's."""
    state = request.app.state
    timeout_s = _left(deadline)
    is_durable = await state.recorder.wait_durable(key, timeout_s)
    if is_durable and state.cluster is not None:
        is_durable = await state.cluster.wait_released(key, max(0.0, deadline - time.monotonic()))
        if is_durable:
            # A proxy cut off from the database may have served this attempt without lease rows.
            missing = await state.cluster.wait_accounted(max(0.0, deadline - time.monotonic()))
            if missing:
                raise DatabaseUnavailable(
                    f"proxies {', '.join(missing)} have not reported their calls lately (cut off from the "
                    "database?); calls of this attempt may still be on them; retry", code="not_durable",
                    retry_after_s=1.0)
    if not is_durable:
        raise DatabaseUnavailable(
            f"calls of attempt {key[0]}/{key[1]} are not yet durable after {timeout_s:.3g} s "
            "(still in flight, or the database is unreachable); retry",
            code="not_durable", retry_after_s=1.0,
        )


@router.post("/rollouts", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": RolloutIn.model_json_schema()}}}})
async def register_rollout(body: Annotated[RolloutIn, Depends(rollout_body)], request: Request) -> dict[str, Any]:
    """Register a rollout (optional): `{"rollout_id", "group_id"?, "task"?, "metadata"?}`."""
    recorder, settings = _collaborators(request)
    rollout_id = check_id(body.rollout_id, "rollout_id")
    group_id = check_id(body.group_id, "group_id") if body.group_id is not None else None
    agent = await request.app.state.keys.authenticate(request.scope["headers"], rollout_id)
    if agent is not None and group_id is not None and not agent.covers(group_id):
        # Its attempts would join another team's group and change that group's advantages.
        raise Forbidden(f"agent key {agent.id} covers rollouts starting with {agent.rollout_prefix!r}, "
                        f"not group {group_id!r}", param="group_id", code="group_out_of_scope")

    async def op(conn: AsyncConnection) -> None:
        await store.register_rollout(conn, rollout_id, group_id, body.task, body.metadata)

    await recorder.run(op, settings.finish_timeout_s)
    return {"object": "rolltap.rollout", "rollout_id": rollout_id, "group_id": group_id or rollout_id}


@router.post("/rollout/{rollout_id}/attempt/{attempt_id}/reward")
async def post_reward(key: AttemptKey, body: RewardIn, request: Request) -> dict[str, Any]:
    """Post a reward for an attempt: `{"value", "name"?, "call_id"?}`; several per attempt allowed."""
    recorder, settings = _collaborators(request)
    _check_reward(body.value, "value", settings)
    deadline = time.monotonic() + settings.finish_timeout_s
    if body.call_id is not None:
        await _barrier(request, key, deadline)  # the call must be readable to be named

    async def op(conn: AsyncConnection) -> int:
        return await store.add_reward(conn, *key, body.value, body.name, body.call_id)

    reward_id = await recorder.run(op, _left(deadline))
    return {"object": "rolltap.reward", "id": reward_id, "rollout_id": key[0], "attempt_id": key[1],
            "value": body.value, "name": body.name, "call_id": body.call_id}


@router.post("/rollout/{rollout_id}/attempt/{attempt_id}/finish")
async def finish(key: AttemptKey, body: FinishIn, request: Request) -> dict[str, Any]:
    """End an attempt: `{"status": "succeeded"|"failed"|"cancelled", "reward"?}`; a flush barrier.

    Returns only once every call of the attempt that reached this proxy (or, in a cluster, any
    proxy) is committed."""
    recorder, settings = _collaborators(request)
    _check_reward(body.reward, "reward", settings)
    deadline = time.monotonic() + settings.finish_timeout_s
    await _barrier(request, key, deadline)

    async def op(conn: AsyncConnection) -> tuple[list[dict[str, Any]], int]:
        await store.finish_attempt(conn, *key, body.status, body.reward)
        return await store.undurable_calls(conn, *key), await store.interrupted_calls(conn, *key)

    undurable, interrupted = await recorder.run(op, _left(deadline))
    request.app.state.balancer.attempt_finished(*key)  # its replica binding may go
    if undurable:
        # The status is recorded; the attempt is not complete until `rolltap-proxy spool replay`.
        reasons = "; ".join(f"{u['call_id']}: {u['reason']}" for u in undurable[:5])
        raise NotDurable(
            f"attempt {key[0]}/{key[1]} finished as {body.status!r}, but {len(undurable)} of its call records "
            f"could not be written ({reasons}); they wait in the proxy's dead-letter spool "
            "(`rolltap-proxy spool list`)", code="attempt_not_durable")
    # A call cut by a proxy crash leaves a hole: the attempt is finished but not complete.
    return {"object": "rolltap.attempt", "rollout_id": key[0], "attempt_id": key[1], "status": body.status,
            "is_durable": True, "is_complete": interrupted == 0, "interrupted_calls": interrupted}


@router.get("/rollout/{rollout_id}/attempt/{attempt_id}")
async def get_attempt(key: AttemptKey, request: Request) -> Response:
    """The attempt: its calls in order, rewards and status."""
    recorder, settings = _collaborators(request)
    # Calls that already answered should be visible even before `finish`.
    await _barrier(request, key, time.monotonic() + settings.finish_timeout_s)
    try:
        async with request.app.state.reader.connect() as conn:
            attempt = await store.read_attempt(conn, *key)
    except (DBAPIError, OSError) as exc:
        raise DatabaseUnavailable(f"database unreachable: {exc.__class__.__name__}", retry_after_s=1.0) from exc
    # Exact JSON: strings with lone surrogates go out as escapes (the default encoder cannot write them).
    return Response(dumps_exact(attempt), media_type="application/json")
