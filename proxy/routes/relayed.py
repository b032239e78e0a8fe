"""OpenAI-compatible routes that reach a replica: templated (recorded per attempt) and plain `/v1`.

Plain Starlette routes rather than FastAPI endpoints: the hot path needs no parameter
parsing or OpenAPI model, and skipping it is measurably cheaper per request (their
OpenAPI entries are written by hand in `proxy/openapi.py`).

Only the inference API is relayed. A path is forwarded to a replica as `/v1/<route>`
with `<route>` taken from the fixed sets below, never from the client's path, so no
path a client sends (`/v1/../pause`, `/v1/load_lora_adapter`) can reach a replica's
control routes; those are the admin API's business.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.access import KeyRing
from proxy.relay import Relay
from proxy.routes.ids import check_id
from shared.types import Route as CallRoute

__all__ = ["UNTRACKED_POST", "has_dot_segment", "match_relayed_post", "relay_post", "relayed_routes"]

PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}/v1"

_TRACKED = frozenset(r.value for r in CallRoute)
# Untracked (`/v1/...`, no ids) inference routes: the recorded ones plus embeddings and responses
# (each also a value of the `route` metric label, `proxy.metrics.ROUTES`).
UNTRACKED_POST = _TRACKED | {"embeddings", "responses"}


def has_dot_segment(path: str) -> bool:
    """Does the (percent-decoded) path hold a `.` or `..` segment? Such paths are refused, never resolved."""
    return "/." in path and any(part in (".", "..") for part in path.split("/"))


def _relay(request: Request) -> Relay:
    relay: Relay = request.app.state.relay
    return relay


def _keys(request: Request) -> KeyRing:
    keys: KeyRing = request.app.state.keys
    return keys


def _tracked(route: str):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        return await relay_post(request, route, request.path_params["rollout_id"], request.path_params["attempt_id"])

    endpoint.__name__ = "tracked_" + route.replace("/", "_")
    endpoint.__doc__ = f"Relayed to a replica and recorded in the attempt (`{route}`)."
    return endpoint


def _untracked(route: str):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        return await relay_post(request, route, None, None)

    endpoint.__name__ = "untracked_" + route.replace("/", "_")
    endpoint.__doc__ = f"Relayed to a replica; recorded as untracked traffic, no attempt (`{route}`)."
    return endpoint


async def tracked_models(request: Request) -> Response:
    """A healthy replica's model list, as it sent it (clients probe it at start); not recorded."""
    rollout_id = check_id(request.path_params["rollout_id"], "rollout_id")
    check_id(request.path_params["attempt_id"], "attempt_id")
    await _keys(request).authenticate(request.scope["headers"], rollout_id)
    return await _relay(request).models()


async def untracked_models(request: Request) -> Response:
    """The same model list, without ids."""
    await _keys(request).authenticate(request.scope["headers"], None)
    return await _relay(request).models()


def match_relayed_post(path: str) -> tuple[str, str | None, str | None] | None:
    """`(route, rollout_id, attempt_id)` when a POST to `path` is one of the relayed routes above.

    Matches exactly what those routes match (`{rollout_id}` and `{attempt_id}` are one path
    segment each), so `ProxyApp` can serve them without the framework's routing and
    middleware layers. Anything else goes through the framework (404, 405 with `Allow`).
    """
    if path.startswith("/rollout/"):
        parts = path.split("/", 6)  # "", "rollout", rid, "attempt", aid, "v1", route
        if (len(parts) == 7 and parts[3] == "attempt" and parts[5] == "v1" and parts[6] in _TRACKED
                and parts[2] and parts[4]):
            return parts[6], parts[2], parts[4]
        return None
    if path.startswith("/v1/") and path[4:] in UNTRACKED_POST:
        return path[4:], None, None
    return None


async def relay_post(request: Request, route: str, rollout_id: str | None, attempt_id: str | None) -> Response:
    """The endpoint of every relayed POST, once matched: ids, then the caller's key, then the relay."""
    if rollout_id is not None and attempt_id is not None:
        check_id(rollout_id, "rollout_id")
        check_id(attempt_id, "attempt_id")
    state = request.app.state
    agent = await state.keys.authenticate(request.scope["headers"], rollout_id)
    relay: Relay = state.relay
    return await relay.handle(request, route, rollout_id, attempt_id, agent)


def relayed_routes() -> list[BaseRoute]:
    routes: list[BaseRoute] = [
        Route(f"{PREFIX}/{r.value}", _tracked(r.value), methods=["POST"]) for r in CallRoute
    ]
    routes.append(Route(f"{PREFIX}/models", tracked_models, methods=["GET"]))
    routes += [Route(f"/v1/{route}", _untracked(route), methods=["POST"]) for route in sorted(UNTRACKED_POST)]
    routes.append(Route("/v1/models", untracked_models, methods=["GET"]))
    return routes
