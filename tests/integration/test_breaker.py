"""A service that is down, hangs or answers garbage never fails the library's call, and once
the circuit breaker is open the call pays no timeout."""

from __future__ import annotations

import time

import pytest

from support.fleet import Server
from support.misses import miss_key, timed_miss
from support.raw_http import RawServer, head

TIMEOUT_S = 1.0
FAILURES = 3


def _http(status: str, body: bytes) -> bytes:
    return head(status, Content_Length=len(body), Connection="close") + body


GARBAGE = {
    "not HTTP": b"\x00\xff\xfe garbage, not an HTTP response\r\n\r\n",
    "not JSON": _http("200 OK", b"<html>{oops"),
    "wrong JSON": _http("200 OK", b'{"config": 5, "job": [1]}'),
    "500": _http("500 Internal Server Error", b'{"detail": "boom"}'),
}


@pytest.fixture
def fleet_env(db_url, monkeypatch):
    from tunecache.fleet import client

    monkeypatch.setenv("TUNECACHE_BACKEND", "portable")
    monkeypatch.setenv("TUNECACHE_SERVER_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("TUNECACHE_BREAKER_FAILURES", str(FAILURES))
    monkeypatch.setenv("TUNECACHE_BREAKER_OPEN_S", "60")
    monkeypatch.setenv("TUNECACHE_TOKEN", "tc_whatever")
    client.reset_clients()
    yield monkeypatch
    client.reset_clients()


def _assert_breaker_spares_the_call(url: str, monkeypatch) -> None:
    from tunecache.fleet.client import fleet_client
    from tunecache.store import default_store

    monkeypatch.setenv("TUNECACHE_SERVER_URL", url)
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "tune")
    # policy tune: the fleet has nothing usable, so the call tunes locally and succeeds
    timed_miss(0)
    assert default_store().get_config(miss_key(0).digest) is not None
    # policy default: lookup and enqueue both go to the fleet
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    timed_miss(1)
    fleet = fleet_client(url)
    assert fleet.breaker.is_open, f"{FAILURES} failures in a row must open the breaker"
    # open: a call with two fleet requests (lookup, enqueue) pays neither timeout
    elapsed = timed_miss(2)
    assert elapsed < TIMEOUT_S, f"the call took {elapsed:.2f} s with the breaker open"
    keys = [miss_key(i) for i in range(100)]
    t0 = time.perf_counter()
    for k in keys:
        assert fleet.lookup(k) is None
        assert fleet.enqueue(k) is None
    assert time.perf_counter() - t0 < 0.1, "an open breaker answers at once"


def test_service_stopped(fleet_env, clean_fleet, tmp_path, pg_url):
    server = Server(pg_url, tmp_path / "s.log").start()
    url = server.url
    server.stop()
    _assert_breaker_spares_the_call(url, fleet_env)


def test_service_hanging(fleet_env, pg_url, tmp_path):
    server = Server(pg_url, tmp_path / "s.log").start()
    server.pause()  # accepts connections (the kernel's backlog), answers nothing
    try:
        t0 = time.perf_counter()
        _assert_breaker_spares_the_call(server.url, fleet_env)
        # only the calls before the breaker opened waited for the timeout
        assert time.perf_counter() - t0 < (FAILURES + 2) * TIMEOUT_S + 30
    finally:
        server.stop()


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_service_answering_garbage(fleet_env, kind):
    server = RawServer(lambda srv, conn: srv.send(conn, GARBAGE[kind]))  # the same bytes to every request
    try:
        _assert_breaker_spares_the_call(server.url, fleet_env)
        assert server.requests >= FAILURES, "the client did talk to it"
        seen = server.requests
        timed_miss(3)
        assert server.requests == seen, "an open breaker sends nothing"
    finally:
        server.close()


def test_breaker_closes_again_when_the_service_is_back(fleet_env, clean_fleet, pg_url, tmp_path):
    import httpx

    from tunecache.fleet.client import FleetClient

    fleet = clean_fleet
    key = miss_key(5)
    body = {
        **key.fields(),
        "config": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "median_ms": 1.0,
    }
    httpx.post(f"{fleet.url}/v1/configs", json=body, headers={"Authorization": f"Bearer {fleet.tokens['worker']}"})
    server = Server(pg_url, tmp_path / "s.log").start()
    client = FleetClient(server.url, fleet.tokens["read"], timeout_s=0.5, failures=2, open_s=1.0)
    try:
        assert client.lookup(key) is not None
        server.pause()
        assert client.lookup(key) is None and client.lookup(key) is None
        assert client.breaker.is_open
        server.resume()
        assert client.lookup(key) is None, "still open: no request is sent"
        time.sleep(1.1)
        rec = client.lookup(key)  # half-open: one trial call, it succeeds, the breaker closes
        assert rec is not None and rec.config == body["config"] and not client.breaker.is_open
    finally:
        client.close()
        server.stop()
