"""The service through its HTTP surface: a real uvicorn on loopback over a real Postgres."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from support.fleet import Server, result_body
from tunecache.store.migrate import head_revision

PROBLEM = {"M": 64, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"}
CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def result(median_ms=1.0, config=None, **key):
    return result_body(median_ms, config or CONFIG, PROBLEM, **key)


def key_of(body):
    from tunecache.key import TuneKey

    return TuneKey.from_fields(body)


def client(fleet, scope="admin"):
    headers = {"Authorization": f"Bearer {fleet.tokens[scope]}"} if scope else {}
    return httpx.Client(base_url=fleet.url, headers=headers, timeout=10)


# ---- publish: the faster result wins, every submission is recorded ----------------------


def test_two_publishes_keep_the_faster_and_record_both(clean_fleet):
    # a worker token: only the fleet's own tuning hosts make winners (tests/integration/test_fleet_trust.py)
    with client(clean_fleet, "worker") as api:
        first = api.post("/v1/configs", json=result(1.0))
        assert first.status_code == 200, first.text
        assert first.json()["accepted"]
        other = dict(CONFIG, BLOCK_M=16)
        noise = api.post("/v1/configs", json=result(0.99, other))  # 1% faster: noise, not a win
        assert noise.status_code == 200 and not noise.json()["accepted"]
        assert noise.json()["kept"]["config"] == CONFIG
        faster = api.post("/v1/configs", json=result(0.5, other))
        assert faster.json()["accepted"] and faster.json()["kept"]["median_ms"] == 0.5
        digest = key_of(result()).digest
        stored = api.get(f"/v1/configs/{digest}").json()
        subs = api.get(f"/v1/configs/{digest}/submissions").json()
    assert stored["config"] == other and stored["median_ms"] == 0.5
    assert [(s["median_ms"], s["accepted"]) for s in subs] == [(1.0, True), (0.99, False), (0.5, True)]
    assert {s["submitted_by"] for s in subs} == {"test-worker"}


def test_default_and_vendor_times_are_published_with_the_result(clean_fleet):
    """A result's default_ms and vendor_ms (the untuned default config's and the vendor op's
    times, from the same run) are kept with its submission; a worker's result that wins
    carries them to the winner, and every answer about the winner returns them."""
    from tunecache.fleet.client import FleetClient

    body = result(1.0, default_ms=1.8, vendor_ms=0.9)
    digest = key_of(body).digest
    with client(clean_fleet, "publish") as api:  # a submission: recorded with its times, the key queued
        claimed = api.post("/v1/configs", json=result(0.8, default_ms=2.5))
        assert claimed.status_code == 200 and claimed.json()["status"] == "queued", claimed.text
    with client(clean_fleet, "worker") as api:
        r = api.post("/v1/configs", json=body)
        assert r.status_code == 200 and r.json()["accepted"], r.text
        assert (r.json()["kept"]["default_ms"], r.json()["kept"]["vendor_ms"]) == (1.8, 0.9)
        stored = api.get(f"/v1/configs/{digest}").json()
        looked_up = api.post(
            "/v1/lookup",
            json={k: body[k] for k in ("kernel", "kernel_version", "triton_version", "arch", "sm_count", "problem")},
        ).json()
        listed = api.get("/v1/configs").json()
        exported = api.get("/v1/export").json()["configs"]
        subs = api.get(f"/v1/configs/{digest}/submissions").json()
    assert (stored["default_ms"], stored["vendor_ms"]) == (1.8, 0.9) and looked_up == stored
    assert [(c["default_ms"], c["vendor_ms"]) for c in listed + exported] == [(1.8, 0.9)] * 2
    assert [(s["median_ms"], s["default_ms"], s["vendor_ms"], s["accepted"]) for s in subs] == [
        (0.8, 2.5, None, False),
        (1.0, 1.8, 0.9, True),
    ]
    rec = FleetClient(clean_fleet.url, clean_fleet.tokens["read"]).lookup(key_of(body))
    assert rec is not None and (rec.default_ms, rec.vendor_ms) == (1.8, 0.9)
    with client(clean_fleet, "worker") as api:  # a new winner that measured neither: null, not the old times
        assert api.post("/v1/configs", json=result(0.5, dict(CONFIG, BLOCK_M=16))).json()["accepted"]
        after = api.get(f"/v1/configs/{digest}").json()
    assert (after["median_ms"], after["default_ms"], after["vendor_ms"]) == (0.5, None, None)


def test_lookup_by_digest_and_by_key_fields(clean_fleet):
    with client(clean_fleet, "worker") as api:
        api.post("/v1/configs", json=result(1.0))
    body = result()
    key = {k: body[k] for k in ("kernel", "kernel_version", "triton_version", "arch", "sm_count", "problem")}
    with client(clean_fleet, "read") as api:
        by_digest = api.get(f"/v1/configs/{key_of(body).digest}")
        by_fields = api.post("/v1/lookup", json=key)
        miss = api.post("/v1/lookup", json={**key, "sm_count": 132})
        listed = api.get("/v1/configs", params={"kernel": "matmul.portable"})
    assert by_digest.status_code == 200 and by_fields.status_code == 200
    assert by_digest.json() == by_fields.json()
    assert by_digest.json()["digest"] == key_of(body).digest
    assert miss.status_code == 404 and "no tuned config" in miss.json()["detail"]
    assert [c["digest"] for c in listed.json()] == [key_of(body).digest]


# ---- bad input: a clear 4xx, never a 5xx, nothing stored is lost ------------------------


BAD_PUBLISHES = [
    ("malformed JSON", b'{"kernel": "matmul.portable", ', "not valid JSON"),
    ("not an object", b"[1, 2, 3]", "valid dictionary"),
    ("unknown kernel", result(kernel="matmul.nosuchbackend"), "unknown kernel"),
    ("config outside the space", result(config=dict(CONFIG, BLOCK_M=48)), "BLOCK_M=48 is outside the space"),
    ("config missing a parameter", result(config={"BLOCK_M": 32}), "missing"),
    ("config with an extra parameter", result(config=dict(CONFIG, EVIL=1)), "not a parameter"),
    ("negative time", result(median_ms=-1), "greater than 0"),
    ("NaN time", b'{"median_ms": NaN}', None),
    ("zero default time", result(default_ms=0), "greater than 0"),
    ("negative vendor time", result(vendor_ms=-1.5), "greater than 0"),
    ("default time as a string", result(default_ms="1.5"), "default_ms"),
    ("absurd vendor time", result(vendor_ms=1e300), "less than or equal"),
    ("NUL in a string", result(tuned_by="a\x00b"), "NUL"),
    ("bad arch", result(arch="gfx90a"), "arch"),
    ("digest of another key", result(digest="0" * 64), "does not match"),
    ("unknown field", dict(result(), admin=True), "Extra inputs"),
    ("huge sm_count", result(sm_count=2**40), "sm_count"),
]


@pytest.mark.parametrize("name,body,message", BAD_PUBLISHES, ids=[b[0] for b in BAD_PUBLISHES])
def test_bad_publish_is_a_clear_422_and_changes_nothing(clean_fleet, name, body, message):
    with client(clean_fleet, "worker") as api:  # a token whose results make winners
        assert api.post("/v1/configs", json=result(1.0)).status_code == 200
        digest = key_of(result()).digest
        before = api.get(f"/v1/configs/{digest}").json()
        if isinstance(body, bytes):
            r = api.post("/v1/configs", content=body, headers={"Content-Type": "application/json"})
        else:
            if body["median_ms"] == 1.0:
                body = dict(body, median_ms=1e-2)  # a bad result that would otherwise win by a mile
            r = api.post("/v1/configs", json=body)
        assert r.status_code == 422, (r.status_code, r.text)
        detail = r.json()["detail"]
        assert isinstance(detail, str) and detail
        if message:
            assert message in detail, detail
        assert api.get(f"/v1/configs/{digest}").json() == before
        assert len(api.get(f"/v1/configs/{digest}/submissions").json()) == 1


def test_oversized_body_is_413(clean_fleet):
    big = result(1.0, tuned_by="x")
    big["trials"] = [{"config": CONFIG, "status": "ok", "median_ms": 1.0, "error": "e" * 3000}] * 400  # ~1.3 MB
    with client(clean_fleet, "publish") as api:
        r = api.post("/v1/configs", json=big)
        assert r.status_code == 413 and "over the limit" in r.json()["detail"]

        def chunks():  # no Content-Length: the limit still holds
            data = json.dumps(big).encode()
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        r = api.post("/v1/configs", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert api.get("/v1/configs").json() == []


def test_auth_scopes(clean_fleet):
    body = result(1.0)
    digest = key_of(body).digest
    with client(clean_fleet, None) as anon:
        r = anon.post("/v1/configs", json=body)
        assert r.status_code == 401 and "missing token" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert anon.get(f"/v1/configs/{digest}").status_code == 401, "anonymous reads are off by default"
        wrong = anon.post("/v1/configs", json=body, headers={"Authorization": "Bearer tc_not-a-real-token"})
        assert wrong.status_code == 401 and "invalid" in wrong.json()["detail"]
    with client(clean_fleet, "read") as reader:
        r = reader.post("/v1/configs", json=body)
        assert r.status_code == 403 and "'publish'" in r.json()["detail"]
        assert reader.get(f"/v1/configs/{digest}").status_code == 404
    with client(clean_fleet, "publish") as publisher:
        assert publisher.post("/v1/configs", json=body).status_code == 200
        claim = publisher.post("/v1/jobs/claim", json={"owner": "w", "arch": "cpu", "sm_count": 0})
        assert claim.status_code == 403
        assert publisher.delete(f"/v1/configs/{digest}").status_code == 403
    with client(clean_fleet, "worker") as worker:
        assert worker.post("/v1/configs", json=result(0.5)).status_code == 200  # worker implies publish
        assert worker.post("/v1/import", json={"format": "tunecache-configs/1", "configs": []}).status_code == 403


def test_revoked_token_is_refused(clean_fleet):
    from tunecache.store import Store

    store = Store(clean_fleet.db_url)
    secret, _ = store.create_token("short-lived", ["publish"])
    assert store.revoke_token("short-lived") == 1
    store.close()
    with httpx.Client(base_url=clean_fleet.url, headers={"Authorization": f"Bearer {secret}"}) as api:
        r = api.post("/v1/configs", json=result(1.0))
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_anonymous_reads_only_when_configured(pg_url, tmp_path, clean_fleet):
    server = Server(pg_url, tmp_path / "anon.log", anonymous_read=True).start()
    try:
        with client(clean_fleet, "worker") as api:
            api.post("/v1/configs", json=result(1.0))
        with httpx.Client(base_url=server.url) as anon:
            assert anon.get(f"/v1/configs/{key_of(result()).digest}").status_code == 200
            assert anon.post("/v1/configs", json=result(0.1)).status_code == 401, "writes always need a token"
            assert (
                anon.post(
                    "/v1/jobs", json={k: v for k, v in result().items() if k not in ("config", "median_ms")}
                ).status_code
                == 401
            )
    finally:
        server.stop()


# ---- the queue over HTTP ---------------------------------------------------------------


def test_job_lifecycle(clean_fleet):
    key = {k: v for k, v in result().items() if k not in ("config", "median_ms")}
    with client(clean_fleet, "worker") as api:
        first = api.post("/v1/jobs", json=key).json()
        again = api.post("/v1/jobs", json=key).json()
        assert first["id"] == again["id"] and first["status"] == "queued", "one active job per digest"
        assert api.post("/v1/jobs", json={**key, "kernel": "nope.nope"}).status_code == 422
        other = api.post("/v1/jobs/claim", json={"owner": "h100", "arch": "sm_90", "sm_count": 132}).json()
        assert other["job"] is None, "a worker claims only jobs of its device class"
        stale = api.post(
            "/v1/jobs/claim",
            json={"owner": "w1", "arch": "cpu", "sm_count": 0, "kernel_versions": {"matmul.portable": "v0"}},
        ).json()
        assert stale["job"] is None, "a worker on other kernel code does not claim the job"
        claimed = api.post(
            "/v1/jobs/claim",
            json={
                "owner": "w1",
                "arch": "cpu",
                "sm_count": 0,
                "lease_s": 30,
                "kernel_versions": {"matmul.portable": "v1"},
            },
        ).json()
        job, lease = claimed["job"], claimed["lease_secret"]
        assert job["id"] == first["id"] and job["status"] == "running" and job["lease_owner"] == "w1"
        assert api.post(f"/v1/jobs/{job['id']}/heartbeat", json={"lease_secret": lease}).status_code == 200
        # the owner's name holds nothing: only the claim's secret does
        lost = api.post(f"/v1/jobs/{job['id']}/heartbeat", json={"owner": "w1", "lease_secret": "tcl_guess"})
        assert lost.status_code == 409 and "not held by this lease secret" in lost.json()["detail"]
        assert (
            api.post(
                f"/v1/jobs/{job['id']}/fail", json={"lease_secret": lease, "error": "boom", "backoff_s": 0}
            ).json()["status"]
            == "queued"
        )
        claimed = api.post("/v1/jobs/claim", json={"owner": "w1", "arch": "cpu", "sm_count": 0}).json()
        job, lease = claimed["job"], claimed["lease_secret"]
        assert job["attempts"] == 2 and job["last_error"] == "boom"
        done = api.post(f"/v1/jobs/{job['id']}/complete", json={"lease_secret": lease, "tune_seconds": 12.5})
        assert done.status_code == 200 and done.json()["status"] == "done"
        assert api.post(f"/v1/jobs/{job['id']}/complete", json={"lease_secret": lease}).status_code == 409
        assert api.get("/v1/jobs/stats").json() == {"queued": 0, "running": 0, "done": 1, "failed": 0, "quarantined": 0}
        assert api.get(f"/v1/jobs/{first['digest']}").json()["status"] == "done"
        assert api.post("/v1/jobs/99999/complete", json={"lease_secret": lease}).status_code == 409
        assert api.post(f"/v1/jobs/{2**40}/complete", json={"lease_secret": lease}).status_code == 422


def test_retries_with_backoff_then_failed_with_the_error_kept(clean_fleet):
    key = {k: v for k, v in result().items() if k not in ("config", "median_ms")}
    with client(clean_fleet, "worker") as api:
        api.post("/v1/jobs", json={**key, "max_attempts": 2})
        claimed = api.post("/v1/jobs/claim", json={"owner": "w", "arch": "cpu", "sm_count": 0}).json()
        r = api.post(
            f"/v1/jobs/{claimed['job']['id']}/fail",
            json={"lease_secret": claimed["lease_secret"], "error": "first", "backoff_s": 3600},
        )
        assert r.json()["status"] == "queued"
        assert api.post("/v1/jobs/claim", json={"owner": "w", "arch": "cpu", "sm_count": 0}).json()["job"] is None, (
            "the backoff holds the job back"
        )
    from tunecache.store import Store, TuningJobRow, utcnow

    store = Store(clean_fleet.db_url)  # let the backoff pass without waiting an hour
    with store._write() as s:
        s.query(TuningJobRow).update({"not_before": utcnow()})
    store.close()
    with client(clean_fleet, "worker") as api:
        claimed = api.post("/v1/jobs/claim", json={"owner": "w", "arch": "cpu", "sm_count": 0}).json()
        r = api.post(
            f"/v1/jobs/{claimed['job']['id']}/fail",
            json={"lease_secret": claimed["lease_secret"], "error": "second: CUDA error"},
        )
        assert r.json()["status"] == "failed"
        failed = api.get("/v1/jobs", params={"status": "failed"}).json()
    assert len(failed) == 1 and failed[0]["last_error"] == "second: CUDA error" and failed[0]["attempts"] == 2


# ---- export / import -------------------------------------------------------------------


def test_export_then_import_validates_each_entry(clean_fleet):
    with client(clean_fleet, "admin") as api:
        api.post("/v1/configs", json=result(1.0))
        exported = api.get("/v1/export").json()
        assert exported["format"] == "tunecache-configs/1" and len(exported["configs"]) == 1
        good = dict(exported["configs"][0], problem=dict(PROBLEM, M=128))
        good.pop("digest")
        bad = dict(exported["configs"][0], config=dict(CONFIG, BLOCK_M=7))
        r = api.post(
            "/v1/import", json={"format": "tunecache-configs/1", "configs": [exported["configs"][0], good, bad, "junk"]}
        )
        assert r.status_code == 200, r.text
        report = r.json()
        assert (report["stored"], report["kept"]) == (1, 1)
        assert len(report["rejected"]) == 2 and "BLOCK_M=7" in report["rejected"][0]
        assert len(api.get("/v1/configs").json()) == 2
        assert api.post("/v1/import", json={"format": "other", "configs": []}).status_code == 422


# ---- health, metrics, docs, dashboard ----------------------------------------------------


def test_health_metrics_docs_and_dashboard(clean_fleet):
    with client(clean_fleet, "worker") as api:
        health = api.get("/healthz").json()
        assert health["status"] == "ok" and health["database"] == "postgresql"
        assert health["schema_revision"] == head_revision()
        digest = key_of(result()).digest
        api.get(f"/v1/configs/{digest}")  # a miss
        api.post("/v1/configs", json=result(1.0))
        api.get(f"/v1/configs/{digest}")  # a hit
        key = {k: v for k, v in result().items() if k not in ("config", "median_ms")}
        api.post("/v1/jobs", json=dict(key, sm_count=1))
        claimed = api.post("/v1/jobs/claim", json={"owner": "w", "arch": "cpu", "sm_count": 1}).json()
        api.post(
            f"/v1/jobs/{claimed['job']['id']}/complete",
            json={"lease_secret": claimed["lease_secret"], "tune_seconds": 42.0},
        )
        api.post("/v1/jobs", json=dict(key, sm_count=2))
        text = api.get("/metrics").text

        def value(name):
            m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
            assert m, f"{name} not in /metrics"
            return float(m.group(1))

        assert value("tunecache_lookups_total") >= 2
        assert value("tunecache_lookup_hits_total") >= 1 and value("tunecache_lookup_misses_total") >= 1
        assert value('tunecache_queue_depth{status="queued"}') == 1
        assert value('tunecache_queue_depth{status="done"}') == 1
        assert value("tunecache_tune_seconds_count") >= 1 and value("tunecache_tune_seconds_sum") >= 42
        assert api.get("/docs").status_code == 200
        schema = api.get("/openapi.json").json()
        assert "/v1/configs" in schema["paths"] and "/v1/jobs/claim" in schema["paths"]
        page = api.get("/")
        assert page.status_code == 200 and "tunecache fleet" in page.text and "matmul.portable" in page.text


def test_the_service_imports_neither_torch_nor_triton(tmp_path):
    code = f"""
import sys
from starlette.testclient import TestClient
from tunecache.server.app import create_app
from tunecache.store import Store
url = "sqlite:///{tmp_path / "s.sqlite"}"
secret, _ = Store(url).create_token("t", ["publish"])
api = TestClient(create_app(url))
body = {json.dumps(result(1.0))}
r = api.post("/v1/configs", json=body, headers={{"Authorization": "Bearer " + secret}})
assert r.status_code == 200, r.text
bad = dict(body, config=dict(body["config"], BLOCK_M=48))
assert api.post("/v1/configs", json=bad, headers={{"Authorization": "Bearer " + secret}}).status_code == 422
print(sorted(m for m in ("torch", "triton") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
