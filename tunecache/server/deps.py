"""Request dependencies: the store, and the caller's token with its scopes."""

from __future__ import annotations

import threading
import time
from typing import Annotated, Callable, Optional

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..store import Store, TokenRecord, hash_token
from .metrics import Metrics

bearer = HTTPBearer(auto_error=False, description="a token from `tunecache token create --scope ...`")

# a verified token is trusted this long before the database is asked again (revocation lag)
TOKEN_CACHE_S = 10.0
TOKEN_CACHE_MAX = 4096

ANONYMOUS = TokenRecord(id=0, name="anonymous", scopes=("read",), created_at=None)  # type: ignore[arg-type]


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


class TokenCache:
    """Verified tokens by hash, so a lookup costs no extra query; entries expire."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[TokenRecord, float]] = {}
        self._lock = threading.Lock()

    def verify(self, store: Store, secret: str) -> TokenRecord | None:
        h = hash_token(secret)
        now = time.monotonic()
        hit = self._entries.get(h)
        if hit is not None and hit[1] > now:
            return hit[0]
        rec = store.verify_token(secret)
        with self._lock:
            if rec is None:
                self._entries.pop(h, None)
            else:
                if len(self._entries) >= TOKEN_CACHE_MAX:
                    self._entries.clear()
                self._entries[h] = (rec, now + TOKEN_CACHE_S)
        return rec


def require(scope: str) -> Callable[..., TokenRecord]:
    """A dependency that admits a token with `scope` (a scope implies the lesser ones)."""

    def check(request: Request,
              creds: Annotated[Optional[HTTPAuthorizationCredentials], Depends(bearer)]) -> TokenRecord:
        app = request.app
        if creds is None or not creds.credentials:
            if scope == "read" and app.state.anonymous_read:
                return ANONYMOUS
            raise HTTPException(401, "missing token: send 'Authorization: Bearer <token>' "
                                     "(create one with `tunecache token create --scope ...`)",
                                headers={"WWW-Authenticate": "Bearer"})
        if len(creds.credentials) > 256:
            raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
        token = app.state.tokens.verify(app.state.store, creds.credentials)
        if token is None:
            raise HTTPException(401, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"})
        if not token.allows(scope):
            raise HTTPException(403, f"token {token.name!r} has scopes {list(token.scopes)}; "
                                     f"this needs {scope!r}")
        return token

    check.__name__ = f"require_{scope}"
    return check


ReadToken = Annotated[TokenRecord, Depends(require("read"))]
PublishToken = Annotated[TokenRecord, Depends(require("publish"))]
WorkerToken = Annotated[TokenRecord, Depends(require("worker"))]
AdminToken = Annotated[TokenRecord, Depends(require("admin"))]


def known_query_only(request: Request) -> None:
    """422 for a query parameter the route does not take: a misspelt filter must not quietly
    answer as if there were none (`?kernal=matmul.hopper` listing every kernel)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not request.query_params:
        return
    known = _query_names(dependant)
    unknown = sorted({k for k in request.query_params if k not in known})
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:5])
        raise HTTPException(422, f"unknown query parameter(s) {shown}; this route takes "
                                 f"{', '.join(sorted(known)) or 'none'}")


def _query_names(dependant) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names
