"""Limits on what one client may consume: requests per second (429 with Retry-After) and the
time it may take to send a request's body (408).

Rates are counted by the `limits` package in a moving window: a token may send BURST requests
in any BURST/RATE seconds from one client address (so one busy host cannot starve the others
that share its token, and a fleet that shares one token is not limited as a whole), and an
address has a budget of its own for what costs the database without a valid token: anonymous
reads, /healthz, /metrics, and secrets looked up and not found (a known miss is free: the
token cache answers it).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request

from tunecache.store.records import TokenRecord


@dataclass(frozen=True)
class Rate:
    """`amount` requests in any `window_s` seconds."""

    amount: int
    window_s: int

    @classmethod
    def of(cls, per_second: float, burst: int) -> "Rate | None":
        """BURST requests in BURST/RATE seconds (rounded up to whole seconds, the window's
        unit), the average kept at RATE; None when RATE is 0 (no limit)."""
        if per_second <= 0:
            return None
        window = max(1, math.ceil(burst / per_second))
        return cls(max(burst, math.ceil(per_second * window)), window)

    def __str__(self) -> str:
        return f"{self.amount} requests per {self.window_s} s"


SYNC_RATE = Rate(6, 60)


class RateLimits:
    """The service's request rates, per (token, client address) and per address without a token."""

    def __init__(
        self,
        per_token: Rate | None,
        per_address: Rate | None,
        storage_uri: str = "memory://",
        bytes_per_day: int = 0,
    ) -> None:
        from limits import RateLimitItemPerDay, RateLimitItemPerSecond, storage, strategies

        self.per_token, self.per_address, self.bytes_per_day = per_token, per_address, bytes_per_day
        backend = storage.storage_from_string(storage_uri)
        self._limiter = strategies.MovingWindowRateLimiter(backend)
        # bodies are counted by a sliding window of two counters (a moving window keeps one
        # entry per unit of cost: one per byte)
        self._bytes_limiter = strategies.SlidingWindowCounterRateLimiter(backend)
        self._bytes_item = RateLimitItemPerDay(bytes_per_day, 1, "tc-bytes") if bytes_per_day > 0 else None
        self._token_item = per_token and RateLimitItemPerSecond(per_token.amount, per_token.window_s, "tc-token")
        self._address_item = per_address and RateLimitItemPerSecond(per_address.amount, per_address.window_s, "tc-addr")
        # a sync answers up to 64 MiB: a job start's worth per host, not a stream
        self._sync_item = per_token and RateLimitItemPerSecond(SYNC_RATE.amount, SYNC_RATE.window_s, "tc-sync")

    @classmethod
    def from_settings(cls) -> "RateLimits":
        from tunecache import settings

        return cls(
            Rate.of(*settings.rate_limit()),
            Rate.of(*settings.anon_rate_limit()),
            settings.rate_limit_storage(),
            settings.bytes_per_day(),
        )

    def hit_token(self, token: TokenRecord, address: str) -> None:
        """Count one request of this token from this address; 429 when over its rate."""
        if self._token_item is not None and not self._limiter.hit(self._token_item, str(token.id), address):
            raise self._too_many(
                self._token_item,
                (str(token.id), address),
                f"token {token.name!r} may send {self.per_token} from one address "
                f"(TUNECACHE_RATE_LIMIT, TUNECACHE_RATE_BURST)",
            )

    def hit_bytes(self, token: TokenRecord, address: str, size: int) -> None:
        """Count a body of `size` bytes that this token sends from this address; 429 when it
        would take the pair past TUNECACHE_BYTES_PER_DAY (then nothing is counted)."""
        if self._bytes_item is None or size <= 0:
            return
        if not self._bytes_limiter.hit(self._bytes_item, str(token.id), address, cost=size):
            stats = self._bytes_limiter.get_window_stats(self._bytes_item, str(token.id), address)
            retry = max(1, math.ceil(stats.reset_time - time.time()))
            raise HTTPException(
                429,
                f"too many bytes: token {token.name!r} may send {self.bytes_per_day} bytes of request bodies "
                f"from one address in any 24 h (TUNECACHE_BYTES_PER_DAY), {stats.remaining} left; "
                f"retry after {retry} s",
                headers={"Retry-After": str(retry)},
            )

    def hit_sync(self, token: TokenRecord, address: str) -> None:
        """Count one `POST /v1/sync` of this token from this address (SYNC_RATE; off with the
        per-token limit); 429 when over."""
        if self._sync_item is not None and not self._limiter.hit(self._sync_item, str(token.id), address):
            raise self._too_many(
                self._sync_item,
                (str(token.id), address),
                f"a token may sync {SYNC_RATE} from one address (a sync is for a job's start)",
            )

    def hit_address(self, address: str) -> None:
        """Count one request without a valid token from this address; 429 when over its rate."""
        if self._address_item is not None and not self._limiter.hit(self._address_item, address):
            raise self._too_many(self._address_item, (address,), self._address_words())

    def check_address(self, address: str) -> None:
        """429 if this address has no budget left, counting nothing: asked before a token the
        cache does not know is looked up in the database."""
        if self._address_item is not None and not self._limiter.test(self._address_item, address):
            raise self._too_many(self._address_item, (address,), self._address_words())

    def _address_words(self) -> str:
        return (
            f"an address may send {self.per_address} without a valid token "
            f"(TUNECACHE_ANON_RATE_LIMIT, TUNECACHE_ANON_RATE_BURST)"
        )

    def _too_many(self, item: Any, keys: tuple[str, ...], why: str) -> HTTPException:
        reset = self._limiter.get_window_stats(item, *keys).reset_time
        retry = max(1, math.ceil(reset - time.time()))
        return HTTPException(
            429, f"too many requests: {why}; retry after {retry} s", headers={"Retry-After": str(retry)}
        )


