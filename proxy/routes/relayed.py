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

__all__ = ["relayed_routes"]

PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}/v1"


def _relay(request: Request) -> Relay:
    relay: Relay = request.app.state.relay
    return relay


def _tracked(route: str):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        rollout_id = check_id(request.path_params["rollout_id"], "rollout_id")
        attempt_id = check_id(request.path_params["attempt_id"], "attempt_id")
        return await _relay(request).handle(request, route, rollout_id, attempt_id)

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
        return await _relay(request).handle(request, path[:64], None, None)
    return await _relay(request).passthrough("/v1/" + path)


def relayed_routes() -> list[BaseRoute]:
    routes: list[BaseRoute] = [
        Route(f"{PREFIX}/{r.value}", _tracked(r.value), methods=["POST"]) for r in CallRoute
    ]
    routes.append(Route(f"{PREFIX}/models", tracked_models, methods=["GET"]))
    routes.append(Route("/v1/{path:path}", untracked, methods=["GET", "POST"]))
    return routes
