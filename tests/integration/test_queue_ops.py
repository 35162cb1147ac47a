"""The queue, bound to its claimers and run by its operators, through real HTTP on SQLite and on
Postgres: a claim's lease secret that every lease call must present, capped leases and
backoffs, the database's clock, `not_before` in answers and on the dashboard, a claim that goes
past a lapsed last attempt, a row that cannot be read quarantined instead of a 500, a stuck
queue on /healthz, `tunecache jobs ls | retry | drop` and the admin routes, and one queue
interface (`tunecache.fleet.protocol.Fleet`) over the store and the fleet."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from support import ROOT
from support.fleet import Server, host_env, reset_fleet_tables, start_worker

KEY = {"kernel": "matmul.portable", "kernel_version": "v1", "triton_version": "3.9.0", "arch": "cpu", "sm_count": 0}
CPU = {"arch": "cpu", "sm_count": 0}


def key(M: int = 64, **over) -> dict:
    return {
        **KEY,
        "problem": {"M": M, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
        **over,
    }


def digest_of(body: dict) -> str:
    from tunecache.key import TuneKey

    return TuneKey.from_fields(body).digest


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_fleet(request):
    """The service over SQLite, then over Postgres; emptied for each test."""
    server = request.getfixturevalue("sqlite_fleet" if request.param == "sqlite" else "fleet")
    reset_fleet_tables(server.db_url)
    from tunecache.fleet import client

    client.reset_clients()
    yield server
    client.reset_clients()


def api(fleet, scope: str | None = "admin") -> httpx.Client:
    headers = {"Authorization": f"Bearer {fleet.tokens[scope]}"} if scope else {}
    return httpx.Client(base_url=fleet.url, headers=headers, timeout=20)


def sql(fleet, statement: str, **params) -> list:
    """Run SQL on the fleet's database (to break a row, or to move a time) and return the rows."""
    from sqlalchemy import create_engine, text

    engine = create_engine(fleet.db_url)
    try:
        with engine.begin() as conn:
            res = conn.execute(text(statement), params)
            return res.all() if res.returns_rows else []
    finally:
        engine.dispose()


def db_now(fleet) -> datetime:
    from tunecache.store import Store

    store = Store(fleet.db_url)
    try:
        return store.db_now()
    finally:
        store.close()


def utc(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text).astimezone(timezone.utc).replace(tzinfo=None)


def claim(c: httpx.Client, owner: str = "w", **extra) -> tuple[dict | None, str | None]:
    r = c.post("/v1/jobs/claim", json={"owner": owner, **CPU, **extra})
    assert r.status_code == 200, r.text
    return r.json()["job"], r.json()["lease_secret"]


# ---- 4. leases bound to their claimer ------------------------------------------------------


def test_a_claim_returns_a_lease_secret_that_every_lease_call_must_present(any_fleet):
    fleet = any_fleet
    with api(fleet, "worker") as w, api(fleet, "read") as reader:
        w.post("/v1/jobs", json=key())
        job, secret = claim(w, "gpu-node-01:1:gpu0")
        assert job is not None and secret.startswith("tcl_") and len(secret) > 40
        listed = reader.get("/v1/jobs").json()
        assert "secret" not in json.dumps(listed) and secret not in json.dumps(listed), "returned once, to the claimer"
        stored = sql(fleet, "SELECT lease_hash, lease_owner FROM tuning_jobs")
        assert stored == [(hashlib.sha256(secret.encode()).hexdigest(), "gpu-node-01:1:gpu0")], (
            "only the secret's hash is kept"
        )
        path = f"/v1/jobs/{job['id']}"
        for what, body in (("heartbeat", {}), ("complete", {}), ("fail", {"error": "x"}), ("release", {})):
            # another worker token that knows the owner's name (the dashboard shows it) gets nowhere
            missing = w.post(f"{path}/{what}", json={"owner": "gpu-node-01:1:gpu0", **body})
            assert missing.status_code == 403 and "lease_secret" in missing.json()["detail"], missing.text
            wrong = w.post(f"{path}/{what}", json={"lease_secret": "tcl_" + "x" * 43, **body})
            assert wrong.status_code == 409 and "not held by this lease secret" in wrong.json()["detail"]
        after = reader.get(f"/v1/jobs/{job['digest']}").json()
        assert after["status"] == "running" and after["lease_owner"] == "gpu-node-01:1:gpu0"
        assert w.post(f"{path}/heartbeat", json={"lease_secret": secret}).status_code == 200
        assert w.post(f"{path}/release", json={"lease_secret": secret}).json()["status"] == "queued"
        assert w.post(f"{path}/complete", json={"lease_secret": secret}).status_code == 409, "released: not held"
        job2, secret2 = claim(w)
        assert job2["id"] == job["id"] and secret2 != secret, "each claim gets a fresh secret"
        assert w.post(f"{path}/complete", json={"lease_secret": secret}).status_code == 409
        assert w.post(f"{path}/complete", json={"lease_secret": secret2}).json()["status"] == "done"