def client_address(request: Request) -> str:
    """The caller's address (behind a proxy, uvicorn's --forwarded-allow-ips makes it the client's)."""
    return request.client.host if request.client is not None else "unknown"


def rate_limited_address(request: Request) -> None:
    """A dependency for routes without a token that still cost a query (/healthz, /metrics)."""
    request.app.state.rate_limits.hit_address(client_address(request))


def large_body(path: str) -> bool:
    """Routes whose bodies may be large: an import, a winner's compiled kernels."""
    return path == "/v1/import" or (path.startswith("/v1/configs/") and path.endswith("/binaries"))


class _BodyGuard:
    """An ASGI middleware that bounds a request's body, if it has one (not GET, HEAD, OPTIONS
    or DELETE): by `bound`, or `large_bound` on the routes whose bodies may be large."""

    def __init__(self, app: Any, bound: float, large_bound: float) -> None:
        self.app, self.bound, self.large_bound = app, bound, large_bound

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        await self.guard(scope, receive, send, self.large_bound if large_body(scope["path"]) else self.bound)

    async def guard(self, scope, receive, send, bound) -> None:
        raise NotImplementedError


class BodyDeadline(_BodyGuard):
    """408 for a request whose body is not all received within `timeout_s` of its start.

    uvicorn bounds the size of headers and the idle time between requests, not the time a
    client takes to send a body: without this, connections that stall mid-body hold the
    service's sockets and tasks for as long as they like, tokens or no tokens. The receive
    channel is wrapped, so every reader of the body (BodyLimit, FastAPI) is bounded, and
    nothing is buffered here."""

    def __init__(self, app: Any, timeout_s: float, import_timeout_s: float) -> None:
        super().__init__(app, timeout_s, import_timeout_s)

    async def guard(self, scope, receive, send, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        received = timed_out = started = False

        async def timed_receive():
            nonlocal received, timed_out
            if received or timed_out:  # the body is in: what is left to hear is a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                timed_out = True
                if not started:
                    await _reply(
                        send, 408, f"the request body was not received within {timeout:g} s (TUNECACHE_BODY_TIMEOUT_S)"
                    )
                return {"type": "http.disconnect"}  # the app stops reading, and its answer is dropped
            if message["type"] != "http.request" or not message.get("more_body", False):
                received = True
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if timed_out:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not timed_out:  # after a 408, whatever the app made of the cut-off body is moot
                raise


class BodyLimit(_BodyGuard):
    """413 for a body over the limit, whether it says its length or is chunked."""

    def __init__(self, app: Any, limit: int, import_limit: int) -> None:
        super().__init__(app, limit, import_limit)

    async def guard(self, scope, receive, send, limit: int) -> None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _reply(send, 400, "Content-Length is not a number")
                return
            if int(length) > limit:
                await _reply(send, 413, f"body of {int(length)} bytes is over the limit of {limit}")
                return
            await self.app(scope, receive, send)
            return
        # no length given (chunked): read it here, within the limit, then hand it on
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, f"body is over the limit of {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
