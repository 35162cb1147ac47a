"""The token of a request with a body is checked before its body is read.

FastAPI reads and parses a body before it solves a route's dependencies, the token among them:
an unauthenticated 60 MiB `POST /v1/import` was read whole (27 s, 1.9 GB of RSS) to be
answered 401. `TokenGate` answers from the headers alone, before the app (and BodyLimit,
BodyDeadline) read a byte of the body: 401 without a live token (unless anonymous reads are
on and the route only reads), 403 for a large-body route the token may not use, 429 past the
token's bytes per day (TUNECACHE_BYTES_PER_DAY, per token and client address, for the routes
that write: reads are not counted, nor admins, who import). Its answers close the connection,
so the unread body is never read.

The route's own dependency checks the token again, from the token cache (no query), and
counts its request rate.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from tunecache.server.deps import live_token
from tunecache.server.guards import _reply, large_body

BODY_METHODS = ("POST", "PUT", "PATCH")
# routes with a body that a read token may call (and, with anonymous reads on, no token)
READ_BODIES = ("/v1/lookup", "/v1/sync", "/v1/jobs/statuses")
MISSING = "missing token: send 'Authorization: Bearer <token>' (create one with `tunecache token create --scope ...`)"
INVALID = "invalid, expired or revoked token"


def _large_body_scope(path: str) -> str | None:
    """The scope a large-body route needs (its body may be 64 MiB: refused before it is read)."""
    if not large_body(path):
        return None
    return "admin" if path == "/v1/import" else "worker"


class TokenGate:
    """401 / 403 / 429 for a /v1 request with a body, from its headers alone."""

    def __init__(self, app: Any, state: Any, max_body_bytes: int) -> None:
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        scheme, _, secret = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            if self.state.anonymous_read and path in READ_BODIES:
                await self.app(scope, receive, send)
                return
            await _reply(send, 401, MISSING, {"WWW-Authenticate": "Bearer"})
            return
        client = scope.get("client")
        address = client[0] if client else "unknown"
        try:
            token = await live_token(self.state, secret, address)
            if token is None:
                await _reply(send, 401, INVALID, {"WWW-Authenticate": "Bearer"})
                return
            need = _large_body_scope(path)
            if need is not None and not token.allows(need):
                await _reply(send, 403, f"token {token.name!r} has scopes {list(token.scopes)}; this needs {need!r}")
                return
            if not token.allows("admin") and path not in READ_BODIES:
                length = headers.get(b"content-length", b"")
                size = int(length) if length.isdigit() else self.max_body_bytes  # chunked: the most it may be
                self.state.rate_limits.hit_bytes(token, address, size)
        except HTTPException as e:  # 429: the address's budget for unknown tokens, or the token's bytes
            await _reply(send, e.status_code, str(e.detail), e.headers)
            return
        await self.app(scope, receive, send)