def test_lease_and_backoff_caps_are_422s_that_say_the_cap(any_fleet):
    with api(any_fleet, "worker") as w:
        w.post("/v1/jobs", json=key())
        r = w.post("/v1/jobs/claim", json={"owner": "w", **CPU, "lease_s": 86_400})
        assert r.status_code == 422 and "lease_s" in r.text and "600" in r.json()["detail"], r.text
        job, secret = claim(w, lease_s=600)  # the cap itself is fine
        r = w.post(f"/v1/jobs/{job['id']}/heartbeat", json={"lease_secret": secret, "lease_s": 601})
        assert r.status_code == 422 and "600" in r.json()["detail"]
        r = w.post(f"/v1/jobs/{job['id']}/fail", json={"lease_secret": secret, "error": "x", "backoff_s": 86_400})
        assert r.status_code == 422 and "backoff_s" in r.text and "3600" in r.json()["detail"], r.text
        assert w.get(f"/v1/jobs/{job['digest']}").json()["status"] == "running", "a refused call changes nothing"


def test_lease_times_come_from_the_database_clock(any_fleet, tmp_path):
    """A replica whose clock is 3 h ahead computes the same leases and backoffs as one that is right."""
    fleet = any_fleet
    skew = tmp_path / "skew"
    skew.mkdir()
    (skew / "sitecustomize.py").write_text(
        "import datetime, tunecache.store as s\n"
        "_real = s.utcnow\n"
        "s.utcnow = lambda: _real() + datetime.timedelta(hours=3)\n"
    )
    ahead = Server(
        fleet.db_url,
        tmp_path / "ahead.log",
        env={"PYTHONPATH": os.pathsep.join([str(skew), os.environ.get("PYTHONPATH", "")])},
    ).start()
    try:
        with (
            httpx.Client(
                base_url=ahead.url, headers={"Authorization": f"Bearer {fleet.tokens['worker']}"}, timeout=20
            ) as skewed,
            api(fleet, "worker") as right,
        ):
            queued = skewed.post("/v1/jobs", json=key()).json()
            now = db_now(fleet)
            assert abs((utc(queued["not_before"]) - now).total_seconds()) < 30
            assert abs((utc(queued["created_at"]) - now).total_seconds()) < 30
            job, secret = claim(skewed, "ahead", lease_s=30)
            until = (utc(job["lease_expires_at"]) - db_now(fleet)).total_seconds()
            assert 20 < until <= 30, f"the lease runs out in {until} s by the database's clock"
            # a failure's backoff of 0 s: the right replica may claim it at once
            assert (
                skewed.post(
                    f"/v1/jobs/{job['id']}/fail", json={"lease_secret": secret, "error": "boom", "backoff_s": 0}
                ).status_code
                == 200
            )
            job, secret = claim(right, "right", lease_s=1)
            assert job is not None, "the backoff was computed by the database, not by the replica 3 h ahead"
            # a 1 s lease taken through the right replica has lapsed for the skewed one too
            time.sleep(1.5)
            again, _ = claim(skewed, "ahead", lease_s=30)
            assert again is not None and again["id"] == job["id"] and again["attempts"] == 3
    finally:
        ahead.stop()


