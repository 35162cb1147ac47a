"""The fleet's trust model through a real `tunecache serve` on loopback, over SQLite and over
Postgres: only worker (and admin) tokens make winners, a publish token's result is a
submission that a worker re-times, provenance is the service's, a claimed time below what the
device class can physically do is a 422 that says why, and `fleet purge` takes back what one
token sent, down to the hosts' copies. Hosts and workers are separate processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import pytest
import torch

from support.fleet import host_env, reset_fleet_tables, run_host, start_worker
from tunecache.key import TuneKey, interpreter_device
from tunecache.shapes import canonical_problem
from tunecache.tuning.tuner import make_key
from tunecache_kernels import matmul_portable as mod

FORMAT = "tunecache-configs/1"
# what a fresh host runs: one library call; prints the config it launched (None: strict and no
# winner) and the rows of its local store
HOST = """
import json, torch
from tunecache import MissingConfig, ops
from tunecache.store import default_store
a, b = torch.randn(40, 24), torch.randn(24, 36)
try:
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    launched = entry.config
except MissingConfig:
    launched = None
print(json.dumps({"config": launched, "local": [[r.source, r.config] for r in default_store().list_configs()]}))
"""


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_fleet(request):
    """The service over each engine of the store: every test here runs on both."""
    return request.getfixturevalue("sqlite_fleet" if request.param == "sqlite" else "fleet")


@pytest.fixture
def svc(any_fleet):
    reset_fleet_tables(any_fleet.db_url)
    from tunecache.fleet import client

    client.reset_clients()
    yield any_fleet
    client.reset_clients()


def api(svc, scope: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.tokens[scope]}"}, timeout=30)


def token(svc, scope: str) -> tuple[str, str]:
    """A token of its own for one test: (name, secret)."""
    from tunecache.store import Store

    name = f"{scope}-{uuid.uuid4().hex[:8]}"
    store = Store(svc.db_url)
    try:
        return name, store.create_token(name, [scope])[0]
    finally:
        store.close()


def host_key() -> TuneKey:
    """The key of the fresh host's call in HOST."""
    return make_key(mod, mod.problem(torch.randn(40, 24), torch.randn(24, 36)), interpreter_device())


def matmul_key(M: int, N: int = 64, K: int = 64) -> TuneKey:
    return make_key(
        mod, canonical_problem("matmul", {"M": M, "N": N, "K": K, "dtype": "float32"}), interpreter_device()
    )


def launchable(key: TuneKey) -> list[dict]:
    """Configs of the key's space that a host on the interpreter accepts (and would launch)."""
    dev = interpreter_device()
    problem = dict(key.problem)
    return mod.prune(list(mod.config_space(problem, dev)), problem, dev)


def result(key: TuneKey, config: dict, median_ms: float, **extra) -> dict:
    return {**key.fields(), "config": config, "median_ms": median_ms, **extra}


def run_worker(svc, tmp_path, name: str) -> str:
    """`tunecache worker --burst` with the worker token until the queue of its class is empty."""
    env = host_env(tmp_path, name, svc.url, svc.tokens["worker"])
    log = tmp_path / f"{name}.log"
    proc = start_worker(env, log, "--burst", "--poll-s", "0.2", "--lease-s", "30")
    try:
        assert proc.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text()


# ---- 1. only the fleet's own tuning hosts make winners --------------------------------------


