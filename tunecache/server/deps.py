"""Request dependencies: the store, and the caller's token with its scopes."""

from __future__ import annotations

import threading
import time
from typing import Annotated, Any, Callable, Optional

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tunecache.server.guards import client_address
from tunecache.server.metrics import Metrics
from tunecache.store import Store
from tunecache.store.records import TokenRecord, hash_token

bearer = HTTPBearer(auto_error=False, description="a token from `tunecache token create --scope ...`")

# a verified token is trusted this long before the database is asked again (revocation lag)
TOKEN_CACHE_S = 10.0
# an unknown secret is refused this long without asking again (none becomes valid later)
UNKNOWN_TOKEN_CACHE_S = 60.0
TOKEN_CACHE_MAX = 4096

ANONYMOUS = TokenRecord(id=0, name="anonymous", scopes=("read",), created_at=None)  # type: ignore[arg-type]


# Dependencies are `async def` where they need no database: FastAPI runs a plain `def` one on
# the thread pool, and a hop there costs more than a cached lookup itself.


async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


class TokenCache:
    """Verified tokens by hash, so a lookup costs no extra query, and unknown ones (a secret
    never becomes valid later: secrets are made fresh), so a flood of made-up or revoked
    tokens does not reach the database either; entries expire."""

    def __init__(self, on_query: Callable[[int], Any] | None = None) -> None:
        self._known: dict[str, tuple[TokenRecord, float]] = {}
        self._unknown: dict[str, float] = {}
        self._lock = threading.Lock()
        self._on_query = on_query  # counts the tokens asked of the database (a metric)

    def cached(self, secret: str) -> tuple[bool, TokenRecord | None]:
        """(whether the cache knows this secret, its token or None for a known miss)."""
        h = hash_token(secret)
        now = time.monotonic()
        hit = self._known.get(h)
        if hit is not None and hit[1] > now:
            return True, hit[0]
        miss = self._unknown.get(h)
        return (True, None) if miss is not None and miss > now else (False, None)

    def verify(self, store: Store, secrets: list[str]) -> dict[str, TokenRecord | None]:
        """Each secret's live token or None, the ones this cache does not know asked in one query."""
        answers: dict[str, TokenRecord | None] = {}
        ask = []
        for secret in secrets:
            known, rec = self.cached(secret)
            if known:
                answers[secret] = rec
            else:
                ask.append(secret)
        if not ask:
            return answers
        found = store.verify_tokens(ask)
        if self._on_query is not None:
            self._on_query(len(ask))
        with self._lock:
            now = time.monotonic()
            for secret, rec in found.items():
                h = hash_token(secret)
                if rec is None:
                    self._known.pop(h, None)
                    if len(self._unknown) >= TOKEN_CACHE_MAX:
                        self._unknown.clear()
                    self._unknown[h] = now + UNKNOWN_TOKEN_CACHE_S
                else:
                    if len(self._known) >= TOKEN_CACHE_MAX:
                        self._known.clear()
                    until = now + TOKEN_CACHE_S
                    if rec.live_for_s is not None:  # not trusted past its expiry (the database's clock)
                        until = min(until, now + rec.live_for_s)
                    self._known[h] = (rec, until)
        return {**answers, **found}


async def authenticate(request: Request, secret: str) -> TokenRecord:
    """The token with this secret, within the rate limits: 401 unless it is live, 429 when the
    token (from this address) is over its rate. A secret the cache does not know is looked up
    only while the address has budget left, and a lookup that finds nothing spends it (a 429
    once spent); a known miss costs nothing, and is a 401 at once."""
    address = client_address(request)
    token = await live_token(request.app.state, secret, address)
    if token is None:
        raise HTTPException(401, "invalid, expired or revoked token", headers={"WWW-Authenticate": "Bearer"})
    request.app.state.rate_limits.hit_token(token, address)
    return token


async def live_token(state: Any, secret: str, address: str) -> TokenRecord | None:
    """The live token with this secret, or None; asks the database only for a secret the token
    cache does not know, and only while the address has budget left (429 once spent; a lookup
    that finds nothing spends it). The requests that bring one unknown secret at once share
    one query, and those of several are verified by one thread (`state.token_reads`): 1,000
    hosts connecting to a fresh service at once each took a thread of the pool, and the first
    lookups timed out behind them."""
    if len(secret) > 256:
        return None
    known, token = state.tokens.cached(secret)
    if known:
        return token
    state.rate_limits.check_address(address)
    token = await state.token_reads.get(secret)
    if token is None:
        state.rate_limits.hit_address(address)
    return token


def anonymous(request: Request) -> TokenRecord:
    """ANONYMOUS, counted against the caller's address (anonymous reads are on)."""
    request.app.state.rate_limits.hit_address(client_address(request))
    return ANONYMOUS


def require(scope: str) -> Callable[..., TokenRecord]:
    """A dependency that admits a token with `scope` (a scope implies the lesser ones)."""

    async def check(
        request: Request, creds: Annotated[Optional[HTTPAuthorizationCredentials], Depends(bearer)]
    ) -> TokenRecord:
        app = request.app
        if creds is None or not creds.credentials:
            if scope == "read" and app.state.anonymous_read:
                return anonymous(request)
            raise HTTPException(
                401,
                "missing token: send 'Authorization: Bearer <token>' "
                "(create one with `tunecache token create --scope ...`)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        token = await authenticate(request, creds.credentials)
        if not token.allows(scope):
            raise HTTPException(403, f"token {token.name!r} has scopes {list(token.scopes)}; this needs {scope!r}")
        return token

    check.__name__ = f"require_{scope}"
    return check


ReadToken = Annotated[TokenRecord, Depends(require("read"))]
PublishToken = Annotated[TokenRecord, Depends(require("publish"))]
WorkerToken = Annotated[TokenRecord, Depends(require("worker"))]
AdminToken = Annotated[TokenRecord, Depends(require("admin"))]


async def known_query_only(request: Request) -> None:
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
        raise HTTPException(
            422, f"unknown query parameter(s) {shown}; this route takes {', '.join(sorted(known)) or 'none'}"
        )


def _query_names(dependant) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names