def test_not_before_is_in_the_api_and_on_the_dashboard(any_fleet):
    with api(any_fleet, "admin") as c:
        c.post("/v1/jobs", json=key())
        job, secret = claim(c)
        assert (
            c.post(
                f"/v1/jobs/{job['id']}/fail",
                json={"lease_secret": secret, "error": "CUDA error: boom", "backoff_s": 600},
            ).json()["status"]
            == "queued"
        )
        after = c.get(f"/v1/jobs/{job['digest']}").json()
        wait = (utc(after["not_before"]) - db_now(any_fleet)).total_seconds()
        assert 590 < wait <= 600, after
        listed = c.get("/v1/jobs", params={"status": "queued"}).json()
        assert listed[0]["not_before"] == after["not_before"]
        page = c.get("/")
        assert page.status_code == 200, page.text[:300]
        assert "Queued jobs" in page.text and "not before" in page.text
        assert utc(after["not_before"]).isoformat(" ")[:19] in page.text, "the dashboard shows when it may run"


# ---- 7. queue operations --------------------------------------------------------------------


def test_a_claim_goes_past_a_lapsed_last_attempt(any_fleet):
    with api(any_fleet, "worker") as w:
        w.post("/v1/jobs", json={**key(1), "max_attempts": 1, "priority": 5})
        w.post("/v1/jobs", json=key(2))
        first, _ = claim(w, "doomed-host:42:gpu0", lease_s=1)
        assert first["problem"]["M"] == 1
        time.sleep(1.5)  # its worker died: the lease of its last attempt runs out
        nxt, secret = claim(w, "alive")
        assert nxt is not None and nxt["problem"]["M"] == 2, "the claim went on to the next job in the same call"
        dead = w.get(f"/v1/jobs/{first['digest']}").json()
        assert dead["status"] == "failed" and dead["lease_owner"] is None
        assert "lease of doomed-host:42:gpu0 ran out on the last attempt (1/1)" in dead["last_error"], dead
        assert "None" not in dead["last_error"]


def _break_row(fleet, digest: str) -> None:
    """Make a job's problem unreadable, as a bad migration or a hand edit would."""
    bad = "{broken" if fleet.db_url.startswith("sqlite") else '"not an object"'  # Postgres keeps valid JSON only
    sql(fleet, "UPDATE tuning_jobs SET problem = :bad WHERE digest = :d", bad=bad, d=digest)


def test_an_unreadable_row_is_quarantined_not_a_500(any_fleet):
    fleet = any_fleet
    with api(fleet, "admin") as c:
        broken = c.post("/v1/jobs", json={**key(1), "priority": 9}).json()
        c.post("/v1/jobs", json=key(2))
        _break_row(fleet, broken["digest"])
        listed = c.get("/v1/jobs")
        assert listed.status_code == 200, listed.text
        row = next(j for j in listed.json() if j["digest"] == broken["digest"])
        assert row["unreadable"] and row["problem"] == {}
        assert c.get(f"/v1/jobs/{broken['digest']}").json()["unreadable"]
        job, _ = claim(c)
        assert job is not None and job["problem"]["M"] == 2, "the claim skipped the unreadable row"
        after = c.get(f"/v1/jobs/{broken['digest']}").json()
        assert after["status"] == "quarantined" and "cannot be read" in after["last_error"]
        assert claim(c)[0] is None, "never claimed"
        assert c.get("/v1/jobs/stats").json()["quarantined"] == 1
        assert [j["digest"] for j in c.get("/v1/jobs", params={"status": "quarantined"}).json()] == [broken["digest"]]
        health = c.get("/healthz")
        assert health.status_code == 200 and health.json()["quarantined_jobs"] == 1
        r = c.post(f"/v1/jobs/{broken['digest']}/retry")
        assert r.status_code == 409 and "drop it" in r.json()["detail"]
        # enqueueing its key again writes the fields back: the job is repaired and queued
        repaired = c.post("/v1/jobs", json={**key(1), "priority": 9}).json()
        assert repaired["status"] == "queued" and repaired["unreadable"] is None and repaired["attempts"] == 0
        assert claim(c)[0]["digest"] == broken["digest"]


