"""/healthz, /metrics and the dashboard page (who may see it; dashboard.py draws it)."""

from __future__ import annotations

import html

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.exc import SQLAlchemyError

from tunecache.server.deps import MetricsDep, StoreDep, anonymous, authenticate
from tunecache.server.guards import rate_limited_address
from tunecache.server.schemas import ErrorOut, HealthOut
from tunecache.store import TokenRecord

router = APIRouter(tags=["system"])

TOO_MANY = {429: {"model": ErrorOut, "description": "over the address's request rate (see Retry-After)"}}


@router.get(
    "/healthz",
    response_model=HealthOut,
    summary="Liveness and database reachability",
    dependencies=[Depends(rate_limited_address)],
    responses={503: {"model": ErrorOut, "description": "the database is unreachable"}, **TOO_MANY},
)
def healthz(store: StoreDep) -> HealthOut:
    from tunecache import settings
    from tunecache.server.schemas import QueueHealthOut
    from tunecache.store.migrate import current_revision

    try:
        rev = current_revision(store.engine)
        # the queue's facts: a stuck queue is news for operators, not a reason to pull the
        # service out of a load balancer (the status stays 200)
        _, waits = store.queue_waits()
        quarantined = store.job_counts()["quarantined"]
    except SQLAlchemyError as e:
        raise HTTPException(503, f"database unreachable: {type(e).__name__}") from None
    after = settings.queue_stuck_s()
    queue = [
        QueueHealthOut(**w.__dict__, stuck=w.waiting > 0 and w.running == 0 and w.oldest_wait_s > after) for w in waits
    ]
    return HealthOut(
        status="ok",
        database=store.dialect,
        schema_revision=rev,
        stuck_after_s=after,
        queue_stuck=any(q.stuck for q in queue),
        quarantined_jobs=quarantined,
        queue=queue,
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    description="Off (404) when the service serves its metrics on an address of their own "
    "(`tunecache serve --metrics-port`).",
    dependencies=[Depends(rate_limited_address)],
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        404: {"model": ErrorOut, "description": "metrics are served on their own port"},
        **TOO_MANY,
    },
)
def metrics(request: Request, store: StoreDep, m: MetricsDep) -> Response:
    if request.app.state.metrics_address is not None:
        raise HTTPException(
            404, "metrics are served on their own port (tunecache serve --metrics-port), not on the API's"
        )
    return Response(m.render(store), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- who may see the dashboard: a token, as for every read, or anonymous reads ----------------
# A browser cannot send an Authorization header by itself: a small form posts the token once,
# and the page then reads it from an HttpOnly, SameSite=Strict cookie. Only the dashboard reads
# that cookie (never the API, so no API route can be driven by another site through it).

DASHBOARD_COOKIE = "tunecache_token"
DASHBOARD_COOKIE_S = 12 * 3600
# never framed (clickjacking), never kept by a proxy or the browser's cache
_PAGE_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}

_LOGIN = """<!doctype html>
<html><head><meta charset="utf-8"><title>tunecache fleet</title>
<style>body {{ font: 14px system-ui, sans-serif; margin: 2em; color: #222 }} input {{ width: 36em }}
.err {{ color: #b00 }}</style></head><body>
<h1>tunecache fleet</h1>
<p>The dashboard needs a token; a <code>read</code> token is enough
(<code>tunecache token create --scope read --name dashboard</code>).</p>{error}
<form method="post" action="/login"><input type="password" name="token" placeholder="tc_..." required
 autocomplete="current-password"> <button type="submit">show the dashboard</button></form>
</body></html>
"""


def _login_page(error: str = "", *, forget: bool = False) -> HTMLResponse:
    page = HTMLResponse(
        _LOGIN.format(error=f'\n<p class="err">{html.escape(error)}</p>' if error else ""),
        status_code=401,
        headers=_PAGE_HEADERS,
    )
    if forget:
        page.delete_cookie(DASHBOARD_COOKIE, path="/")
    return page


def _dashboard_caller(request: Request) -> TokenRecord | None:
    """The token in the Authorization header or the dashboard's cookie (401 if it is not
    live), ANONYMOUS when none is sent and anonymous reads are on, else None."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    secret = secret.strip() if scheme.lower() == "bearer" else ""
    secret = secret or request.cookies.get(DASHBOARD_COOKIE, "").strip()
    if secret:  # the dashboard's route runs on the thread pool
        import anyio.from_thread

        return anyio.from_thread.run(authenticate, request, secret)
    return anonymous(request) if request.app.state.anonymous_read else None


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard(request: Request, store: StoreDep, m: MetricsDep) -> HTMLResponse:
    try:
        caller = _dashboard_caller(request)
    except HTTPException as exc:
        if exc.status_code != 401:
            raise
        return _login_page("That token is invalid, expired or revoked.", forget=True)
    if caller is None:
        return _login_page()
    from tunecache.server.dashboard import render_page

    return HTMLResponse(render_page(store, m), headers=_PAGE_HEADERS)


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    from urllib.parse import parse_qs

    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    secret = (form.get("token") or [""])[0].strip()
    if not secret:
        return _login_page("Paste a token.")
    try:
        await authenticate(request, secret)
    except HTTPException as exc:
        if exc.status_code != 401:
            raise
        return _login_page("That token is invalid, expired or revoked.")
    page = RedirectResponse("/", status_code=303, headers=_PAGE_HEADERS)
    page.set_cookie(
        DASHBOARD_COOKIE,
        secret,
        max_age=DASHBOARD_COOKIE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return page


@router.post("/logout", include_in_schema=False)
def logout() -> Response:
    page = RedirectResponse("/", status_code=303, headers=_PAGE_HEADERS)
    page.delete_cookie(DASHBOARD_COOKIE, path="/")
    return page
