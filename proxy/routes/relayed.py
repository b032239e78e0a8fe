"""OpenAI-compatible routes that reach a replica: templated (recorded per attempt) and plain `/v1`.

Plain Starlette routes rather than FastAPI endpoints: the hot path needs no parameter
parsing or OpenAPI model, and skipping it is measurably cheaper per request.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.relay import Relay
from proxy.routes.ids import check_id
from shared.types import Route as CallRoute

__all__ = ["match_relayed_post", "relay_post", "relayed_routes"]

PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}/v1"


def _relay(request: Request) -> Relay:
    relay: Relay = request.app.state.relay
    return relay


def _tracked(route: str):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        return await relay_post(request, route, request.path_params["rollout_id"], request.path_params["attempt_id"])

    endpoint.__name__ = "tracked_" + route.replace("/", "_")
    return endpoint


async def tracked_models(request: Request) -> Response:
    check_id(request.path_params["rollout_id"], "rollout_id")
    check_id(request.path_params["attempt_id"], "attempt_id")
    return await _relay(request).models()


async def untracked(request: Request) -> Response:
    """Plain `/v1/...`: forwarded as sent; recorded without an attempt (evaluation traffic)."""
    path = request.path_params["path"]
    if request.method == "POST":
        return await relay_post(request, path, None, None)
    return await _relay(request).passthrough("/v1/" + path)


_TRACKED = frozenset(r.value for r in CallRoute)


def match_relayed_post(path: str) -> tuple[str, str | None, str | None] | None:
    """`(route, rollout_id, attempt_id)` when a POST to `path` is one of the relayed routes above.

    Matches exactly what those routes match (`{rollout_id}` and `{attempt_id}` are one path
    segment each; `/v1/{path:path}` is anything after `/v1/`), so `ProxyApp` can serve them
    without the framework's routing and middleware layers.
    """
    if path.startswith("/rollout/"):
        parts = path.split("/", 6)  # "", "rollout", rid, "attempt", aid, "v1", route
        if (len(parts) == 7 and parts[3] == "attempt" and parts[5] == "v1" and parts[6] in _TRACKED
                and parts[2] and parts[4]):
            return parts[6], parts[2], parts[4]
        return None
    if path.startswith("/v1/"):
        return path[4:], None, None
    return None


async def relay_post(request: Request, route: str, rollout_id: str | None, attempt_id: str | None) -> Response:
    """The endpoint of every relayed POST, once matched."""
    if rollout_id is None or attempt_id is None:
        return await _relay(request).handle(request, route[:64], None, None)
    check_id(rollout_id, "rollout_id")
    check_id(attempt_id, "attempt_id")
    return await _relay(request).handle(request, route, rollout_id, attempt_id)


def relayed_routes() -> list[BaseRoute]:
    routes: list[BaseRoute] = [
        Route(f"{PREFIX}/{r.value}", _tracked(r.value), methods=["POST"]) for r in CallRoute
    ]
    routes.append(Route(f"{PREFIX}/models", tracked_models, methods=["GET"]))
    routes.append(Route("/v1/{path:path}", untracked, methods=["GET", "POST"]))
    return routes