def test_admin_retry_and_drop(any_fleet):
    fleet = any_fleet
    with api(fleet, "admin") as admin, api(fleet, "worker") as w:
        w.post("/v1/jobs", json={**key(1), "max_attempts": 1})
        job, secret = claim(w)
        assert (
            w.post(f"/v1/jobs/{job['id']}/fail", json={"lease_secret": secret, "error": "OOM"}).json()["status"]
            == "failed"
        )
        d = job["digest"]
        assert w.post(f"/v1/jobs/{d}/retry").status_code == 403, "admin only"
        assert w.delete(f"/v1/jobs/{d}").status_code == 403
        retried = admin.post(f"/v1/jobs/{d}/retry")
        assert retried.status_code == 200, retried.text
        assert retried.json()["status"] == "queued" and retried.json()["attempts"] == 0
        assert retried.json()["last_error"] == "OOM", "the last error is kept"
        job, secret = claim(w)
        assert job["digest"] == d, "a failed shape is tuned again"
        r = admin.post(f"/v1/jobs/{d}/retry")
        assert r.status_code == 409 and "running" in r.json()["detail"]
        assert admin.post(f"/v1/jobs/{'0' * 64}/retry").status_code == 404
        assert admin.delete(f"/v1/jobs/{d}").json() == {"deleted": True}
        assert admin.get(f"/v1/jobs/{d}").status_code == 404
        assert w.post(f"/v1/jobs/{job['id']}/heartbeat", json={"lease_secret": secret}).status_code == 409, (
            "a dropped job's worker loses its lease"
        )
        assert admin.delete(f"/v1/jobs/{d}").status_code == 404
        actions = [(a["action"], a["target"], a["actor"]) for a in admin.get("/v1/audit").json()]
        assert ("job.retry", f"job:{d}", "test-admin") in actions and ("job.drop", f"job:{d}", "test-admin") in actions


def test_healthz_reports_a_stuck_queue(any_fleet):
    fleet = any_fleet
    with api(fleet, "worker") as w, api(fleet, None) as anon:
        health = anon.get("/healthz").json()
        assert health["queue_stuck"] is False and health["queue"] == []
        w.post("/v1/jobs", json=key(1, arch="sm_90", sm_count=132))
        w.post("/v1/jobs", json=key(2))
        # the H100 job has waited two hours by the database's clock: no worker of its class is there
        sql(fleet, "UPDATE tuning_jobs SET not_before = :t WHERE arch = 'sm_90'", t=db_now(fleet) - timedelta(hours=2))
        r = anon.get("/healthz")
        assert r.status_code == 200 and r.json()["status"] == "ok", "a stuck queue is news, not an outage"
        health = r.json()
        assert health["queue_stuck"] is True and health["stuck_after_s"] == 900
        by_class = {(q["arch"], q["sm_count"]): q for q in health["queue"]}
        h100, cpu = by_class[("sm_90", 132)], by_class[("cpu", 0)]
        assert h100["stuck"] and h100["waiting"] == 1 and 7100 < h100["oldest_wait_s"] < 7400
        assert not cpu["stuck"] and cpu["waiting"] == 1 and cpu["oldest_wait_s"] < 60
        # a worker of the class shows up and holds a lease: not stuck any more
        assert w.post("/v1/jobs/claim", json={"owner": "h100", "arch": "sm_90", "sm_count": 132}).json()["job"]
        health = anon.get("/healthz").json()
        h100 = {(q["arch"], q["sm_count"]): q for q in health["queue"]}[("sm_90", 132)]
        assert health["queue_stuck"] is False and h100 == {**h100, "waiting": 0, "running": 1, "stuck": False}


# ---- the CLI: tunecache jobs ls | retry | drop ----------------------------------------------


