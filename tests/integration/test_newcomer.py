"""What a newcomer meets first: the test suite on a machine without Postgres, and the REST API
refusing what it does not understand instead of answering as if it did."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from support import ROOT

ONE_PG_TEST = "tests/integration/test_store.py::test_schema_is_at_head_after_open[postgres]"


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_without_postgres_its_tests_skip_and_say_why():
    nowhere = "postgresql+psycopg://postgres@127.0.0.1:9/test"  # the discard port: nothing listens
    proc = _pytest(ONE_PG_TEST, TUNECACHE_TEST_PG_URL=nowhere, TUNECACHE_TEST_REQUIRE_PG="0")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 skipped" in proc.stdout and "is not reachable" in proc.stdout and "Running the tests" in proc.stdout
    required = _pytest(ONE_PG_TEST, TUNECACHE_TEST_PG_URL=nowhere, TUNECACHE_TEST_REQUIRE_PG="1")
    assert required.returncode != 0 and "is not reachable" in required.stdout


def test_the_postgres_marker_selects_the_tests_that_need_it():
    proc = _pytest("--collect-only", "-m", "postgres", "tests/integration/test_store.py")
    assert proc.returncode == 0, proc.stdout[-2000:]
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids and all(i.endswith("[postgres]") for i in ids)


def test_an_unknown_query_parameter_is_refused_by_name(clean_fleet):
    headers = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=headers, timeout=10) as api:
        r = api.get("/v1/configs", params={"kernal": "matmul.hopper"})
        assert r.status_code == 422 and "'kernal'" in r.json()["detail"] and "kernel" in r.json()["detail"]
        assert api.get("/v1/configs", params={"kernel": "matmul.hopper"}).status_code == 200


def _cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunecache.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def test_a_shape_typed_wrong_is_named_never_guessed(db_url):
    for shape, words in [
        ("M=64,N=64,K=64", "needs a dtype"),
        ("M=64,N=64,K=64,dtype=float32,a_layout=colum", "a_layout must be row or col"),
        ("M=-4,N=64,K=64,dtype=float32", "M must be an integer >= 1, got -4"),
        ("M=64,N=64,K=64,dtype=float32,BLOCK=3", "unknown key(s) BLOCK"),
    ]:
        proc = _cli("tune", "matmul", "-p", shape)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_key_prints_the_digest_a_library_call_uses(db_url):
    import json

    import torch

    from tunecache import ops
    from tunecache.store import default_store

    ops.matmul(torch.randn(40, 24), torch.randn(24, 36))
    (rec,) = default_store().list_configs()
    proc = _cli("key", "matmul", "-p", "M=40,N=36,K=24,dtype=float32")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["digest"] == rec.digest


def test_ls_fits_80_columns_and_json_has_everything(db_url):
    import json

    _cli("tune", "conv2d_fprop", "-p", "N=2,H=8,W=8,Ci=4,Co=8,R=3,S=3,padding=1,dtype=float32")
    listing = _cli("ls").stdout
    assert "conv2d_fprop.portable" in listing and "N2 8x8 4>8 3x3/s1p1 f32" in listing
    assert all(len(line) <= 80 for line in listing.splitlines()), listing
    (row,) = [json.loads(line) for line in _cli("ls", "--json").stdout.splitlines()]
    assert row["kernel"] == "conv2d_fprop.portable" and row["config"]


def test_version_and_a_tuning_call_says_what_it_does(db_url):
    assert _cli("--version").stdout.startswith("tunecache ")
    code = (
        "import torch; from tunecache import ops; "
        "ops.matmul(torch.randn(40, 24), torch.randn(24, 36)); ops.matmul(torch.randn(40, 24), torch.randn(24, 36))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tunecache: tuning matmul.portable")]
    assert proc.returncode == 0 and len(lines) == 1 and "candidates, roughly" in lines[0], proc.stderr


def test_cli_tune_asks_the_fleet_first_and_publishes(clean_fleet, tmp_path, db_url):
    env = {"TUNECACHE_SERVER_URL": clean_fleet.url, "TUNECACHE_TOKEN": clean_fleet.tokens["worker"]}
    shape = "M=40,N=36,K=24,dtype=float32"

    def tune(url):
        return subprocess.run(
            [sys.executable, "-m", "tunecache.cli", "tune", "matmul", "-p", shape],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **env, "TUNECACHE_DB_URL": url, "COLUMNS": "200"},
        )

    first = tune(f"sqlite:///{tmp_path / 'a.sqlite'}")
    assert first.returncode == 0 and "candidates" in first.stdout, first.stderr
    headers = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=headers, timeout=10) as api:
        assert len(api.get("/v1/configs").json()) == 1, "the tuned result was published"
    second = tune(f"sqlite:///{tmp_path / 'b.sqlite'}")  # another host: the fleet has it
    assert second.returncode == 0 and "already tuned (in the fleet)" in second.stdout, second.stdout
    # and the fleet's configs list and export from any host
    fresh = {**os.environ, **env, "TUNECACHE_DB_URL": f"sqlite:///{tmp_path / 'c.sqlite'}", "COLUMNS": "80"}
    ls = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "ls", "--fleet"], capture_output=True, text=True, timeout=120, env=fresh
    )
    assert ls.returncode == 0 and "matmul.portable" in ls.stdout and f"1 config(s) in {clean_fleet.url}" in ls.stdout
    exp = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "export", "--fleet", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        env=fresh,
    )
    import json

    assert exp.returncode == 0 and len(json.loads(exp.stdout)["configs"]) == 1, exp.stderr


def test_rest_by_shape_as_the_readme_shows_it(clean_fleet, db_url):
    """The README's curl example, run: the best config for a shape typed by hand."""
    import shlex

    from tunecache.key import DeviceClass
    from tunecache.shapes import canonical_problem
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import matmul_hopper as hop

    dev = DeviceClass("sm_90", 132)
    problem = canonical_problem("matmul", {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"})
    config = hop.default_config(problem, dev)
    rec = ConfigRecord(key=make_key(hop, problem, dev), config=config, median_ms=0.2, source="worker")
    admin = {"Authorization": f"Bearer {clean_fleet.tokens['admin']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=admin, timeout=10) as api:
        assert (
            api.post("/v1/import", json={"format": "tunecache-configs/1", "configs": [rec.to_json()]}).json()["stored"]
            == 1
        )
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.strip().startswith("curl") and "/v1/best/" in ln)
    cmd = line.strip().replace("$TOKEN", clean_fleet.tokens["read"]).replace("$URL", clean_fleet.url)
    proc = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout)
    assert got["kernel"] == "matmul.hopper" and got["config"] == config and got["digest"] == rec.digest
    read = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=read, timeout=10) as api:
        miss = api.get(
            "/v1/best/matmul", params={"device": "sm_90:132", "M": 4000, "N": 4096, "K": 4096, "dtype": "bfloat16"}
        )
        assert miss.status_code == 404
        assert "M=4000" in miss.json()["detail"] and f"digest {rec.digest[:12]}" in miss.json()["detail"]
        bad = api.get("/v1/best/matmul", params={"device": "sm_90:132", "M": 4, "N": 4, "K": 4})
        assert bad.status_code == 422 and "needs a dtype" in bad.json()["detail"]
    env = {**os.environ, "TUNECACHE_SERVER_URL": clean_fleet.url, "TUNECACHE_TOKEN": clean_fleet.tokens["read"]}
    q = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunecache.cli",
            "query",
            "matmul",
            "-p",
            "M=4096,N=4096,K=4096,dtype=bfloat16",
            "--device",
            "sm_90:132",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert q.returncode == 0 and json.loads(q.stdout)["digest"] == rec.digest, q.stderr


