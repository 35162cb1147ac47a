"""What one client may consume (request rates, trials per publish, unknown tokens, slow bodies,
retention, queued jobs' TTL), who may see the dashboard and the metrics, and tokens (expiry,
ids, unique names, the audit log of admin actions): each through real HTTP against
`tunecache serve`, on SQLite and on Postgres."""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading
import time
import uuid
from datetime import timedelta

import httpx
import pytest
from typer.testing import CliRunner

from support.fleet import Server, reset_fleet_tables, result_body, start_fleet
from tunecache.cli import app as cli

PROBLEM = {"M": 64, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"}
CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
# the tight service: 10 requests in any 2 s per token and address, and per address without a
# valid token; a body must be in within 1 s
TIGHT = {
    "TUNECACHE_RATE_LIMIT": "5",
    "TUNECACHE_RATE_BURST": "10",
    "TUNECACHE_ANON_RATE_LIMIT": "5",
    "TUNECACHE_ANON_RATE_BURST": "10",
    "TUNECACHE_BODY_TIMEOUT_S": "1",
}


def _db_url(request, tmp_path_factory) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('fleet-db') / 'fleet.sqlite'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(scope="module", params=BACKENDS)
def svc(request, tmp_path_factory):
    """The service with its default limits."""
    with start_fleet(_db_url(request, tmp_path_factory), tmp_path_factory.mktemp("svc"), prefix="limits") as server:
        yield server


@pytest.fixture
def clean_svc(svc):
    reset_fleet_tables(svc.db_url)
    return svc


@pytest.fixture(scope="module", params=BACKENDS)
def tight(request, tmp_path_factory):
    """The service with low limits (TIGHT)."""
    with start_fleet(
        _db_url(request, tmp_path_factory), tmp_path_factory.mktemp("tight"), prefix="tight", env=TIGHT
    ) as server:
        yield server


def result(median_ms=5.0, config=None, **key):
    return result_body(median_ms, config or CONFIG, PROBLEM, **key)


def job_key(**key) -> dict:
    return {k: v for k, v in result(**key).items() if k not in ("config", "median_ms")}


def digest_of(body) -> str:
    from tunecache.key import TuneKey

    return TuneKey.from_fields(body).digest


def api(server, token=None, **kw) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30, **kw)


def new_token(server, *scopes: str, expires_in: timedelta | None = None) -> str:
    """A fresh token (its own rate budget), named uniquely."""
    from tunecache.store import Store

    store = Store(server.db_url, migrate=False)
    try:
        return store.create_token(f"t-{uuid.uuid4().hex[:8]}", scopes or ("read",), expires_in=expires_in)[0]
    finally:
        store.close()


def run_cli(*args: str) -> tuple[int, str, str]:
    """(exit code, what it printed with its line wrapping undone, its stdout alone)."""
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, " ".join(res.output.split()), res.stdout


def sql(server, statement: str, **params) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(server.db_url)
    with engine.begin() as conn:
        conn.execute(text(statement), params)
    engine.dispose()


