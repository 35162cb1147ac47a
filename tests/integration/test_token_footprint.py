"""A token's footprint is bounded, and a winner no host can launch does not stay (issue 41):
each probe against a real `tunecache serve` on Postgres, with the figure it checks in its name.

- field sizes: a problem's string over 64 characters, a config's over 256, is a 422;
- trials kept: 500 per submission (of the 2,000 a publish may send), TUNECACHE_TRIALS_PER_KEY
  per key (1,000 here), and what a 2,000-trial publish of ~900 KB adds to the database;
- bytes per token and address a day (3 MB here): 429 with Retry-After past it, before the body
  is read; another address of the token is not affected;
- retention: trials and submissions older than TUNECACHE_RETENTION_S are pruned by the service;
- a flood of 1,000 refused reports costs the lookups nothing (their cache survives);
- a winner that hosts report unlaunchable is replaced by a re-time that finds only other configs.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid

import httpx
import pytest

from support.fleet import Server, pg_service, result_body, wait_for

pytestmark = pytest.mark.postgres

PROBLEM = {"M": 64, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"}
C1 = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
C2 = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
C3 = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 2, "num_stages": 2}
BYTES_PER_DAY = 3_000_000
TRIALS_PER_KEY = 1000
FOOTPRINT = {"TUNECACHE_BYTES_PER_DAY": str(BYTES_PER_DAY), "TUNECACHE_TRIALS_PER_KEY": str(TRIALS_PER_KEY)}

svc = pg_service("footprint", FOOTPRINT)  # the lookup cache on (the default), a small byte quota


def token(server, scope: str) -> str:
    """A fresh token: the byte quota counts per token and address."""
    from tunecache.store import Store

    store = Store(server.db_url)
    try:
        return store.create_token(f"fp-{scope}-{uuid.uuid4().hex[:8]}", [scope])[0]
    finally:
        store.close()


def api(server, secret: str | None, **kw) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30, **kw)


def problem(**extra) -> dict:
    """A problem of its own (a key no other test touches)."""
    return {**PROBLEM, "M": secrets.randbelow(10**6) + 1, **extra}


def result(problem_: dict, median_ms: float, config: dict, **kw) -> dict:
    return result_body(median_ms, config, problem_, **kw)


def digest_of(body) -> str:
    from tunecache.key import TuneKey

    return TuneKey.from_fields(body).digest


def sql(server, query: str):
    from sqlalchemy import create_engine, text

    engine = create_engine(server.db_url)
    try:
        with engine.begin() as conn:
            res = conn.execute(text(query))
            return res.fetchall() if res.returns_rows else None
    finally:
        engine.dispose()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def test_a_900_kb_string_in_a_problem_or_config_is_422_over_64_and_256_characters(svc):
    with api(svc, token(svc, "worker")) as a:
        r = a.post("/v1/configs", json=result(problem(dtype="x" * 900_000), 5.0, C1))
        assert r.status_code == 422 and "64 characters" in r.text, r.text[:300]
        r = a.post("/v1/configs", json=result(problem(dtype="x" * 65), 5.0, C1))
        assert r.status_code == 422, "a problem string of 65 characters (cap 64) was accepted"
        r = a.post("/v1/configs", json=result(problem(), 5.0, {**C1, "note": "y" * 257}))
        assert r.status_code == 422 and "256 characters" in r.text, r.text[:300]
        trial = {"config": {"k": "z" * 257}, "status": "failed"}
        r = a.post("/v1/configs", json=dict(result(problem(), 5.0, C1), trials=[trial]))
        assert r.status_code == 422, "a trial's config string of 257 characters (cap 256) was accepted"
        assert a.post("/v1/configs", json=result(problem(dtype="float32"), 5.0, C1)).status_code == 200


def test_a_publish_keeps_500_trials_a_key_1000_and_900_kb_adds_under_300_kb(svc):
    p = problem()
    trials = [
        {"config": C3, "status": "ok", "median_ms": 10.0 + i}
        if i % 2
        else {"config": C3, "status": "failed", "error": "e" * 300}
        for i in range(2000)
    ]
    size = sql(svc, "SELECT pg_total_relation_size('trials') + pg_total_relation_size('submissions')")[0][0]
    with api(svc, token(svc, "worker")) as a:
        body = dict(result(p, 5.0, C1), trials=trials)
        sent = len(httpx.Request("POST", "http://x", json=body).content)
        assert a.post("/v1/configs", json=body).status_code == 200
        kept = sql(svc, f"SELECT count(*), min(median_ms) FROM trials WHERE digest = '{digest_of(body)}'")[0]
        assert kept[0] == 500, f"{kept[0]} of 2000 trials kept (500 per submission)"
        assert kept[1] == 11.0, "the fastest trials are the ones kept"
        grown = sql(svc, "SELECT pg_total_relation_size('trials') + pg_total_relation_size('submissions')")[0][0] - size
        assert grown < 300_000, f"a publish of {sent} bytes grew trials and submissions by {grown} bytes"
        for _ in range(2):
            assert a.post("/v1/configs", json=dict(result(p, 5.0, C1), trials=trials)).status_code == 200
    n = sql(svc, f"SELECT count(*) FROM trials WHERE digest = '{digest_of(body)}'")[0][0]
    assert n == TRIALS_PER_KEY, f"{n} trials kept for one key after 3 publishes (cap {TRIALS_PER_KEY})"


def test_a_token_over_3_mb_a_day_from_one_address_gets_429_before_its_body_is_read(svc):
    secret = token(svc, "publish")
    trials = [{"config": C3, "status": "failed", "error": "f" * 330} for _ in range(2000)]
    body = dict(result(problem(), 5.0, C1), trials=trials)
    sent = len(httpx.Request("POST", "http://x", json=body).content)
    assert 900_000 < sent < 1 << 20
    with api(svc, secret) as a:
        codes = [a.post("/v1/configs", json=body).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429], f"bodies of {sent} bytes against {BYTES_PER_DAY} a day: {codes}"
        r = a.post("/v1/configs", json=body)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0 and "TUNECACHE_BYTES_PER_DAY" in r.text
        assert a.get(f"/v1/configs/{'0' * 64}").status_code == 404, "reads are not counted"
    transport = httpx.HTTPTransport(local_address="127.0.0.5")
    with api(svc, secret, transport=transport) as b:  # the same token from another host
        assert b.post("/v1/configs", json=body).status_code == 200


def test_1000_refused_reports_leave_the_lookup_cache_whole(svc):
    p = problem()
    body = result(p, 5.0, C1)
    digest = digest_of(body)
    with api(svc, token(svc, "worker")) as w:
        assert w.post("/v1/configs", json=body).status_code == 200
    reader = api(svc, svc.tokens["read"])
    for _ in range(3):
        assert reader.get(f"/v1/configs/{digest}").status_code == 200
    reads = metric(svc, "tunecache_lookup_store_reads_total")
    report = {"config": C1, "error": "pruned"}
    bad = api(svc, "tc_" + secrets.token_urlsafe(32))
    anonymous = api(svc, None)
    publisher = api(svc, token(svc, "publish"))
    codes: dict[int, int] = {}
    for i in range(1000):
        client = (bad, anonymous, publisher)[i % 3]
        target = digest if client is not publisher else "f" * 64  # a live token: 404, nothing changed
        r = client.post(f"/v1/configs/{target}/reports", json=report)
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
    for c in (bad, anonymous, publisher):
        c.close()
    assert set(codes) <= {401, 404, 429}, codes
    for _ in range(20):
        assert reader.get(f"/v1/configs/{digest}").status_code == 200
    reader.close()
    after = metric(svc, "tunecache_lookup_store_reads_total")
    assert after == reads, f"after 1000 refused reports ({codes}), {after - reads:.0f} of 20 lookups asked the store"


def test_a_winner_no_host_can_launch_is_replaced_by_a_retime_that_finds_only_other_configs(svc):
    worker, publisher = api(svc, token(svc, "worker")), api(svc, token(svc, "publish"))
    reader = api(svc, svc.tokens["read"])
    # a worker-token winner claiming 80 ms that no host's pruning accepts
    p = problem()
    d = digest_of(result(p, 80.0, C1))
    assert worker.post("/v1/configs", json=dict(result(p, 80.0, C1), trials=[ok(C1, 80.0)])).json()["status"] == "won"
    generation = reader.get("/v1/generation").json()["generation"]
    r = publisher.post(f"/v1/configs/{d}/reports", json={"config": C1, "error": "prune() refused it on sm_90:132"})
    assert r.status_code == 200 and r.json()["job"] == "queued", r.text
    assert reader.get(f"/v1/jobs/{d}").json()["retime"] is True
    # the re-time: its best launchable config measures 261 ms, C1 not among its trials
    r = worker.post("/v1/configs", json=dict(result(p, 261.0, C2), trials=[ok(C2, 261.0), ok(C3, 300.0)]))
    assert r.json()["status"] == "won", f"a measured 261 ms lost to a claimed 80 ms no host can launch: {r.text}"
    assert reader.get(f"/v1/configs/{d}").json()["config"] == C2
    wait_for(  # the service reads the generation once a second
        lambda: reader.get("/v1/generation").json()["generation"] > generation,
        3,
        what="the generation to move (hosts must drop their copies of C1)",
    )

    # controls: without a report the keep-faster rule holds; a re-time that ran the winner keeps it
    q = problem()
    assert worker.post("/v1/configs", json=dict(result(q, 80.0, C1), trials=[ok(C1, 80.0)])).json()["status"] == "won"
    r = worker.post("/v1/configs", json=dict(result(q, 261.0, C2), trials=[ok(C2, 261.0)]))
    assert r.json()["status"] == "kept_existing", "a slower result replaced a winner nobody reported"
    dq = digest_of(result(q, 80.0, C1))
    assert publisher.post(f"/v1/configs/{dq}/reports", json={"config": C1, "error": "x"}).status_code == 200
    r = worker.post("/v1/configs", json=dict(result(q, 261.0, C2), trials=[ok(C1, 82.0), ok(C2, 261.0)]))
    assert r.json()["status"] == "kept_existing", "a re-time that launched the winner at 82 ms must keep it"
    for c in (worker, publisher, reader):
        c.close()


def ok(config: dict, ms: float) -> dict:
    return {"config": config, "status": "ok", "median_ms": ms}


def test_the_service_prunes_rows_older_than_its_retention_of_4_s(pg_url, tmp_path):
    """Last: this service prunes the shared database's old rows every second."""
    server = Server(pg_url, tmp_path / "server.log", env={"TUNECACHE_RETENTION_S": "4"}).start()
    try:
        secret = token(server, "worker")
        p = problem()
        with api(server, secret) as a:
            body = dict(result(p, 5.0, C1), trials=[ok(C1, 5.0), ok(C2, 6.0)])
            assert a.post("/v1/configs", json=body).status_code == 200
        d = digest_of(body)
        sql(server, f"UPDATE trials SET created_at = created_at - interval '1 hour' WHERE digest = '{d}'")
        start = time.monotonic()
        wait_for(
            lambda: sql(server, f"SELECT count(*) FROM trials WHERE digest = '{d}'")[0][0] == 0,
            10,
            what="the service's retention prune",
        )
        took = time.monotonic() - start
        assert took < 4, f"rows past the retention of 4 s were pruned after {took:.1f} s"
        with api(server, server_token := token(server, "read")) as r:  # the winner stays
            assert r.get(f"/v1/configs/{d}").status_code == 200, server_token
    finally:
        server.stop()