def test_a_publish_token_cannot_displace_a_workers_winner(svc, tmp_path):
    """The issue's first test: after a worker publishes a winner, a publish token claims 1e-6 ms
    (and then a merely implausible time) for another in-space config of the key, and a fresh
    host with a read token and policy strict still launches the worker's config. The claim
    queues a re-timing, and a worker's own measurement decides."""
    key = host_key()
    with api(svc, "publish") as pub:
        assert pub.post("/v1/jobs", json=key.fields()).status_code == 200  # a host's miss
    assert "1 tuned" in run_worker(svc, tmp_path, "worker")
    with api(svc, "read") as reader:
        honest = reader.get(f"/v1/configs/{key.digest}").json()
    assert honest["source"] == "worker"
    other = next(c for c in launchable(key) if c != honest["config"])  # a host would launch it
    forged = result(
        key, other, 1e-6, source="worker", tuned_by="gpu-node-01:1:gpu0", device_name="NVIDIA H100 80GB HBM3"
    )
    claim = honest["median_ms"] / 25  # far faster than the worker measured, yet physically possible
    with api(svc, "publish") as pub:
        r = pub.post("/v1/configs", json=forged)
        assert r.status_code == 422 and "below what cpu:0 can do" in r.json()["detail"], r.text
        r = pub.post("/v1/configs", json={**forged, "median_ms": claim})
        assert r.status_code == 200, r.text
        answer = r.json()
    assert (answer["accepted"], answer["status"], answer["job"]) == (False, "queued", "queued")
    assert answer["kept"] == honest
    with api(svc, "read") as reader:
        assert reader.get(f"/v1/configs/{key.digest}").json() == honest
        job = reader.get(f"/v1/jobs/{key.digest}").json()
        sub = reader.get(f"/v1/configs/{key.digest}/submissions").json()[-1]
    assert job["status"] == "queued" and job["retime"], job
    # provenance is the service's: the forged source, host and GPU are not kept
    assert (
        sub["config"],
        sub["source"],
        sub["tuned_by"],
        sub["device_name"],
        sub["submitted_by"],
        sub["accepted"],
    ) == (other, "submission", "test-publish", "", "test-publish", False)

    fresh = run_host(HOST, host_env(tmp_path, "fresh", svc.url, svc.tokens["read"], TUNECACHE_MISS_POLICY="strict"))
    assert fresh["config"] == honest["config"], "the host launched the publish token's config"
    assert fresh["local"] == [["fleet", honest["config"]]]

    # the re-timing: a worker tunes the key although it has a winner; what it measures decides
    log = run_worker(svc, tmp_path, "worker2")
    assert "1 tuned" in log, log[-2000:]
    with api(svc, "read") as reader:
        after = reader.get(f"/v1/configs/{key.digest}").json()
        job = reader.get(f"/v1/jobs/{key.digest}").json()
        subs = reader.get(f"/v1/configs/{key.digest}/submissions").json()
    assert job["status"] == "done"
    assert after["source"] == "worker" and after["median_ms"] != claim
    assert [s["submitted_by"] for s in subs].count("test-worker") == 2, "the worker published its re-timing"


def test_a_publish_tokens_result_is_never_a_winner_and_provenance_is_the_services(svc):
    key = matmul_key(64)
    first, second, third = launchable(key)[:3]
    with api(svc, "publish") as pub:
        a = pub.post(
            "/v1/configs", json=result(key, first, 2.0, source="worker", tuned_by="forged", device_name="forged")
        ).json()
        b = pub.post("/v1/configs", json=result(key, second, 1.0)).json()
    # no winner yet: still none (no provisional winners), one job queued for a worker to tune
    assert (a["accepted"], a["status"], a["kept"], a["job"]) == (False, "queued", None, "queued")
    assert (b["accepted"], b["status"], b["kept"], b["job"]) == (False, "queued", None, "queued")
    with api(svc, "read") as reader:
        assert reader.get(f"/v1/configs/{key.digest}").status_code == 404
        jobs = reader.get("/v1/jobs").json()
    assert [(j["digest"], j["status"], j["retime"]) for j in jobs] == [(key.digest, "queued", False)]

    with api(svc, "worker") as worker:  # the fleet's own host: its word on who tuned it, on what, how
        won = worker.post(
            "/v1/configs",
            json=result(key, first, 2.0, source="fleet", tuned_by="gpu-7:12:gpu0", device_name="NVIDIA H100"),
        ).json()
        noise = worker.post("/v1/configs", json=result(key, second, 1.98, source="pretune")).json()
        faster = worker.post("/v1/configs", json=result(key, second, 1.0, source="inline")).json()
    assert (won["accepted"], won["status"]) == (True, "won")
    assert (won["kept"]["source"], won["kept"]["tuned_by"], won["kept"]["device_name"]) == (
        "worker",
        "gpu-7:12:gpu0",
        "NVIDIA H100",
    ), "a source that is not a way of tuning is the service's"
    assert (noise["accepted"], noise["status"], noise["kept"]["config"]) == (False, "kept_existing", first)
    assert (faster["accepted"], faster["status"], faster["kept"]["tuned_by"]) == (True, "won", "test-worker")

    with api(svc, "admin") as admin:
        by_admin = admin.post("/v1/configs", json=result(key, third, 0.5, source="worker")).json()
        imported = admin.post(
            "/v1/import",
            json={
                "format": FORMAT,
                "configs": [
                    result(matmul_key(128), first, 3.0, source="worker", tuned_by="h:1:gpu0", device_name="NVIDIA A100")
                ],
            },
        )
        listed = {c["problem"]["M"]: c for c in admin.get("/v1/configs").json()}
        subs = admin.get(f"/v1/configs/{key.digest}/submissions").json()
    assert by_admin["kept"]["source"] == "admin" and by_admin["kept"]["tuned_by"] == "test-admin"
    assert imported.json()["stored"] == 1, imported.text
    assert (listed[128]["source"], listed[128]["tuned_by"], listed[128]["device_name"]) == (
        "import",
        "h:1:gpu0",
        "NVIDIA A100",
    ), "an import keeps the provenance of its export"
    assert [(s["source"], s["tuned_by"], s["device_name"], s["accepted"]) for s in subs] == [
        ("submission", "test-publish", "", False),
        ("submission", "test-publish", "", False),
        ("worker", "gpu-7:12:gpu0", "NVIDIA H100", True),
        ("pretune", "test-worker", "", False),
        ("inline", "test-worker", "", True),
        ("admin", "test-admin", "", True),
    ]