def metric(server, name: str, token: str) -> float:
    text_ = api(server, token).get("/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text_, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def until_window_passes(answer: httpx.Response) -> None:
    time.sleep(int(answer.headers.get("retry-after", "2")) + 0.2)


# ---- 5. limits ------------------------------------------------------------------------------


def test_a_token_over_its_rate_gets_429_with_retry_after(tight):
    first, second = new_token(tight), new_token(tight)
    with api(tight, first) as a:
        answers = [a.get("/v1/whoami") for _ in range(25)]
    codes = [r.status_code for r in answers]
    assert codes[:10] == [200] * 10 and 429 in codes, codes
    limited = next(r for r in answers if r.status_code == 429)
    retry = int(limited.headers["retry-after"])
    assert 1 <= retry <= 2, retry
    assert "TUNECACHE_RATE_LIMIT" in limited.json()["detail"] and "10 requests per 2 s" in limited.json()["detail"]
    with api(tight, second) as b:
        assert b.get("/v1/whoami").status_code == 200, "the budget is per token: another token is not limited"
    until_window_passes(limited)
    with api(tight, first) as a:
        assert a.get("/v1/whoami").status_code == 200, "the window moved on"


def test_unknown_tokens_are_cached_as_misses_and_limited_per_address(tight):
    reader = new_token(tight)
    before = metric(tight, "tunecache_token_checks_total", reader)
    unknown = "tc_" + secrets.token_urlsafe(32)
    with api(tight, unknown) as a:
        codes = [a.get("/v1/configs").status_code for _ in range(6)]
    assert codes == [401] * 6
    assert metric(tight, "tunecache_token_checks_total", reader) == before + 1, (
        "the same unknown token asked the database once"
    )
    time.sleep(2.2)  # the address's window of 2 s passes
    before = metric(tight, "tunecache_token_checks_total", reader)
    with api(tight, reader) as a:
        assert a.get("/v1/whoami").status_code == 200  # known (cached) from now on
    flood, started = [], time.monotonic()
    for _ in range(30):
        with api(tight, "tc_" + secrets.token_urlsafe(32)) as a:
            flood.append(a.get("/v1/configs"))
    # 10 per 2 s window per address: a loaded machine that takes longer over the flood sees more windows
    allowed = 10 * (1 + int((time.monotonic() - started) // 2))
    codes = [r.status_code for r in flood]
    assert set(codes) == {401, 429} and codes.count(401) <= allowed, codes
    limited = next(r for r in flood if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1 and "TUNECACHE_ANON_RATE_LIMIT" in limited.json()["detail"]
    with api(tight, reader) as a:  # a known token keeps working from the same address
        assert a.get("/v1/configs").status_code == 200
    until_window_passes(limited)
    checks = metric(tight, "tunecache_token_checks_total", reader) - before
    assert checks <= allowed, f"{checks} database lookups for 30 made-up tokens: the rest were refused before"


def test_a_publish_has_at_most_2000_trials(clean_svc):
    worker = clean_svc.tokens["worker"]
    trial = {"config": CONFIG, "status": "failed", "error": "x"}
    with api(clean_svc, worker) as a:
        over = a.post("/v1/configs", json=dict(result(), trials=[trial] * 2001))
        assert over.status_code == 422 and "at most 2000" in over.json()["detail"], over.text
        assert a.get("/v1/configs").json() == [], "a refused publish stores nothing"
        ok = a.post("/v1/configs", json=dict(result(), trials=[trial] * 2000))
        assert ok.status_code == 200, ok.text


def _send_slowly(url: str, head: bytes, pieces: list[bytes], gap_s: float, limit_s: float) -> tuple[bytes, float]:
    """Send the head, then the pieces `gap_s` apart (never the whole body); return what the
    service answered, read until it closes the connection, and how long that took."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=limit_s)
    start = time.monotonic()
    answer, closed = b"", False
    try:
        sock.sendall(head)
        for piece in pieces:
            sock.settimeout(gap_s)
            try:
                data = sock.recv(65536)
                answer += data
                closed = not data
            except socket.timeout:
                pass
            except OSError:
                closed = True
            if closed:
                break
            try:
                sock.sendall(piece)
            except OSError:
                break
        while not closed and time.monotonic() - start < limit_s:
            sock.settimeout(max(limit_s - (time.monotonic() - start), 0.05))
            try:
                data = sock.recv(65536)
            except OSError:  # a timeout, or a reset after the service closed
                break
            answer += data
            closed = not data
    finally:
        sock.close()
    return answer, time.monotonic() - start


def _auth(server) -> bytes:
    """A publish token's header: without a token a body is refused (401) before it is read."""
    return f"Authorization: Bearer {server.tokens['publish']}\r\n".encode()


def test_a_slow_body_is_cut_off_with_408(tight):
    head = (
        b"POST /v1/configs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n"
        + _auth(tight)
        + b"\r\n"
    )
    # stalls after a few bytes
    answer, took = _send_slowly(tight.url, head + b'{"kernel"', [], 0.1, 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"TUNECACHE_BODY_TIMEOUT_S" in answer and took < 5, took
    # trickles a byte every 0.2 s: alive, but never done in time
    answer, took = _send_slowly(tight.url, head, [b" "] * 40, 0.2, 15)
    assert answer.startswith(b"HTTP/1.1 408") and took < 5, (answer[:200], took)
    # chunked, stalled mid-body
    chunked = (
        b"POST /v1/configs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + _auth(tight)
        + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\n'
    )
    answer, took = _send_slowly(tight.url, chunked, [], 0.1, 10)
    assert answer.startswith(b"HTTP/1.1 408") and took < 5, (answer[:200], took)


def test_stalled_bodies_do_not_hold_the_service(tight):
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 999\r\n"
        + _auth(tight)
        + b"\r\n{"
    )
    answers: list[bytes] = []

    def stall():
        answers.append(_send_slowly(tight.url, head, [], 0.1, 20)[0])

    threads = [threading.Thread(target=stall) for _ in range(60)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with api(tight, new_token(tight)) as a:
        assert a.get("/v1/whoami").status_code == 200, "the service answers while 60 bodies stall"
    for t in threads:
        t.join(30)
    assert len(answers) == 60 and all(a.startswith(b"HTTP/1.1 408") for a in answers)
    with api(tight, new_token(tight, "publish")) as a:  # a body sent at once is not affected
        assert a.post("/v1/jobs", json=job_key()).status_code == 200


def test_prune_deletes_old_trials_submissions_and_finished_jobs(clean_svc):
    worker, old = clean_svc.tokens["worker"], "(now() at time zone 'utc') - interval '40 days'"
    trial = {"config": CONFIG, "status": "ok", "median_ms": 5.0}
    with api(clean_svc, worker) as a:
        for ms in (5.0, 4.0):  # two submissions, the second wins
            assert a.post("/v1/configs", json=dict(result(ms), trials=[trial])).status_code == 200
        for m in (128, 256, 512):
            assert a.post("/v1/jobs", json=job_key(problem=dict(PROBLEM, M=m))).status_code == 200
    if clean_svc.db_url.startswith("sqlite"):
        old = "datetime('now', '-40 days')"
    digest = digest_of(result())
    sql(clean_svc, f"UPDATE trials SET created_at = {old}")
    sql(clean_svc, f"UPDATE submissions SET created_at = {old}")
    done, failed, recent = (digest_of(job_key(problem=dict(PROBLEM, M=m))) for m in (128, 256, 512))
    sql(clean_svc, f"UPDATE tuning_jobs SET status = 'done', updated_at = {old} WHERE digest = :d", d=done)
    sql(clean_svc, f"UPDATE tuning_jobs SET status = 'failed', updated_at = {old} WHERE digest = :d", d=failed)
    code, out, stdout = run_cli("db", "prune", "--older-than", "30d", "--url", clean_svc.db_url)
    assert code == 0, out
    assert "pruned 2 trial(s), 1 submission(s) and 2 finished job(s)" in out, out
    with api(clean_svc, clean_svc.tokens["admin"]) as a:
        subs = a.get(f"/v1/configs/{digest}/submissions").json()
        assert [(s["median_ms"], s["accepted"]) for s in subs] == [(4.0, True)], "the winner's submission stays"
        assert a.get(f"/v1/configs/{digest}").json()["median_ms"] == 4.0, "winners are never pruned"
        assert a.get(f"/v1/jobs/{done}").status_code == 404 and a.get(f"/v1/jobs/{failed}").status_code == 404
        assert a.get(f"/v1/jobs/{recent}").json()["status"] == "queued"
        audit = a.get("/v1/audit", params={"action": "db.prune"}).json()
    assert audit and audit[0]["details"]["trials"] == 2 and audit[0]["actor"].startswith("cli:")


def test_queued_jobs_expire_after_their_ttl(clean_svc):
    stale, fresh = job_key(problem=dict(PROBLEM, M=128)), job_key(problem=dict(PROBLEM, M=256))
    with api(clean_svc, clean_svc.tokens["publish"]) as a:
        for key in (stale, fresh):
            assert a.post("/v1/jobs", json=key).status_code == 200
    ago = "(now() at time zone 'utc') - interval '2 hours'"
    if clean_svc.db_url.startswith("sqlite"):
        ago = "datetime('now', '-2 hours')"
    sql(clean_svc, f"UPDATE tuning_jobs SET updated_at = {ago} WHERE digest = :d", d=digest_of(stale))
    code, out, stdout = run_cli("db", "prune", "--older-than", "30d", "--job-ttl", "1h", "--url", clean_svc.db_url)
    assert code == 0 and "expired 1 queued job(s)" in out, out
    with api(clean_svc, clean_svc.tokens["read"]) as a:
        expired = a.get(f"/v1/jobs/{digest_of(stale)}").json()
        assert expired["status"] == "failed" and expired["last_error"].startswith("expired: queued for over")
        assert a.get(f"/v1/jobs/{digest_of(fresh)}").json()["status"] == "queued"
    from tunecache.store import Store

    store = Store(clean_svc.db_url, migrate=False)  # the default TTL (7 days) keeps a 2-hour-old job
    sql(clean_svc, f"UPDATE tuning_jobs SET updated_at = {ago} WHERE digest = :d", d=digest_of(fresh))
    assert store.expire_queued_jobs() == 0
    assert store.expire_queued_jobs(ttl_s=3600) == 1
    store.close()


# ---- 6. the dashboard and the metrics ----------------------------------------------------------


def test_the_dashboard_and_every_listing_need_a_token(clean_svc):
    with api(clean_svc, clean_svc.tokens["worker"]) as a:
        assert a.post("/v1/configs", json=result()).status_code == 200
        assert a.post("/v1/jobs", json=job_key(problem=dict(PROBLEM, M=128))).status_code == 200
    digest = digest_of(result())
    with api(clean_svc) as anon:
        page = anon.get("/")
        assert page.status_code == 401 and "<form" in page.text and "matmul.portable" not in page.text
        for path in (
            "/v1/configs",
            "/v1/jobs",
            "/v1/jobs/stats",
            "/v1/export",
            f"/v1/configs/{digest}/submissions",
            f"/v1/jobs/{digest}",
            "/v1/audit",
            "/v1/generation",
        ):
            assert anon.get(path).status_code == 401, path
        bad = anon.post("/login", data={"token": "tc_" + secrets.token_urlsafe(32)})
        assert bad.status_code == 401 and "invalid, expired or revoked" in bad.text and "set-cookie" not in bad.headers
    with api(clean_svc, clean_svc.tokens["read"]) as reader:  # the header, as for any read
        page = reader.get("/")
        assert page.status_code == 200 and "matmul.portable" in page.text
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
    with api(clean_svc) as browser:  # the login form, then a cookie
        login = browser.post("/login", data={"token": clean_svc.tokens["read"]})
        assert login.status_code == 303 and login.headers["location"] == "/"
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "max-age=43200" in cookie
        page = browser.get("/")
        assert page.status_code == 200 and "matmul.portable" in page.text
        assert browser.get("/v1/configs").status_code == 401, "the cookie is the dashboard's only, not the API's"
        browser.post("/logout")
        assert browser.get("/").status_code == 401


def test_the_dashboard_is_open_with_anonymous_reads(clean_svc, tmp_path):
    with api(clean_svc, clean_svc.tokens["worker"]) as a:
        assert a.post("/v1/configs", json=result()).status_code == 200
    server = Server(clean_svc.db_url, tmp_path / "anon.log", anonymous_read=True).start()
    try:
        with api(server) as anon:
            page = anon.get("/")
            assert page.status_code == 200 and "matmul.portable" in page.text
            assert anon.get("/v1/configs").status_code == 200
    finally:
        server.stop()


def test_metrics_on_their_own_port(clean_svc, tmp_path, monkeypatch):
    from support.fleet import free_port

    for name in ("TUNECACHE_METRICS_PORT", "TUNECACHE_METRICS_HOST", "TUNECACHE_DB_URL"):  # `serve` sets them
        monkeypatch.setenv(name, "")

    port = free_port()
    server = Server(clean_svc.db_url, tmp_path / "metrics.log", args=("--metrics-port", str(port))).start()
    try:
        with api(server, clean_svc.tokens["publish"]) as a:
            a.get(f"/v1/configs/{digest_of(result())}")  # a miss
            a.post("/v1/jobs", json=job_key())
            off = a.get("/metrics")
            assert off.status_code == 404 and "--metrics-port" in off.json()["detail"]
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scraped.status_code == 200
        assert re.search(r"^tunecache_lookup_misses_total 1\.0$", scraped.text, re.M), scraped.text[:2000]
        assert re.search(r'^tunecache_queue_depth\{status="queued"\} 1\.0$', scraped.text, re.M)
    finally:
        server.stop()
    code, out, stdout = run_cli("serve", "--workers", "2", "--metrics-port", str(port), "--db-url", clean_svc.db_url)
    assert code == 2 and "--workers 1" in out


# ---- 8. tokens ------------------------------------------------------------------------------------


def test_a_token_stops_working_when_it_expires(svc):
    token = new_token(svc, expires_in=timedelta(seconds=2))
    with api(svc, token) as a:
        assert a.get("/v1/whoami").status_code == 200  # now cached, but not past its expiry
        time.sleep(2.5)
        r = a.get("/v1/whoami")
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    code, out, stdout = run_cli(
        "token",
        "create",
        "--scope",
        "read",
        "--name",
        f"e-{uuid.uuid4().hex[:6]}",
        "--expires-in",
        "30d",
        "--db-url",
        svc.db_url,
    )
    assert code == 0 and "expires" in out
    secret = stdout.strip()
    with api(svc, secret) as a:
        assert a.get("/v1/whoami").status_code == 200
    code, out, stdout = run_cli("token", "create", "--scope", "read", "--expires-in", "soon", "--db-url", svc.db_url)
    assert code == 2 and "not a duration" in out


def test_token_names_are_unique_and_revoke_takes_an_id(svc):
    name = f"u-{uuid.uuid4().hex[:6]}"
    code, out, stdout = run_cli("token", "create", "--scope", "publish", "--name", name, "--db-url", svc.db_url)
    assert code == 0, out
    first = stdout.strip()
    code, out, stdout = run_cli("token", "create", "--scope", "read", "--name", name, "--db-url", svc.db_url)
    assert code == 2 and f"a live token named {name!r} exists" in out
    from tunecache.store import Store

    store = Store(svc.db_url, migrate=False)
    token_id = next(t.id for t in store.list_tokens() if t.name == name and t.revoked_at is None)
    with pytest.raises(ValueError, match="exists"):
        store.create_token(name, ["read"])
    store.close()
    code, out, stdout = run_cli("token", "revoke", "--id", str(token_id), "--db-url", svc.db_url)
    assert code == 0 and f"(id {token_id})" in out
    with api(svc, first) as a:
        r = a.get("/v1/whoami")
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    code, out, stdout = run_cli("token", "revoke", "--id", str(token_id), "--db-url", svc.db_url)
    assert code == 2 and "no live token" in out
    code, out, stdout = run_cli("token", "create", "--scope", "read", "--name", name, "--db-url", svc.db_url)
    assert code == 0, "a revoked token's name is free again"
    code, out, stdout = run_cli("token", "revoke", name, "--db-url", svc.db_url)
    assert code == 0 and name in out
    code, out, stdout = run_cli("token", "revoke", name, "--id", "1", "--db-url", svc.db_url)
    assert code == 2 and "not both" in out


def test_admin_actions_leave_an_audit_row(clean_svc):
    admin = clean_svc.tokens["admin"]
    digest = digest_of(result())
    with api(clean_svc, admin) as a:
        assert a.post("/v1/configs", json=result()).status_code == 200
        exported = a.get("/v1/export").json()
        assert a.delete(f"/v1/configs/{digest}").status_code == 200
        assert a.post("/v1/import", json=exported).status_code == 200
    name = f"a-{uuid.uuid4().hex[:6]}"
    assert run_cli("token", "create", "--scope", "read", "--name", name, "--db-url", clean_svc.db_url)[0] == 0
    assert run_cli("token", "revoke", name, "--db-url", clean_svc.db_url)[0] == 0
    with api(clean_svc, admin) as a:
        rows = a.get("/v1/audit", params={"limit": 20}).json()
        assert a.get("/v1/audit", headers={"Authorization": f"Bearer {clean_svc.tokens['read']}"}).status_code == 403
    by_action = {}
    for row in rows:  # newest first
        by_action.setdefault(row["action"], row)
    delete, imported = by_action["config.delete"], by_action["config.import"]
    assert delete["actor"] == "limits-admin" and delete["actor_token_id"] and delete["target"] == f"config:{digest}"
    assert imported["details"] == {"stored": 1, "kept": 0, "rejected": 0}
    assert by_action["token.create"]["details"]["name"] == name and by_action["token.revoke"]["details"]["name"] == name
    assert by_action["token.revoke"]["actor"].startswith("cli:") and by_action["token.revoke"]["actor_token_id"] is None
    code, out, stdout = run_cli("audit", "ls", "--json", "--action", "config.delete", "--db-url", clean_svc.db_url)
    assert code == 0 and json.loads(stdout.splitlines()[0])["target"] == f"config:{digest}"


def test_the_migration_makes_live_names_unique(tmp_path):
    from sqlalchemy import create_engine, text

    from tunecache.store.migrate import upgrade

    engine = create_engine(f"sqlite:///{tmp_path / 'old.sqlite'}")
    upgrade(engine, "0003")
    with engine.begin() as conn:
        for i, (name, revoked) in enumerate([("ops", None), ("ops", None), ("ops", "2026-01-01"), ("ci", None)]):
            conn.execute(
                text(
                    "INSERT INTO api_tokens (name, token_hash, scopes, created_at, revoked_at) "
                    "VALUES (:n, :h, 'read', '2026-01-01', :r)"
                ),
                {"n": name, "h": f"h{i}", "r": revoked},
            )
    upgrade(engine, "head")
    with engine.connect() as conn:
        names = [r[0] for r in conn.execute(text("SELECT name FROM api_tokens ORDER BY id"))]
    assert names == ["ops", "ops#2", "ops", "ci"], names
    engine.dispose()
