"""The fleet service: FastAPI over the store.

    uvicorn --factory tunecache.server.app:create_app     # or `tunecache serve`

Routes are thin: each calls the same `Store` method the library uses. Every write needs a
token; reads need one unless anonymous reads are switched on (TUNECACHE_ANONYMOUS_READ=1).
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tunecache import settings
from tunecache.server import audit, best, configs, identity, jobs, system
from tunecache.server.deps import TokenCache, known_query_only
from tunecache.server.gate import TokenGate
from tunecache.server.guards import BodyDeadline, BodyLimit, RateLimits
from tunecache.server.lookups import BatchedReads, LookupCache
from tunecache.server.metrics import Metrics
from tunecache.server.pacing import PublishPacer
from tunecache.server.schemas import ErrorOut
from tunecache.store import Store

MAX_IMPORT_BYTES = 64 << 20

_COMMON = {
    400: {"model": ErrorOut, "description": "the body cannot be read (e.g. not UTF-8)"},
    401: {"model": ErrorOut, "description": "missing, invalid or revoked token"},
    403: {"model": ErrorOut, "description": "the token lacks the scope this route needs"},
    404: {"model": ErrorOut, "description": "no such thing"},
    408: {"model": ErrorOut, "description": "the body was not received in time (TUNECACHE_BODY_TIMEOUT_S)"},
    413: {"model": ErrorOut, "description": "the body is larger than the limit"},
    422: {"model": ErrorOut, "description": "the request is malformed or fails validation"},
    429: {
        "model": ErrorOut,
        "description": "over the request rate of the token or address; the Retry-After "
        "header says after how many seconds to try again",
    },
}


def create_app(
    store_url: str | None = None,
    *,
    anonymous_read: bool | None = None,
    max_body_bytes: int | None = None,
    store: Store | None = None,
) -> FastAPI:
    """The service over the store at `store_url` (default TUNECACHE_DB_URL), migrated to head."""
    from tunecache import __version__

    threads = settings.server_threads()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # routes are sync (the store is): this many run at once, within the DB pool's size
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        address = app.state.metrics_address
        metrics_server = None if address is None else app.state.metrics.serve(app.state.store, *address)
        stop = threading.Event()
        retention = settings.retention_s()
        if retention > 0:
            threading.Thread(
                target=_prune_every, args=(app.state.store, retention, stop), name="tunecache-retention", daemon=True
            ).start()
        yield
        stop.set()
        if metrics_server is not None:
            metrics_server.shutdown()
        app.state.store.close()

    # /docs and /redoc from assets in a package (fastapi-offline), not a CDN: fleets often
    # have no internet
    from fastapi_offline import FastAPIOffline

    app = FastAPIOffline(
        title="tunecache",
        version=__version__,  # from the source: a checkout run from its directory has no metadata
        lifespan=lifespan,
        dependencies=[Depends(known_query_only)],
        description="A fleet-shared autotune cache for Triton/Gluon kernels: look up the best "
        "config for a kernel, device class and shape; publish results; run the "
        "queue of tuning jobs.",
    )
    app.state.store = store or Store(store_url or settings.db_url())
    app.state.metrics = Metrics()
    app.state.tokens = TokenCache(on_query=app.state.metrics.token_checks.inc)
    app.state.rate_limits = RateLimits.from_settings()
    app.state.lookups = LookupCache(settings.lookup_cache_s())
    # what the caches lack, read beside a saturated event loop together (tunecache.server.lookups)
    app.state.reads = BatchedReads(lambda digests: configs.read_answers(app.state.store, app.state.lookups, digests))
    app.state.token_reads = BatchedReads(lambda secrets: app.state.tokens.verify(app.state.store, secrets))
    m = app.state.metrics
    app.state.publish_pacer = PublishPacer(settings.publish_share(), m.publish_seconds.inc, m.publish_held_seconds.inc)
    # /metrics on its own address (`tunecache serve --metrics-port`); the API's route is then off
    app.state.metrics_address = settings.metrics_address()
    app.state.anonymous_read = settings.anonymous_read() if anonymous_read is None else anonymous_read
    limit = max_body_bytes or settings.max_body_bytes()

    app.include_router(configs.router, responses=_COMMON)
    app.include_router(best.router, responses=_COMMON)
    app.include_router(identity.router, responses=_COMMON)
    app.include_router(jobs.router, responses=_COMMON)
    app.include_router(audit.router, responses=_COMMON)
    app.include_router(system.router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for err in errors[:8]:
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = err.get("msg", "invalid")
            if err.get("type") == "json_invalid":
                msg = f"body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
            parts.append(f"{loc}: {msg}" if loc else msg)
        return JSONResponse(
            {"detail": "; ".join(parts) or "invalid request", "errors": [_plain(e) for e in errors[:50]]},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {"detail": str(exc.detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(OperationalError)
    async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse({"detail": "the database is unreachable; try again"}, status_code=503)

    app.add_middleware(BodyLimit, limit=limit, import_limit=max(limit, MAX_IMPORT_BYTES))
    # outside BodyLimit, so that its reading of a chunked body is bounded in time too
    body_s = settings.body_timeout_s()
    app.add_middleware(BodyDeadline, timeout_s=body_s, import_timeout_s=max(body_s, 60.0))
    # outermost: a request with a body is refused on its token before anything reads the body
    app.add_middleware(TokenGate, state=app.state, max_body_bytes=limit)
    return app


# the service prunes at most this often (TUNECACHE_RETENTION_S / 4 when that is shorter)
PRUNE_EVERY_S = 3600.0


def _prune_every(store: Store, retention_s: float, stop: threading.Event) -> None:
    """Retention: trials, submissions and finished jobs older than `retention_s` are deleted
    (Store.prune, as `tunecache db prune`), so that the database's size stays bounded."""
    import logging
    import random

    every = min(PRUNE_EVERY_S, max(1.0, retention_s / 4))
    while not stop.wait(every * random.uniform(0.9, 1.1)):  # replicas do not all prune at once
        try:
            store.prune(retention_s)
        except Exception as e:  # the database away: the next round tries again
            logging.getLogger("tunecache").warning("tunecache: retention prune failed: %s", e)


def _plain(err: dict) -> dict:
    """A validation error as plain JSON (ctx may hold exceptions, input may be anything)."""
    return {
        "loc": [str(x) for x in err.get("loc", ())],
        "msg": str(err.get("msg", "")),
        "type": str(err.get("type", "")),
    }