def test_a_winner_is_retimed_once_per_claim_that_beats_it(svc):
    from tunecache.store import Store, TuningJobRow

    key = matmul_key(64)
    honest, other = launchable(key)[:2]
    digest = key.digest

    def submit(ms):
        with api(svc, "publish") as pub:
            return pub.post("/v1/configs", json=result(key, other, ms)).json()

    def job():
        with api(svc, "read") as reader:
            return reader.get(f"/v1/jobs/{digest}").json()

    with api(svc, "worker") as worker:
        assert worker.post("/v1/configs", json=result(key, honest, 1.0)).json()["status"] == "won"
    assert [submit(ms)["status"] for ms in (0.99, 2.0)] == ["recorded", "recorded"], "no faster by the margin"
    with api(svc, "read") as reader:
        assert reader.get("/v1/jobs").json() == [], "nothing to re-time"
    first = submit(0.5)
    assert (first["status"], first["job"], first["kept"]["config"]) == ("queued", "queued", honest)
    assert job()["retime"] and job()["status"] == "queued"
    assert submit(0.4)["status"] == "queued", "the re-timing under way covers a second claim"
    store = Store(svc.db_url)  # a worker re-timed the key and found nothing faster
    with store._write() as s:
        s.query(TuningJobRow).update({"status": "done"})
    store.close()
    again = submit(0.3)
    assert (again["status"], again["job"]) == ("recorded", None), "this winner was re-timed already"
    assert job()["status"] == "done"
    with api(svc, "worker") as worker:  # a worker's measurement replaces the winner
        assert worker.post("/v1/configs", json=result(key, other, 0.9)).json()["status"] == "won"
    assert submit(0.3)["status"] == "queued", "a new winner may be re-timed"
    assert job()["status"] == "queued" and job()["retime"]
    with api(svc, "read") as reader:
        assert reader.get(f"/v1/configs/{digest}").json()["tuned_by"] == "test-worker"


# ---- 2. a physical floor ------------------------------------------------------------------


def _mm(M, N, K, dtype="bfloat16"):
    return canonical_problem("matmul", {"M": M, "N": N, "K": K, "dtype": dtype})


def _conv(op):
    return canonical_problem(
        op, {"N": 256, "H": 56, "W": 56, "Ci": 256, "Co": 256, "R": 3, "S": 3, "padding": 1, "dtype": "bfloat16"}
    )


