"""The service's edges refuse before they pay (issue 41): each probe against a real `tunecache
serve` on Postgres, with the figure it checks in its name.

- headers over 64 KiB: 431 at once, the rest never read;
- a body whose token is missing or wrong: 401 in under 100 ms, the body not read (RSS flat),
  for 60 MiB sent to `POST /v1/import` and to the publish routes;
- headers that never end: closed after the header timeout (10 s by default; 2 s here);
- one address holds at most its cap of open connections (32 here), others are served;
- the service's RSS stays under 512 MiB through all of it.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from support.fleet import pg_service

pytestmark = pytest.mark.postgres

PER_ADDRESS = 32
HEADER_TIMEOUT_S = 2.0
RSS_BOUND_MIB = 512
EDGES = {"TUNECACHE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "TUNECACHE_CONNECTIONS_PER_ADDRESS": str(PER_ADDRESS)}

svc = pg_service("edges", EDGES)


def rss_mib(server, field: str = "VmRSS") -> float:
    """The service process's resident memory (VmHWM: its peak since it started), MiB."""
    for line in open(f"/proc/{server.proc.pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {server.proc.pid}")


def connect(server, source: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout, source_address=(source, 0))
    return sock


def read_answer(sock: socket.socket, limit_s: float) -> bytes:
    """What the service answers until it closes the connection or `limit_s` passes."""
    out, end = b"", time.monotonic() + limit_s
    while time.monotonic() < end:
        sock.settimeout(max(end - time.monotonic(), 0.01))
        try:
            data = sock.recv(65536)
        except socket.timeout:
            break
        except OSError:  # reset after the service closed
            break
        if not data:
            break
        out += data
        if b"\r\n\r\n" in out and b"content-length" in out.lower():
            head, _, body = out.partition(b"\r\n\r\n")
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            if len(body) >= length:
                break
    return out


def status_of(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def lookup_ok(server) -> bool:
    r = httpx.get(
        f"{server.url}/v1/configs/{'0' * 64}",
        headers={"Authorization": f"Bearer {server.tokens['read']}"},
        timeout=5,
    )
    return r.status_code == 404


def test_headers_over_64_kib_are_answered_431_at_once(svc):
    before = rss_mib(svc)
    sock = connect(svc)
    start = time.monotonic()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    try:
        while sent < 8 << 20:  # 8 MiB of one header: the service must stop it long before
            sock.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass  # closed on us: what we want
    answer = read_answer(sock, 5)
    took = time.monotonic() - start
    sock.close()
    assert status_of(answer) == 431, f"a header of {sent} bytes (cap 64 KiB) was answered {answer[:200]!r}"
    assert took < 2, f"431 took {took:.2f} s"
    # a request just under the cap is served
    r = httpx.get(f"{svc.url}/healthz", headers={"X-Pad": "a" * 60_000}, timeout=5)
    assert r.status_code == 200, r.text
    # what the client sent includes the sockets' buffers (megabytes on loopback): RSS says what was read
    assert rss_mib(svc) - before < 32, f"RSS grew {rss_mib(svc) - before:.0f} MiB for {sent} bytes of a refused header"


@pytest.mark.parametrize(
    "method,path,token",
    [
        ("POST", "/v1/import", None),
        ("POST", "/v1/import", "tc_made-up"),
        ("POST", "/v1/import", "publish"),  # a live token without the admin scope: 403
        ("POST", "/v1/configs", None),
        ("POST", "/v1/configs", "tc_made-up"),
        ("POST", f"/v1/configs/{'a' * 64}/reports", None),
        ("PUT", f"/v1/configs/{'a' * 64}/binaries", "read"),
    ],
)
def test_a_60_mib_body_with_no_valid_token_is_refused_in_under_100_ms_unread(svc, method, path, token):
    peak_before = rss_mib(svc, "VmHWM")
    secret = svc.tokens.get(token, token)
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {60 << 20}\r\n"
    if secret:
        head += f"Authorization: Bearer {secret}\r\n"
    sock = connect(svc)
    sock.sendall(head.encode() + b"\r\n" + b"[" * 65536)
    start = time.monotonic()
    stop = threading.Event()

    def push():  # keep sending the rest of the 60 MiB while the answer comes
        try:
            for _ in range(60 * 16 - 1):
                if stop.is_set():
                    return
                sock.sendall(b"[" * 65536)
        except OSError:
            pass

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    answer = read_answer(sock, 5)
    took = time.monotonic() - start
    stop.set()
    sock.close()
    pusher.join(5)
    expected = 403 if token in ("publish", "read") else 401
    assert status_of(answer) == expected, f"{method} {path}: {answer[:300]!r}"
    assert took < 0.1, f"{method} {path} with a 60 MiB body: {expected} after {took * 1000:.0f} ms (bound 100 ms)"
    grown = rss_mib(svc, "VmHWM") - peak_before
    assert grown < 16, f"the service's peak RSS grew {grown:.0f} MiB for a refused 60 MiB body"
    assert lookup_ok(svc)


def test_headers_never_finished_are_closed_within_the_header_timeout(svc):
    from tunecache import settings

    assert settings.HEADER_TIMEOUT_S <= 10, "the default header timeout is over 10 s"
    socks = []
    for _ in range(3 * PER_ADDRESS // 4):  # under the per-address cap: the header timeout closes them
        s = connect(svc, source="127.0.0.3")
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends
        socks.append(s)
    idle = [connect(svc, source="127.0.0.3") for _ in range(4)]  # never sends a byte
    start = time.monotonic()
    assert lookup_ok(svc), "a lookup failed while incomplete requests were open"
    answers = [read_answer(s, HEADER_TIMEOUT_S + 3) for s in socks + idle]
    took = time.monotonic() - start
    for s in socks + idle:
        s.close()
    timed_out = [status_of(a) for a in answers[: len(socks)]]
    assert timed_out == [408] * len(socks), f"answers to unfinished headers: {set(timed_out)}"
    assert all(a == b"" for a in answers[len(socks) :]), "an idle connection got an answer"
    assert took < HEADER_TIMEOUT_S + 2, f"closed after {took:.1f} s (header timeout {HEADER_TIMEOUT_S} s)"


def test_one_address_holds_at_most_32_connections_and_others_are_served(svc):
    socks, refused = [], 0
    try:
        for _ in range(PER_ADDRESS + 16):
            s = connect(svc, source="127.0.0.2")
            socks.append(s)
        time.sleep(0.3)
        for s in socks:
            s.setblocking(False)
            try:
                data = s.recv(65536)
                refused += data.startswith(b"HTTP/1.1 429")
            except BlockingIOError:
                pass
        assert refused == 16, (
            f"{refused} of {PER_ADDRESS + 16} connections from one address refused (cap {PER_ADDRESS})"
        )
        assert lookup_ok(svc), "another address was not served while one held its cap"
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    s = connect(svc, source="127.0.0.2")  # closed ones are counted off
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(read_answer(s, 5)) == 200
    s.close()


def test_rss_stays_under_512_mib(svc):
    """Last in this module: the peak of the service's RSS through every probe above."""
    peak = rss_mib(svc, "VmHWM")
    assert peak < RSS_BOUND_MIB, f"the service's RSS peaked at {peak:.0f} MiB (bound {RSS_BOUND_MIB} MiB)"