def cli(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.parametrize("through", ["db-url", "service"])
def test_jobs_ls_retry_drop(any_fleet, tmp_path, through):
    fleet = any_fleet
    with api(fleet, "worker") as w:
        w.post("/v1/jobs", json={**key(1), "max_attempts": 1})
        w.post("/v1/jobs", json=key(2))
        job, secret = claim(w)
        w.post(f"/v1/jobs/{job['id']}/fail", json={"lease_secret": secret, "error": "Traceback...\nOOM on 64x64"})
    failed, other = job["digest"], digest_of(key(2))
    if through == "db-url":
        env, extra = host_env(tmp_path, "ops", None, None), ["--db-url", fleet.db_url]
    else:
        env, extra = host_env(tmp_path, "ops", fleet.url, fleet.tokens["admin"]), []

    rows = [json.loads(line) for line in cli("jobs", "ls", "--json", *extra, env=env).stdout.splitlines()]
    assert {(r["digest"], r["status"]) for r in rows} == {(failed, "failed"), (other, "queued")}
    assert next(r for r in rows if r["digest"] == failed)["last_error"].endswith("OOM on 64x64")
    table = cli("jobs", "ls", "--status", "failed", *extra, env={**env, "COLUMNS": "250"}).stdout
    assert failed[:12] in table and other[:12] not in table and "1 failed" in table

    out = cli("jobs", "retry", failed[:10], *extra, env=env).stdout
    assert "queued again" in out
    rows = {r["digest"]: r for r in map(json.loads, cli("jobs", "ls", "--json", *extra, env=env).stdout.splitlines())}
    assert rows[failed]["status"] == "queued" and rows[failed]["attempts"] == 0
    unknown = cli("jobs", "retry", "ffffffffff", *extra, env=env, check=False)
    assert unknown.returncode == 2 and "no job whose digest starts with 'ffffffffff'" in " ".join(
        unknown.stderr.split()
    )
    cli("jobs", "drop", other[:12], *extra, env=env)
    rows = [json.loads(line) for line in cli("jobs", "ls", "--json", *extra, env=env).stdout.splitlines()]
    assert [r["digest"] for r in rows] == [failed]
    if through == "service":  # a read token may list, not retry
        reader = host_env(tmp_path, "ops", fleet.url, fleet.tokens["read"])
        assert len(cli("jobs", "ls", "--json", env=reader).stdout.splitlines()) == 1
        refused = cli("jobs", "retry", failed, env=reader, check=False)
        words = " ".join(refused.stderr.split())
        assert refused.returncode == 1 and "answered 403" in words and "this needs 'admin'" in words, words
    else:  # the command line's actions are audited too
        from tunecache.store import Store

        store = Store(fleet.db_url)
        actions = {(a.action, a.target) for a in store.audit_log(limit=20) if a.actor.startswith("cli:")}
        store.close()
        assert {("job.retry", f"job:{failed}"), ("job.drop", f"job:{other}")} <= actions


def test_jobs_help_says_which_queue():
    out = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "jobs", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=60,
    ).stdout
    for words in ("--db-url", "TUNECACHE_SERVER_URL", "admin token", "audit log"):
        assert words in out, out


# ---- one queue interface over the store and the fleet ---------------------------------------


@pytest.fixture(params=["store", "fleet"])
def queue(request, any_fleet):
    """The same queue (the fleet's database) through each side of the `Fleet` protocol."""
    from tunecache.fleet.client import FleetClient
    from tunecache.fleet.store_fleet import StoreFleet
    from tunecache.store import Store

    if request.param == "store":
        store = Store(any_fleet.db_url)
        yield StoreFleet(store)
        store.close()
    else:
        client = FleetClient(any_fleet.url, any_fleet.tokens["admin"], timeout_s=20)
        yield client
        client.close()


