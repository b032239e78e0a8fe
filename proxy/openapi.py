"""The proxy's OpenAPI document: FastAPI's, corrected to what the proxy really answers.

FastAPI knows only its own endpoints and declares 422 for validation errors; the proxy
answers 400 (`proxy.errors`), guards routes with keys and limits, and serves the relayed
routes as plain Starlette routes. This module adds those routes, the error responses
each route can give, in OpenAI's error shape, and the security schemes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy.routes.relayed import PREFIX, UNTRACKED_POST
from shared.types import Route

__all__ = ["install_openapi"]

_ERROR = {"$ref": "#/components/schemas/Error"}
_ID = {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}
_DESCRIPTIONS = {
    "400": "Invalid request (bad id, body or parameters)",
    "401": "Missing or invalid key or token",
    "403": "Key scope does not cover the rollout, or the admin API (or adapter fetching) is disabled",
    "404": "Unknown route, or a path with '.'/'..' segments",
    "405": "Method not allowed (see `Allow`)",
    "409": "Conflict",
    "413": "Request body too large (proxy.limits.max_body_bytes; an adapter: max_adapter_bytes)",
    "429": "Too many calls in flight for this key (Retry-After)",
    "431": "Request headers too large or too many (proxy.limits)",
    "502": "The replica failed mid-response",
    "503": "No replica, database unavailable, admission paused or the proxy is full (Retry-After)",
    "504": "The replica did not answer in time (proxy.limits.call_timeout_s)",
}
_ALWAYS = ("404", "431")  # checked before any routing
_AGENT = ("400", "401", "403", "413", "503")
_ADMIN = ("400", "401", "403", "404", "409", "413", "502", "503", "504")
_ADAPTER = ("400", "401", "403", "404", "503")
_RELAYED = ("400", "401", "403", "413", "429", "502", "503", "504")


def _errors(codes: tuple[str, ...]) -> dict[str, Any]:
    return {code: {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": _ERROR}}}
            for code in sorted({*codes, *_ALWAYS})}


def _relayed_post(summary: str, tracked: bool) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {
            "200": {"description": "The replica's answer, byte for byte (an SSE stream when `stream` is true)",
                    "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(_RELAYED),
            "default": {"description": "The replica's own error, passed through unchanged",
                        "content": {"application/json": {"schema": {}}}},
        },
        "security": [{"AgentKey": []}, {"AgentApiKey": []}],
    }
    if tracked:
        op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": _ID}
                            for n in ("rollout_id", "attempt_id")]
    return op


def _models(tracked: bool) -> dict[str, Any]:
    op = _relayed_post("The model list of a healthy replica", tracked)
    del op["requestBody"]
    op["responses"]["200"]["content"] = {"application/json": {"schema": {"type": "object"}}}
    return op


def _document(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="Rolltap's tracing proxy. Agent keys: `Authorization: Bearer <key>` or "
                                     "`x-api-key: <key>`; admin routes: `Authorization: Bearer <admin token>`.")
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes: tuple[str, ...]
            security: list[dict[str, list[str]]] | None
            if path.startswith("/admin"):
                codes, security = _ADMIN, [{"AdminToken": []}]
            elif path.startswith(("/rollout", "/rollouts")):
                codes, security = _AGENT, [{"AgentKey": []}, {"AgentApiKey": []}]
            elif path.startswith("/adapters/"):
                codes, security = _ADAPTER, [{"AdapterToken": []}, {"AdminToken": []}]
            else:
                codes, security = (("503",) if path == "/readyz" else ()), None
            if path == "/readyz":
                responses["503"] = {"description": "Not ready (database or replicas)",
                                    "content": {"application/json": {"schema": {"type": "object"}}}}
                codes = ()
            responses.update({k: v for k, v in _errors(codes).items() if k not in responses})
            if security:
                op["security"] = security
    paths = schema.setdefault("paths", {})
    for route in Route:
        paths[f"{PREFIX}/{route.value}"] = {"post": _relayed_post(f"Recorded {route.value} call", tracked=True)}
    paths[f"{PREFIX}/models"] = {"get": _models(tracked=True)}
    for untracked in sorted(UNTRACKED_POST):
        paths[f"/v1/{untracked}"] = {"post": _relayed_post(f"Untracked {untracked} call (recorded without an attempt)",
                                                           tracked=False)}
    paths["/v1/models"] = {"get": _models(tracked=False)}
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    }
    components["securitySchemes"] = {
        "AgentKey": {"type": "http", "scheme": "bearer", "description": "An agent key (`rolltap-proxy keys create`)"},
        "AgentApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                        "description": "The same agent key, as the Anthropic SDK sends it"},
        "AdminToken": {"type": "http", "scheme": "bearer", "description": "proxy.admin_token"},
        "AdapterToken": {"type": "http", "scheme": "bearer",
                         "description": "proxy.adapter_token (replicas fetching LoRA adapters)"},
    }
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
