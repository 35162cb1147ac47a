"""Readers are never starved by writers (issue 41): against a real `tunecache serve` on Postgres
at TUNECACHE_PUBLISH_SHARE 0.2, publishes of 2,000-trial results from four clients at once
take at most a fifth of the service's time while lookups come in (the rest they wait, which
/metrics counts), every lookup is answered meanwhile, and with no lookups they are not held."""

from __future__ import annotations

import re
import secrets
import threading
import time
import uuid

import httpx
import pytest

from support.fleet import pg_service, result_body

pytestmark = pytest.mark.postgres

C1 = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
svc = pg_service("pacing", {"TUNECACHE_PUBLISH_SHARE": "0.2"})


def _client(server, scope: str) -> httpx.Client:
    from tunecache.store import Store

    store = Store(server.db_url)
    try:
        secret = store.create_token(f"pace-{scope}-{uuid.uuid4().hex[:8]}", [scope])[0]
    finally:
        store.close()
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=60)


def _big_result() -> dict:
    """A publish token's result of 2,000 trials (~900 KB), for a key of its own."""
    problem = {"M": secrets.randbelow(10**6) + 1, "N": 64, "K": 64, "dtype": "float32"}
    problem.update(a_layout="row", b_layout="row")
    trials = [
        {"config": {**C1, "BLOCK_K": 16 + i % 64, "num_stages": 2 + i // 64}, "status": "ok", "median_ms": 5 + i / 1e3}
        for i in range(2000)
    ]
    return dict(result_body(5.0, C1, problem), trials=trials)


def _metric(server, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", httpx.get(f"{server.url}/metrics", timeout=10).text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def _publish_all(server, clients: int, each: int) -> None:
    def one() -> None:
        with _client(server, "publish") as c:
            for _ in range(each):
                r = c.post("/v1/configs", json=_big_result())
                assert r.status_code == 200, r.text[:300]

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_while_lookups_come_in_publishes_take_at_most_a_fifth_of_the_service_time(svc):
    busy0, held0 = _metric(svc, "tunecache_publish_seconds_total"), _metric(svc, "tunecache_publish_held_seconds_total")
    stop, answers = threading.Event(), []

    def read() -> None:
        with _client(svc, "read") as r:
            while not stop.wait(0.02):  # within a read token's rate limit
                answers.append(r.get(f"/v1/configs/{secrets.token_hex(32)}").status_code)

    reader = threading.Thread(target=read)
    reader.start()
    t0 = time.monotonic()
    try:
        _publish_all(svc, clients=4, each=2)
    finally:
        took = time.monotonic() - t0
        stop.set()
        reader.join()
    busy = _metric(svc, "tunecache_publish_seconds_total") - busy0
    held = _metric(svc, "tunecache_publish_held_seconds_total") - held0
    # 8 publishes one at a time, 7 pauses of 4x the publish before: 8 / 36 of the time (the
    # last one's pause falls after it); back to back, as unpaced, they take most of it
    assert busy <= 0.3 * took, f"publishes took {busy:.2f} s of {took:.2f} s (share 0.2), held {held:.2f} s"
    assert held > 0
    assert answers and set(answers) == {404}, f"lookups answered {sorted(set(answers))}"


def test_with_no_lookups_publishes_run_back_to_back(svc):
    held0 = _metric(svc, "tunecache_publish_held_seconds_total")
    _publish_all(svc, clients=4, each=1)
    assert _metric(svc, "tunecache_publish_held_seconds_total") == held0, "publishes were held with no lookup coming in"