def _first(kernel):
    from tunecache_kernels.spaces import space_for

    return next(iter(space_for(kernel)))


USER_CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1}
# (name, kernel, arch, sm_count, problem, a claim below the floor, one above, words the 422 says)
FLOORS = [
    (
        "H100 SXM compute-bound",
        "matmul.portable",
        "sm_90",
        132,
        _mm(8192, 8192, 8192),
        1.0,
        1.2,
        ["at least 1.11 ms", "990 TFLOP/s"],
    ),
    ("H100 PCIe", "matmul.portable", "sm_90", 114, _mm(8192, 8192, 8192), 1.4, 1.5, ["1.45 ms", "756 TFLOP/s"]),
    ("memory-bound", "matmul.portable", "sm_90", 132, _mm(16384, 16384, 16), 0.05, 0.12, ["0.11 ms", "4.9 TB/s"]),
    ("B200", "matmul.portable", "sm_100", 148, _mm(8192, 8192, 8192), 0.4, 0.5, ["0.44 ms", "2500 TFLOP/s"]),
    (
        "unknown class",
        "matmul.portable",
        "sm_120",
        84,
        _mm(8192, 8192, 8192),
        0.1,
        0.12,
        ["0.11 ms", "unknown device class"],
    ),
    ("conv fprop", "conv2d_fprop.portable", "sm_90", 132, _conv("conv2d_fprop"), 0.5, 1.0, ["0.957 ms"]),
    ("conv wgrad", "conv2d_wgrad.portable", "sm_100", 148, _conv("conv2d_wgrad"), 0.3, 0.5, ["0.379 ms"]),
    ("interpreter", "matmul.portable", "cpu", 0, _mm(64, 64, 64, "float32"), 1e-6, 2e-3, ["at least 0.001 ms"]),
    ("smallest double", "matmul.portable", "cpu", 0, _mm(64, 64, 64, "float32"), 5e-324, 1.0, ["0.001 ms"]),
    (
        "user kernel",
        "triton:mymodels.fused_gelu",
        "sm_90",
        132,
        {"n": 1 << 30, "dtype": "bfloat16"},
        5e-4,
        2e-3,
        ["no model of the work", "0.001 ms"],
    ),
]


@pytest.mark.parametrize("name,kernel,arch,sms,problem,below,above,words", FLOORS, ids=[f[0] for f in FLOORS])
def test_a_time_below_the_physical_floor_is_a_422_that_says_why(
    svc, name, kernel, arch, sms, problem, below, above, words
):
    config = USER_CONFIG if kernel.startswith("triton:") else _first(kernel)
    body = {
        "kernel": kernel,
        "kernel_version": "v1",
        "triton_version": "3.4.0",
        "arch": arch,
        "sm_count": sms,
        "problem": problem,
        "config": config,
    }
    with api(svc, "worker") as worker:  # even the most trusted token
        r = worker.post("/v1/configs", json={**body, "median_ms": below})
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "below what" in detail and f"{arch}:{sms}" in detail and all(w in detail for w in words), detail
        assert worker.get("/v1/configs").json() == [], "nothing is stored"
        ok = worker.post("/v1/configs", json={**body, "median_ms": above})
        assert ok.status_code == 200 and ok.json()["accepted"], ok.text


def test_an_import_below_the_floor_is_rejected_and_says_why(svc):
    key = matmul_key(64)
    good, bad = result(key, launchable(key)[0], 0.5), result(matmul_key(128), launchable(key)[0], 1e-5)
    with api(svc, "admin") as admin:
        report = admin.post("/v1/import", json={"format": FORMAT, "configs": [good, bad]}).json()
    assert report["stored"] == 1 and len(report["rejected"]) == 1
    assert report["rejected"][0].startswith("#1: median_ms=1e-05 is below what cpu:0 can do"), report