def test_one_queue_interface_over_the_store_and_the_fleet(queue):
    from tunecache.fleet.protocol import ClaimedJob, Fleet, FleetError, Runs
    from tunecache.key import DeviceClass, TuneKey

    q: Fleet = queue
    cpu, h100 = DeviceClass("cpu", 0), DeviceClass("sm_90", 132)
    k1, k2 = TuneKey.from_fields(key(1)), TuneKey.from_fields(key(2))
    assert q.enqueue(k1, max_attempts=2) is not None and q.enqueue(k2, priority=5) is not None
    assert q.active(cpu) == 2 and q.active(h100) == 0
    assert q.claim("w", h100, 30) is None
    job = q.claim("w", cpu, 30, Runs({"matmul.portable": "v1"}, "3.9.0"))
    assert isinstance(job, ClaimedJob) and job.key == k2 and job.attempts == 1 and job.lease_secret
    assert "lease_secret" not in repr(job) and job.lease_secret not in repr(job)
    forged = ClaimedJob(job.id, job.key, job.attempts, job.max_attempts, "tcl_forged")
    assert q.heartbeat(forged, 30) is False and q.complete(forged) is False and q.release(forged) is False
    assert q.heartbeat(job, 30) is True
    assert q.complete(job, tune_seconds=1.0) is True and q.complete(job) is False
    job = q.claim("w", cpu, 30)
    assert job.key == k1 and q.fail(job, "boom", backoff_s=0) is True
    job = q.claim("w", cpu, 30)
    assert job.attempts == 2 and q.fail(job, "boom again") is True
    assert q.statuses([k1.digest, k2.digest, "0" * 64]) == {k1.digest: "failed", k2.digest: "done"}
    assert q.active(cpu) == 0
    listed = q.jobs()
    assert [(j.digest, j.status) for j in listed] == [(k1.digest, "failed"), (k2.digest, "done")]
    assert listed[0].last_error == "boom again" and listed[0].key == k1 and listed[0].not_before is not None
    assert [j.digest for j in q.jobs(status="failed", device=cpu)] == [k1.digest] and q.jobs(device=h100) == []
    assert q.retry(k1.digest).status == "queued"
    with pytest.raises(FleetError, match="done"):
        q.retry(k2.digest)
    job = q.claim("w", cpu, 30)
    assert job.key == k1 and job.attempts == 1 and q.release(job) is True
    q.drop_job(k1.digest)
    with pytest.raises(FleetError, match="no job"):
        q.drop_job(k1.digest)
    assert q.statuses([k1.digest]) == {}