def test_doctor_checks_the_fleet_url_token_and_scopes(clean_fleet, db_url):
    def doctor(**env):
        return subprocess.run(
            [sys.executable, "-m", "tunecache.cli", "doctor"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "200", **env},
        )

    ok = doctor(TUNECACHE_SERVER_URL=clean_fleet.url, TUNECACHE_TOKEN=clean_fleet.tokens["worker"])
    assert ok.returncode == 0 and "test-worker (scopes: worker)" in ok.stdout and "tune queued jobs" in ok.stdout
    bad = doctor(TUNECACHE_SERVER_URL=clean_fleet.url, TUNECACHE_TOKEN="tc_not-a-token")
    assert bad.returncode == 1 and "refused (401)" in bad.stdout
    away = doctor(TUNECACHE_SERVER_URL="http://127.0.0.1:9", TUNECACHE_TOKEN="tc_x")
    assert away.returncode == 1 and "cannot reach http://127.0.0.1:9" in away.stdout


def test_a_config_is_found_by_the_digest_prefix_ls_shows(clean_fleet):
    from tunecache.key import TuneKey
    from tunecache.store.records import ConfigRecord

    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    recs = [
        ConfigRecord(
            key=TuneKey(
                "matmul.portable",
                "v1",
                "3.9.0",
                "cpu",
                0,
                {"M": m, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
            ),
            config=cfg,
            median_ms=1.0,
            source="worker",
        )
        for m in (64, 65)
    ]
    admin = {"Authorization": f"Bearer {clean_fleet.tokens['admin']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=admin, timeout=10) as api:
        r = api.post("/v1/import", json={"format": "tunecache-configs/1", "configs": [x.to_json() for x in recs]})
        assert r.json()["stored"] == 2, r.text
        got = api.get(f"/v1/configs/{recs[0].digest[:12]}")
        assert got.status_code == 200 and got.json()["digest"] == recs[0].digest
        assert api.get(f"/v1/configs/{recs[0].digest[:7]}").status_code == 422  # too short to be useful
        assert api.get("/v1/configs/00000000").status_code in (404, 409)


def test_a_worker_whose_token_cannot_claim_stops_and_says_which_scope(clean_fleet, tmp_path):
    from support.fleet import host_env

    for scope, words in (("read", "lacks the worker scope"), (None, "no valid token")):
        env = host_env(tmp_path, f"w-{scope}", clean_fleet.url, clean_fleet.tokens[scope] if scope else "tc_nope")
        proc = subprocess.run(
            [sys.executable, "-m", "tunecache.cli", "worker", "--burst", "--poll-s", "0.1"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "COLUMNS": "200"},
        )
        assert proc.returncode == 2 and words in proc.stderr and "--scope worker" in proc.stderr, proc.stderr[-2000:]


def test_token_create_says_which_store_it_wrote_to(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNECACHE_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), COLUMNS="300")
    proc = subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "token", "create", "--scope", "read"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("tc_"), proc.stderr
    assert "TUNECACHE_DB_URL is not set" in proc.stderr and str(tmp_path / "cache") in proc.stderr
    assert "--db-url" in proc.stderr
    named = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunecache.cli",
            "token",
            "create",
            "--scope",
            "read",
            "--name",
            "x",
            "--db-url",
            f"sqlite:///{tmp_path / 'fleet.sqlite'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert named.returncode == 0 and "is not set" not in named.stderr, named.stderr


def test_the_service_logs_each_request(pg_url, tmp_path):
    from support.fleet import Server

    server = Server(pg_url, tmp_path / "server.log", args=("--log-level", "info")).start()
    try:
        httpx.get(f"{server.url}/v1/configs", params={"kernel": "x"}, timeout=10)
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert '"GET /healthz HTTP/1.1" 200' in log and '"GET /v1/configs?kernel=x HTTP/1.1" 401' in log, log[-2000:]
