"""The web dashboard's routes (`/ui`): closed unless the caller holds the admin token or a read key.

A read key is an unscoped agent key (it may read every rollout, as on GET attempt); with
`proxy.open_access` the dashboard is open like the other read routes. A browser signs in
once at `/ui/login`: the token goes into an HttpOnly, same-site cookie scoped to `/ui`.
Scripts may send `Authorization: Bearer <token>` instead.
"""

from __future__ import annotations

import hmac
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from proxy import dashboard, store, ui
from proxy.routes.ids import check_id
from shared.errors import Forbidden, RolltapError, Unauthorized

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

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
    return _html(ui.login_html())


@router.post("/login")
async def login(request: Request) -> Response:
    # A urlencoded form, read by hand: no multipart parser needed for one field.
    token = (parse_qs((await request.body()).decode("utf-8", "replace")).get("token") or [""])[0].strip()
    if not await _may_read(request, token or None) or not token:
        return _html(ui.login_html("That is neither the admin token nor an unscoped agent key."), 401)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/ui",
                        secure=request.url.scheme == "https")
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in _STATIC_FILES:
        return Response(status_code=404)
    return FileResponse(_STATIC / name, media_type=_STATIC_FILES[name], headers={"cache-control": "max-age=300"})


def _number(value: str | None, kind: type[int] | type[float]) -> int | float | None:
    try:
        return kind(value) if value not in (None, "") else None
    except ValueError:
        return None


def _when(value: str | None) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(value) if value else None
    except ValueError:
        return None
    return parsed.replace(tzinfo=UTC) if parsed is not None and parsed.tzinfo is None else parsed


@router.get("")
async def attempts(request: Request) -> Response:
    if not await _may_read(request, _token(request)):
        return _denied()
    q = request.query_params
    filters = dashboard.AttemptFilter(
        status=q.get("status") or None, group=q.get("group") or None, version=_number(q.get("version"), int),  # type: ignore[arg-type]
        reward_min=_number(q.get("reward_min"), float), reward_max=_number(q.get("reward_max"), float),
        since=_when(q.get("since")), until=_when(q.get("until")), before=_number(q.get("before"), int),  # type: ignore[arg-type]
    )
    started = time.perf_counter()
    async with request.app.state.reader.connect() as conn:
        page = await dashboard.attempt_page(conn, filters)
    elapsed_ms = (time.perf_counter() - started) * 1000
    shown = {k: q.get(k, "") for k in ("status", "group", "version", "reward_min", "reward_max", "since", "until")}
    return _html(ui.list_html(page.rows, shown, page.next_before, elapsed_ms))


@router.get("/attempt/{rollout_id}/{attempt_id}")
async def attempt(request: Request, rollout_id: str, attempt_id: str) -> Response:
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
    if not await _may_read(request, _token(request)):
        return _denied()
    async with request.app.state.reader.connect() as conn:
        curves = await dashboard.version_curves(conn)
    return _html(ui.charts_html(curves, request.app.state.balancer.replicas))