def test_the_worker_holds_its_lease_by_the_secret(any_fleet, tmp_path):
    """A real worker through FleetClient: claims, heartbeats (lease 3 s, so a few), publishes, completes."""
    from tunecache import backends
    from tunecache.key import interpreter_device
    from tunecache.tuning.tuner import make_key

    k = make_key(
        backends.backend_module("matmul", "portable"),
        {"M": 32, "N": 32, "K": 32, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
        interpreter_device(),
    )
    with api(any_fleet, "admin") as c:
        assert c.post("/v1/jobs", json=k.fields()).status_code == 200
        env = host_env(tmp_path, "w", any_fleet.url, any_fleet.tokens["worker"])
        p = start_worker(env, tmp_path / "w.log", "--burst", "--poll-s", "0.2", "--lease-s", "3")
        assert p.wait(300) == 0, (tmp_path / "w.log").read_text()[-3000:]
        log = Path(tmp_path / "w.log").read_text()
        assert "lost the lease" not in log and "answered 403" not in log, log[-3000:]
        job = c.get(f"/v1/jobs/{k.digest}").json()
        assert job["status"] == "done" and job["attempts"] == 1, job
        assert c.get(f"/v1/configs/{k.digest}").json()["source"] == "worker"
        too_long = start_worker(env, tmp_path / "w2.log", "--burst", "--lease-s", "3600")
        assert too_long.wait(60) == 2 and "at most 600 s" in " ".join((tmp_path / "w2.log").read_text().split())


def test_a_pretunes_progress_polls_a_large_manifest_inside_the_rate_limit(any_fleet):
    """`tunecache pretune` asks the status of every job of its manifest each poll: through the
    fleet that is one POST /v1/jobs/statuses per thousand digests, so ten polls of 1500 shapes
    are 20 requests. One GET per digest (15,000) ran into the token's rate limit (200 per 4 s)
    with a few dozen shapes polled each second, which opened the pretune's and its worker's
    circuit breakers and failed the run."""
    from tunecache.fleet.client import FleetClient
    from tunecache.key import TuneKey
    from tunecache.store import Store

    store = Store(any_fleet.db_url)
    keys = [TuneKey.from_fields(key(M)) for M in range(1, 1501)]
    for k in keys[:1200]:
        store.enqueue(k)
    store.close()
    client = FleetClient(any_fleet.url, any_fleet.tokens["read"], timeout_s=20)
    digests = [k.digest for k in keys]
    for _ in range(10):
        assert client.statuses(digests) == {k.digest: "queued" for k in keys[:1200]}
    client.close()
    with httpx.Client(base_url=any_fleet.url, headers={"Authorization": f"Bearer {any_fleet.tokens['read']}"}) as api:
        too_many = api.post("/v1/jobs/statuses", json={"digests": digests[:1] * 1001})
        assert too_many.status_code == 422, too_many.text
        not_a_digest = api.post("/v1/jobs/statuses", json={"digests": ["../../etc"]})
        assert not_a_digest.status_code == 422, not_a_digest.text


def test_a_pretune_of_hundreds_of_shapes_enqueues_them_inside_the_rate_limit(queue, any_fleet):
    """Before its workers start, `tunecache pretune` skips the shapes that have a tuned config and
    enqueues the others, longest first. Through the fleet that is one POST /v1/jobs/batch per
    hundred shapes: 300 shapes are 3 requests, where a lookup and an enqueue per shape (600) ran
    into the token's rate limit (200 per 4 s) and failed the pretune as unreachable."""
    from tunecache.key import TuneKey
    from tunecache.store import Store
    from tunecache.store.records import ConfigRecord
    from tunecache_kernels.spaces import space_for

    keys = [TuneKey.from_fields(key(M)) for M in range(1, 301)]
    store = Store(any_fleet.db_url)
    config = next(iter(space_for(KEY["kernel"])))
    for k in keys[::7]:
        store.put_config(ConfigRecord(k, config, 1.0))
    tuned = {k.digest for k in keys[::7]}
    assert queue.enqueue_missing(keys, priority=3) == tuned
    assert queue.enqueue_missing(keys, priority=3) == tuned  # again: the same jobs, none added
    jobs = store.list_jobs(limit=1000)
    assert sorted(j.digest for j in jobs) == sorted(k.digest for k in keys if k.digest not in tuned)
    assert {j.status for j in jobs} == {"queued"} and {j.priority for j in jobs} == {3}
    with httpx.Client(base_url=any_fleet.url, headers={"Authorization": f"Bearer {any_fleet.tokens['admin']}"}) as api:
        bad = api.post("/v1/jobs/batch", json={"jobs": [key(999), key(998, kernel="matmul.nosuch")]})
        assert bad.status_code == 422 and "jobs[1]" in bad.text and "matmul.nosuch" in bad.text, bad.text
    assert len(store.list_jobs(limit=1000)) == len(jobs)  # nothing of a refused batch is enqueued
    store.close()


def test_one_config_interface_over_the_store_and_the_fleet(queue):
    """Publish, look up, sync, drop and purge answer alike whichever side of the fleet a caller
    holds: the store reached directly keeps a result as the service keeps a worker token's."""
    from tunecache.fleet.protocol import Fleet, FleetError, Published
    from tunecache.key import DeviceClass, TuneKey
    from tunecache.store.records import ConfigRecord, TrialRecord

    q: Fleet = queue
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    slow_cfg = {**cfg, "BLOCK_K": 32}
    k = TuneKey.from_fields(key(7))
    assert q.lookup(k) is None and q.fetch(k) == ("miss", None)
    sent = q.publish(ConfigRecord(k, cfg, 0.25), [TrialRecord(cfg, "ok", 0.25)], tune_seconds=1.0)
    assert isinstance(sent, Published) and sent.won and sent.submission_id
    assert q.lookup(k).config == cfg and q.fetch(k)[0] == "hit"
    slower = q.publish(ConfigRecord(k, slow_cfg, 0.5))
    assert slower.status == "kept_existing" and not slower.won and slower.kept.config == cfg
    got = q.sync(DeviceClass("cpu", 0), "3.9.0", {"matmul.portable": "v1"})
    assert [r.digest for r in got.configs] == [k.digest] and got.configs[0].config == cfg
    before = q.current_generation()
    q.drop(k.digest)
    assert q.lookup(k) is None and q.current_generation() > before
    with pytest.raises(FleetError, match="no tuned config"):
        q.drop(k.digest)
    report = q.purge("nobody", dry_run=True)
    assert report.removed == [] and report.dry_run and report.token_name == "nobody"
