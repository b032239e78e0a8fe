"""The web dashboard's routes (`/ui`): closed unless the caller holds the admin token or a read key.

A read key is an unscoped agent key (it may read every rollout, as on GET attempt); with
`proxy.open_access` the dashboard is open like the other read routes. A browser signs in
once at `/ui/login`: the token goes into an HttpOnly, SameSite=Strict cookie scoped to `/ui`
(Secure when the client came over HTTPS, see `proxy.forwarded`); a sign-in posted from another
site is refused. Scripts may send `Authorization: Bearer <token>` instead.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import QueryParams

from proxy import dashboard, forwarded, store, ui
from proxy.routes.ids import check_id
from shared.errors import Forbidden, InvalidRequest, RolltapError, Unauthorized

__all__ = ["router"]


class _DashboardRoute(APIRoute):
    """A dashboard route; a state-changing one (any method but GET and HEAD) first refuses, with a 403
    page, a request that another site's page made (a forged sign-in, or any later form)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method not in ("GET", "HEAD") and not forwarded.is_same_origin_post(
                    request, request.app.state.settings.proxy.trusted_proxies):
                return _html(ui.error_html(403, "Refused: this form was posted from another site."), 403)
            return await handler(request)

        return checked


router = APIRouter(prefix="/ui", include_in_schema=False, route_class=_DashboardRoute)

COOKIE = "rolltap_ui"
_STATIC = Path(__file__).resolve().parent.parent / "static"
_STATIC_FILES = {"ui.css": "text/css", "ui.js": "text/javascript"}


def _token(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


async def _may_read(request: Request, token: str | None) -> bool:
    state = request.app.state
    admin = state.settings.proxy.admin_token
    if token and admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return True
    if state.keys.is_open:
        return True
    if not token:
        return False
    try:
        await state.keys.authenticate([(b"authorization", b"Bearer " + token.encode("latin-1", "replace"))], None)
    except (Unauthorized, Forbidden):  # unknown, revoked, or scoped to some rollouts only
        return False
    return True


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers={"cache-control": "no-store",
                                                           "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'"})


def _denied() -> HTMLResponse:
    return _html(ui.login_html(), 401)


@router.get("/login")
async def login_form() -> HTMLResponse:
    """The dashboard's sign-in form."""
    return _html(ui.login_html())


@router.post("/login")
async def login(request: Request) -> Response:
    """Sign in with the admin token or a read key; sets the session cookie."""
    # A urlencoded form, read by hand: no multipart parser needed for one field.
    token = (parse_qs((await request.body()).decode("utf-8", "replace")).get("token") or [""])[0].strip()
    if not await _may_read(request, token or None) or not token:
        return _html(ui.login_html("That is neither the admin token nor an unscoped agent key."), 401)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/ui",
                        secure=forwarded.is_https(request, request.app.state.settings.proxy.trusted_proxies))
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    """The dashboard's static files (a fixed list)."""
    if name not in _STATIC_FILES:
        return Response(status_code=404)
    return FileResponse(_STATIC / name, media_type=_STATIC_FILES[name], headers={"cache-control": "max-age=300"})


# The columns the numeric filters are compared with: a value past their type is no attempt's,
# and the drivers refuse to bind it (SQLite: past 64 bits; PostgreSQL: past the column's type).
_VERSION_MAX = 2**31 - 1  # attempts.policy_version: INTEGER
_ID_MAX = 2**63 - 1  # attempts.id, the `before` cursor: BIGINT


def _bad(name: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"filter {name}: {why}", param=name, code="invalid_filter")


def _whole(value: str | None, name: str, low: int, high: int) -> int | None:
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:  # also past int()'s 4300 digits
        raise _bad(name, f"{value[:40]!r} is not a whole number") from None
    if not low <= number <= high:
        raise _bad(name, f"must be between {low} and {high}")
    return number


def _finite(value: str | None, name: str) -> float | None:
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise _bad(name, f"{value[:40]!r} is not a number") from None
    if not math.isfinite(number):  # nan, inf, and 1e999 (which float() reads as inf)
        raise _bad(name, "must be a finite number")
    return number


def _when(value: str | None, name: str) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
        # A time without an offset is UTC (the form says so); one with an offset is compared in UTC,
        # which fails for the first and last hours of datetime's range (years 1 and 9999).
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        raise _bad(name, f"{value[:40]!r} is not an ISO 8601 date and time in years 1 to 9999") from None


def _filters(q: QueryParams) -> dashboard.AttemptFilter:
    status = q.get("status") or None
    if status is not None and status not in ui.STATUSES:
        raise _bad("status", f"must be one of {', '.join(ui.STATUSES)}")
    group = q.get("group") or None
    return dashboard.AttemptFilter(
        status=status, group=check_id(group, "group") if group is not None else None,
        version=_whole(q.get("version"), "version", 0, _VERSION_MAX),
        reward_min=_finite(q.get("reward_min"), "reward_min"), reward_max=_finite(q.get("reward_max"), "reward_max"),
        since=_when(q.get("since"), "since"), until=_when(q.get("until"), "until"),
        before=_whole(q.get("before"), "before", 1, _ID_MAX),
    )


@router.get("")
async def attempts(request: Request) -> Response:
    """The dashboard's attempt list: filters, newest first, keyset-paginated."""
    if not await _may_read(request, _token(request)):
        return _denied()
    q = request.query_params
    try:
        filters = _filters(q)
    except InvalidRequest as exc:  # a page, as for a bad id on the attempt page
        return _html(ui.error_html(exc.status_code, exc.message), exc.status_code)
    started = time.perf_counter()
    async with request.app.state.reader.connect() as conn:
        page = await dashboard.attempt_page(conn, filters)
    elapsed_ms = (time.perf_counter() - started) * 1000
    shown = {k: q.get(k, "") for k in ("status", "group", "version", "reward_min", "reward_max", "since", "until")}
    return _html(ui.list_html(page.rows, shown, page.next_before, elapsed_ms))


@router.get("/attempt/{rollout_id}/{attempt_id}")
async def attempt(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """One attempt on the dashboard: its calls, rewards and drops."""
    if not await _may_read(request, _token(request)):
        return _denied()
    try:
        check_id(rollout_id, "rollout_id")
        check_id(attempt_id, "attempt_id")
        async with request.app.state.reader.connect() as conn:
            recorded = await store.read_attempt(conn, rollout_id, attempt_id)
            drops = await dashboard.call_drops(conn, rollout_id, attempt_id)
    except RolltapError as exc:
        return _html(ui.error_html(exc.status_code, exc.message), exc.status_code)
    return _html(ui.attempt_html(recorded, drops))


@router.get("/charts")
async def charts(request: Request) -> Response:
    """Per-version training curves: reward, calls left out, staleness."""
    if not await _may_read(request, _token(request)):
        return _denied()
    async with request.app.state.reader.connect() as conn:
        curves = await dashboard.version_curves(conn)
    return _html(ui.charts_html(curves, request.app.state.balancer.replicas))