def test_the_work_model_agrees_with_the_kernels_own_flops():
    from tunecache.store import floor
    from tunecache_kernels import problems

    for op, problem, flops in (
        ("matmul", _mm(4096, 2048, 1024), problems.matmul_flops),
        ("conv2d_fprop", _conv("conv2d_fprop"), problems.conv2d_flops),
        ("conv2d_wgrad", _conv("conv2d_wgrad"), problems.conv2d_flops),
    ):
        got, nbytes = floor.work(f"{op}.hopper", problem)
        assert got == flops(problem), op
        assert nbytes > 0
    assert floor.work("matmul.hopper", _mm(4096, 2048, 1024)) == (
        2.0 * 4096 * 2048 * 1024,
        2.0 * (4096 * 1024 + 1024 * 2048 + 4096 * 2048),
    )
    # no model: a user kernel, a problem without its sizes, sizes no one runs -> the absolute floor
    for kernel, problem in (
        ("triton:m.k", _mm(64, 64, 64)),
        ("matmul.hopper", {"dtype": "bfloat16"}),
        ("matmul.hopper", {**_mm(64, 64, 64), "M": 2**40}),
        ("matmul.hopper", {**_mm(64, 64, 64), "M": True}),
    ):
        assert floor.work(kernel, problem) is None
        assert floor.floor(kernel, "sm_90", 132, problem).ms == floor.ABSOLUTE_FLOOR_MS


# ---- 3. revocation reaches hosts: fleet purge --------------------------------------------


def test_purge_removes_a_tokens_winners_requeues_them_and_reaches_hosts(svc, tmp_path):
    from tunecache.store import Store

    rogue, rogue_secret = token(svc, "worker")  # a worker token gone bad (a broken GPU, a leak)
    key, other, kept_key = host_key(), matmul_key(64), matmul_key(128)
    bad = launchable(key)[-1]
    rogue_api = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {rogue_secret}"}, timeout=30)
    with rogue_api, api(svc, "worker") as honest:
        assert rogue_api.post("/v1/configs", json=result(key, bad, 50.0)).json()["status"] == "won"
        assert rogue_api.post("/v1/configs", json=result(other, bad, 50.0)).json()["status"] == "won"
        assert honest.post("/v1/configs", json=result(kept_key, launchable(kept_key)[0], 5.0)).json()["accepted"]
        assert rogue_api.post("/v1/configs", json=result(kept_key, bad, 9.0)).json()["status"] == "kept_existing"
    env = host_env(tmp_path, "host", svc.url, svc.tokens["read"], TUNECACHE_MISS_POLICY="strict")
    assert run_host(HOST, env)["config"] == bad, "the host copied the rogue winner"

    with api(svc, "admin") as admin:
        before = admin.get("/v1/generation").json()["generation"]
        dry = admin.post("/v1/admin/purge", json={"token_name": rogue, "dry_run": True}).json()
        assert dry["dry_run"] and sorted(c["digest"] for c in dry["removed"]) == sorted([key.digest, other.digest])
        assert admin.get(f"/v1/configs/{key.digest}").status_code == 200, "a dry run changes nothing"
        r = admin.post("/v1/admin/purge", json={"token_name": rogue})
        assert r.status_code == 200, r.text
        report = r.json()
        assert sorted(c["digest"] for c in report["removed"]) == sorted([key.digest, other.digest])
        assert report["jobs"] == {key.digest: "queued", other.digest: "queued"}
        assert report["submissions_removed"] == 3 and report["generation"] > before
        assert admin.get(f"/v1/configs/{key.digest}").status_code == 404
        assert admin.get(f"/v1/configs/{other.digest}").status_code == 404
        assert admin.get(f"/v1/configs/{kept_key.digest}").json()["tuned_by"] == "test-worker"
        assert {s["submitted_by"] for s in admin.get(f"/v1/configs/{kept_key.digest}/submissions").json()} == {
            "test-worker"
        }
        assert admin.get(f"/v1/jobs/{key.digest}").json()["status"] == "queued"
        assert admin.post("/v1/admin/purge", json={"token_name": rogue}).json()["removed"] == []
    with api(svc, "worker") as w:
        assert w.post("/v1/admin/purge", json={"token_name": rogue}).status_code == 403
    store = Store(svc.db_url)
    try:
        (row, *_) = store.audit_log(action="config.purge")
        assert row.actor == "test-admin" and row.target == f"token:{rogue}"
    finally:
        store.close()
    # the host's next process sees the generation move, finds the winner gone and drops its copy
    again = run_host(HOST, env)
    assert again["config"] is None and again["local"] == [], again


