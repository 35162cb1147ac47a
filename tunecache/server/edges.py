"""The service's edges: what a connection may cost before the app sees a request.

uvicorn's httptools protocol reads a request's line and headers without a cap (a 64 MiB header
was read whole, 1.7 GB of RSS) and waits for them without a deadline (connections that never
finish their headers stay open for ever). `EdgeProtocol` is that protocol with three bounds:

- headers over TUNECACHE_MAX_HEADER_BYTES (64 KiB) are answered 431 and closed at once;
- headers not in within TUNECACHE_HEADER_TIMEOUT_S (10 s) of the connection's opening, or of
  its previous answer, are answered 408 and closed;
- one client address holds at most TUNECACHE_CONNECTIONS_PER_ADDRESS (256) open connections
  per process; one more is answered 429 and closed.

uvicorn's own `limit_concurrency` (TUNECACHE_MAX_CONNECTIONS, 4096) caps connections and
requests per process (503 past it), and its flow control stops reading a body the app has not
asked for past 64 KiB: with the token checked before a body is read (guards.TokenGate), these
bound what a process holds whoever calls.
"""

from __future__ import annotations

from asyncio import TimerHandle
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tunecache import settings

# open connections per client address, in this process (the event loop's thread only)
_OPEN: Counter[str] = Counter()


def uvicorn_options() -> dict[str, Any]:
    """The keyword arguments `tunecache serve` gives uvicorn.run for these bounds."""
    return dict(
        http="tunecache.server.edges:EdgeProtocol",
        limit_concurrency=settings.max_connections(),
        # used only if uvicorn runs h11 instead (its cap answers 400, not 431)
        h11_max_incomplete_event_size=settings.max_header_bytes(),
    )


def check_settings() -> None:
    """Read every setting of the edges and a token's footprint once: a bad value fails
    `tunecache serve` at start, naming it."""
    settings.max_header_bytes(), settings.header_timeout_s(), settings.connections_per_address()
    settings.max_connections(), settings.bytes_per_day(), settings.trials_per_key(), settings.retention_s()


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded: header size, header time, connections per address."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head = settings.max_header_bytes()
        self.head_timeout_s = settings.header_timeout_s()
        self.per_address = settings.connections_per_address()
        self._address: str | None = None
        self._awaiting_head = True  # no request's headers are being read
        self._head_bytes = 0
        self._head_timer: TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        _OPEN[self._address] += 1
        if _OPEN[self._address] > self.per_address:
            self._refuse(
                429,
                f"this address holds {self.per_address} open connections already (TUNECACHE_CONNECTIONS_PER_ADDRESS)",
                retry_after=1,
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._address is not None:
            _OPEN[self._address] -= 1
            if _OPEN[self._address] <= 0:
                del _OPEN[self._address]
            self._address = None
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._awaiting_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # counted per read (at most 256 KiB each): the parser holds at most one read past the cap
        if self._awaiting_head and self._head_bytes > self.max_head and not self.transport.is_closing():
            self._refuse(
                431, f"the request's line and headers are over {self.max_head} bytes (TUNECACHE_MAX_HEADER_BYTES)"
            )

    def on_headers_complete(self) -> None:
        self._awaiting_head, self._head_bytes = False, 0
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._awaiting_head = True  # what comes next is the next request's (pipelined) head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_head_timer()  # beside uvicorn's keep-alive timer, which data cancels and this does not

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self.transport.is_closing():
            if self._head_bytes:
                self._refuse(
                    408,
                    f"the request's headers were not received within {self.head_timeout_s:g} s "
                    "(TUNECACHE_HEADER_TIMEOUT_S)",
                )
            else:  # an idle connection: nothing was asked, nothing to answer
                self.transport.close()

    def _refuse(self, status: int, detail: str, retry_after: int | None = None) -> None:
        """Answer `status` and close, whatever the request has sent so far."""
        import json

        body = json.dumps({"detail": detail}).encode()
        reason = {408: b"Request Timeout", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large"}
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, reason.get(status, b"Error")),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if retry_after is not None:
            head.append(b"retry-after: %d\r\n" % retry_after)
        self.transport.write(b"".join(head) + b"\r\n" + body)
        self._cancel_head_timer()
        self.transport.close()