def test_fleet_purge_on_the_command_line(svc, tmp_path):
    from tunecache.store import Store

    rogue, secret = token(svc, "worker")
    key = matmul_key(64)
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as w:
        assert w.post("/v1/configs", json=result(key, launchable(key)[0], 3.0)).json()["accepted"]
    with api(svc, "read") as reader:
        before = reader.get("/v1/generation").json()["generation"]

    def purge(*args):
        env = {**os.environ, "COLUMNS": "200"}
        env.pop("TUNECACHE_SERVER_URL", None)
        return subprocess.run(
            [sys.executable, "-m", "tunecache.cli", "fleet", "purge", "--token", rogue, "--db-url", svc.db_url, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    dry = purge("--dry-run")
    assert dry.returncode == 0 and f"would remove 1 winner(s) and 1 submission(s) of token {rogue!r}" in dry.stdout
    done = purge()
    assert done.returncode == 0, done.stderr
    assert f"removed 1 winner(s) and 1 submission(s) of token {rogue!r}; 1 key(s) queued" in done.stdout, done.stdout
    assert key.digest[:12] in done.stdout
    with api(svc, "read") as reader:
        assert reader.get(f"/v1/configs/{key.digest}").status_code == 404
        assert reader.get(f"/v1/jobs/{key.digest}").json()["status"] == "queued"
        assert reader.get("/v1/generation").json()["generation"] > before
    store = Store(svc.db_url)
    try:
        (row, *_) = store.audit_log(action="config.purge")
        assert row.actor.startswith("cli:") and row.details["removed"] == [key.digest]
    finally:
        store.close()
    assert "removed 0 winner(s)" in purge().stdout


def test_winners_stored_before_the_upgrade_are_purged_by_their_latest_accepted_submission(empty_db_url):
    """Winners that publish tokens made before this trust model: the upgrade links each winner
    to its key's latest accepted submission, so `fleet purge` finds them."""
    from sqlalchemy import JSON, bindparam, create_engine, text

    from tunecache.store import Store
    from tunecache.store.migrate import upgrade

    engine = create_engine(empty_db_url)
    upgrade(engine, "0003")
    key = matmul_key(64)
    fields = {**key.fields(), "problem": dict(key.problem), "config": launchable(key)[0], "digest": key.digest}
    cols = (
        "digest, kernel, kernel_version, triton_version, arch, sm_count, device_name, problem, config, "
        "median_ms, candidates, tuned_by, tuned_at, source"
    )
    vals = (
        ":digest, :kernel, :kernel_version, :triton_version, :arch, :sm_count, '', :problem, :config, "
        ":median_ms, 0, 'h:1', CURRENT_TIMESTAMP, 'inline'"
    )

    def insert(sql):
        return text(sql).bindparams(bindparam("problem", type_=JSON), bindparam("config", type_=JSON))

    with engine.begin() as conn:
        conn.execute(insert(f"INSERT INTO tuned_configs ({cols}) VALUES ({vals})"), {**fields, "median_ms": 1.0})
        for who, ms, accepted in (
            ("honest-worker", 2.0, True),
            ("old-publish", 1.5, False),
            ("old-publish", 1.0, True),
        ):
            conn.execute(
                insert(
                    f"INSERT INTO submissions ({cols}, submitted_by, accepted, created_at) VALUES "
                    f"({vals}, :who, :accepted, CURRENT_TIMESTAMP)"
                ),
                {**fields, "median_ms": ms, "who": who, "accepted": accepted},
            )
    engine.dispose()
    store = Store(empty_db_url)  # migrates to head
    try:
        assert store.purge_token("honest-worker").removed == [], "its winner was replaced since"
        report = store.purge_token("old-publish")
        assert [r.digest for r in report.removed] == [key.digest] and report.submissions == 2
        assert store.get_config(key.digest) is None and store.get_job(key.digest).status == "queued"
    finally:
        store.close()
