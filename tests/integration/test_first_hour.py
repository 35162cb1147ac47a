"""A newcomer's first hour (issue 42): each way in, typed as a user types it, says what it is
doing and what went wrong. Every test runs the installed `tunecache` entry point (or a plain
`python -c`) in a fresh process and reads what the user reads: the words, the exit code, the
port, the files left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TUNECACHE = str(Path(sys.executable).with_name("tunecache"))  # the console script pip installed


def tc(*args: str, cwd=None, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`tunecache ARGS` in a fresh process, its output not a terminal (a log, a CI job)."""
    return subprocess.run(
        [TUNECACHE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **env},
    )


# ---- row 2: the README's spelling, tunecache.nn after a plain `import tunecache` ---------------


def test_tunecache_nn_is_reached_from_a_plain_import():
    code = (
        "import sys, torch, tunecache; print('tunecache.nn' in sys.modules); "
        "m = tunecache.nn.convert(torch.nn.Sequential(torch.nn.Linear(4, 4))); "
        "print(type(m[0]).__module__, callable(tunecache.ops.matmul))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "tunecache.nn", "True"], proc.stdout


# ---- row 3: square brackets are the user's text, never console markup ----------------------


def test_square_brackets_stay_in_error_messages(db_url, tmp_path):
    bad = tc("tune", "matmul", "-p", "M=4,N=4,K=4,dtype=float32,[x]=1")
    assert bad.returncode == 2 and "unknown key(s) [x] for matmul" in bad.stderr, bad.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text("# no shapes yet\n")
    none = tc("pretune", str(empty))
    assert none.returncode == 2 and "no [[shape]] entries" in none.stderr, none.stderr


# ---- row 4: a model file in the current directory, and a mistyped --input ---------------------


def test_manifest_imports_a_model_beside_you_and_names_a_bad_input_size(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(16, 32))\n"
    )
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # the current directory is not on it
    ok = tc("manifest", "--from-model", "mymodels:build", "--input", "16", "-o", "m.toml", cwd=tmp_path, **env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "[[shape]]" in (tmp_path / "m.toml").read_text() and "mymodels:build: 3 distinct problem(s)" in ok.stderr
    bad = tc("manifest", "--from-model", "mymodels:build", "--input", "3,x,16", cwd=tmp_path, **env)
    assert bad.returncode == 2 and "--input: 'x' in '3,x,16' is not a size" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not bad.stdout


# ---- row 1: a host with a publish token is told its result is a submission ------------------


def test_a_publish_tokens_result_is_said_to_wait_for_a_worker(clean_fleet, tmp_path, db_url):
    import httpx

    shape = "M=40,N=36,K=24,dtype=float32"
    fleet = {"TUNECACHE_SERVER_URL": clean_fleet.url, "TUNECACHE_BACKEND": "portable"}
    host = tc(
        "tune",
        "matmul",
        "-p",
        shape,
        TUNECACHE_TOKEN=clean_fleet.tokens["publish"],
        **fleet,
        TUNECACHE_DB_URL=f"sqlite:///{tmp_path / 'host.sqlite'}",
    )
    assert host.returncode == 0, host.stderr[-2000:]
    assert "submitted; the fleet's winner once a worker re-times it" in host.stdout, host.stdout
    assert "worker token" in host.stdout
    read = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    params = {"device": "cpu:0", "M": 40, "N": 36, "K": 24, "dtype": "float32"}
    with httpx.Client(base_url=clean_fleet.url, headers=read, timeout=10) as api:
        miss = api.get("/v1/best/matmul", params=params)
        assert miss.status_code == 404
        assert "(matmul.portable) is queued, attempt 0/3" in miss.json()["detail"], miss.json()
        assert "once a worker of cpu:0 tunes it" in miss.json()["detail"]
        worker = tc(
            "worker",
            "--burst",
            "--poll-s",
            "0.1",
            TUNECACHE_TOKEN=clean_fleet.tokens["worker"],
            **fleet,
            TUNECACHE_DB_URL=f"sqlite:///{tmp_path / 'worker.sqlite'}",
        )
        assert worker.returncode == 0 and "1 job(s) 1 tuned" in worker.stderr, worker.stderr[-2000:]
        hit = api.get("/v1/best/matmul", params=params)
        assert hit.status_code == 200 and hit.json()["kernel"] == "matmul.portable", hit.text
    again = tc(
        "tune",
        "matmul",
        "-p",
        shape,
        "--force",
        TUNECACHE_TOKEN=clean_fleet.tokens["worker"],
        **fleet,
        TUNECACHE_DB_URL=f"sqlite:///{tmp_path / 'other-host.sqlite'}",
    )
    assert again.returncode == 0 and "fleet: published;" in again.stdout, again.stdout


# ---- row 5: `tunecache key`'s JSON is a lookup body; `query` needs no --device where `key` does not


def test_key_json_is_what_lookup_takes_and_query_needs_no_device(clean_fleet, db_url):
    import json

    import httpx

    from tunecache.key import DeviceClass
    from tunecache.shapes import canonical_problem
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import matmul_portable as portable

    shape = "M=48,N=32,K=16,dtype=float32"
    printed = tc("key", "matmul", "-p", shape)
    assert printed.returncode == 0, printed.stderr
    body = json.loads(printed.stdout)
    problem = canonical_problem("matmul", {"M": 48, "N": 32, "K": 16, "dtype": "float32"})
    key = make_key(portable, problem, DeviceClass("cpu", 0))
    assert body["digest"] == key.digest
    rec = ConfigRecord(
        key=key, config=portable.default_config(problem, DeviceClass("cpu", 0)), median_ms=1.0, source="worker"
    )
    admin = {"Authorization": f"Bearer {clean_fleet.tokens['admin']}"}
    read = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    with httpx.Client(base_url=clean_fleet.url, timeout=10) as api:
        imported = api.post(
            "/v1/import", headers=admin, json={"format": "tunecache-configs/1", "configs": [rec.to_json()]}
        )
        assert imported.json()["stored"] == 1, imported.text
        found = api.post("/v1/lookup", headers=read, json=body)
        assert found.status_code == 200 and found.json()["digest"] == key.digest, found.text
        wrong = api.post("/v1/lookup", headers=read, json={**body, "digest": "0" * 64})
        assert wrong.status_code == 422 and "does not match the key's fields" in wrong.text
    fleet = {"TUNECACHE_SERVER_URL": clean_fleet.url, "TUNECACHE_TOKEN": clean_fleet.tokens["read"]}
    asked = tc("query", "matmul", "-p", shape, **fleet)  # no --device on a CPU machine, as `key`
    assert asked.returncode == 0 and json.loads(asked.stdout)["digest"] == key.digest, asked.stderr


# ---- row 7: serve listens where it says, and refuses a port that is not one ------------------


def test_serve_refuses_a_port_past_65535_and_listens_where_it_says(tmp_path):
    import httpx

    from support.fleet import Server

    url = f"sqlite:///{tmp_path / 'fleet.sqlite'}"
    for port in ("99999", "0", "-1"):
        bad = tc("serve", "--port", port, "--db-url", url, timeout=60)
        assert bad.returncode == 2 and f"--port {port} is not a TCP port: give one from 1 to 65535" in bad.stderr
    server = Server(url, tmp_path / "serve.log").start()
    try:
        said = (tmp_path / "serve.log").read_text()
        assert f"tunecache service on http://127.0.0.1:{server.port} over" in said, said
        assert httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=10).status_code == 200
    finally:
        server.stop()


# ---- row 9: a fresh Postgres, without the `test` database the default URL names --------------


def test_the_postgres_tests_run_on_a_server_without_the_test_database():
    from support import ROOT

    missing = "postgresql+psycopg://postgres@127.0.0.1:5432/tc_no_such_database"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + ["tests/integration/test_store.py::test_schema_is_at_head_after_open[postgres]"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "TUNECACHE_TEST_PG_URL": missing, "TUNECACHE_TEST_REQUIRE_PG": "1"},
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]


# ---- row 10: a test run ends quietly, `jobs ls` fits 80 columns, a burst worker gives up -------


def test_a_test_run_ends_without_nanobind_noise():
    from support import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["tests/integration/test_compile_matches_launch.py"],  # its Gluon compiles leave what nanobind reports
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-2000:]
    assert "nanobind" not in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_jobs_ls_fits_80_columns(db_url):
    from tunecache.key import TuneKey
    from tunecache.store import Store

    store = Store(db_url)
    conv = {"N": 128, "H": 56, "W": 56, "Ci": 64, "Co": 256, "R": 3, "S": 3, "stride": 1, "padding": 1}
    store.enqueue(TuneKey("conv2d_wgrad.blackwell", "v1", "3.9.0", "sm_100", 148, {**conv, "dtype": "bfloat16"}))
    mm = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"}
    job = store.enqueue(TuneKey("matmul.hopper", "v1", "3.9.0", "sm_90", 132, mm))
    store.claim_job("gpu-node-17.cluster.example:4711:gpu0", "sm_90", 132, 60)
    listing = tc("jobs", "ls", COLUMNS="80")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), listing.stdout
    assert any(ln.startswith(job.digest[:12]) and "running" in ln and "sm_90:132" in ln for ln in lines), listing.stdout
    assert "conv2d_wgrad.blackwell" in listing.stdout and "N128 56x56 64>256 3x3/s1p1 bf16" in listing.stdout
    assert "held by gpu-node-17" in listing.stdout and "2 job(s) in" in listing.stdout
    wide = tc("jobs", "ls", "--wide", COLUMNS="80")
    assert "gpu-node-17.cluster.example:4711:gpu0" in wide.stdout and "attempts" in wide.stdout


def test_a_burst_worker_stops_when_the_fleet_cannot_be_reached(db_url):
    proc = tc(
        "worker",
        "--burst",
        "--poll-s",
        "0.1",
        timeout=120,
        TUNECACHE_SERVER_URL="http://127.0.0.1:9",
        TUNECACHE_TOKEN="tc_x",  # the discard port: nothing listens
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: http://127.0.0.1:9 could not be reached" in proc.stderr and "--burst worker" in proc.stderr


# ---- row 8: a store URL typed wrong is named, with the fix; nothing is left beside a store ----


def test_a_store_url_typed_wrong_says_how_to_fix_it(tmp_path):
    typo = tmp_path / "stroes"
    missing = tc("ls", TUNECACHE_DB_URL=f"sqlite:///{typo / 'store.sqlite'}")
    assert missing.returncode == 2 and f"the store directory {typo} does not exist" in missing.stderr
    assert f"mkdir -p {typo}" in missing.stderr and not typo.exists(), missing.stderr
    pg = tc("ls", TUNECACHE_DB_URL="postgres://postgres@127.0.0.1:5432/test")
    assert pg.returncode == 2 and "postgresql+psycopg://postgres@127.0.0.1:5432/test" in pg.stderr, pg.stderr
    (tmp_path / "stores").mkdir()
    fresh = tc("ls", TUNECACHE_DB_URL=f"sqlite:///{tmp_path / 'stores' / 'store.sqlite'}")
    assert fresh.returncode == 0 and "0 config(s)" in fresh.stdout, fresh.stderr
    assert sorted(p.name for p in (tmp_path / "stores").iterdir()) == ["store.sqlite"]


def test_a_backend_given_on_the_command_line_is_blamed_by_its_option(db_url):
    shape = "M=64,N=64,K=64,dtype=float32"  # the Hopper backend takes no float32 on the CPU interpreter
    for args in (("key", "matmul", "-p", shape), ("tune", "matmul", "-p", shape)):
        proc = tc(*args, "--backend", "hopper")
        assert proc.returncode == 2 and "backend 'hopper' (--backend) does not support" in proc.stderr, proc.stderr
    by_env = tc("key", "matmul", "-p", shape, TUNECACHE_BACKEND="hopper")
    assert by_env.returncode == 2 and "(TUNECACHE_BACKEND)" in by_env.stderr, by_env.stderr


def test_the_readme_says_own_kernels_need_the_interpreter_on_a_cpu():
    from support import ROOT

    readme = (ROOT / "README.md").read_text()
    own = readme[readme.index("## Your own Triton kernels") :].split("\n## ")[0]
    assert "TRITON_INTERPRET=1" in own


# ---- row 6: a long command says how far it is in a log too ------------------------------------


def test_tune_writes_progress_lines_to_a_log(db_url):
    import re

    proc = tc(
        "tune",
        "conv2d_fprop",
        "-p",
        "N=2,H=8,W=8,Ci=4,Co=8,R=3,S=3,padding=1,dtype=float32",
        TUNECACHE_PROGRESS_S="0.3",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = re.findall(r"^tuning conv2d_fprop\.portable on cpu:0: .* \(\d+ s\)$", proc.stderr, re.M)
    assert lines, proc.stderr  # stderr is a pipe here, as in a CI log: no bar, plain lines
    assert "\x1b[" not in proc.stderr and "candidates (digest" in proc.stdout


def test_the_tuning_estimate_learns_from_the_stores_past_tunes(db_url):
    """The first tune of a kernel here is a first guess and says so; the next one, of another
    shape, is learned from the store's past tunes (their seconds a candidate, their runner
    starts left out) and lands within 2x of what it takes; a library call says the same."""
    import re

    from tunecache.store import Store

    def estimate(stderr: str) -> tuple[float, str]:
        (m,) = re.findall(
            r"^tuning matmul\.portable for .*: (\d+) candidates, roughly ([\d.]+) s \((.*)\)$", stderr, re.M
        )
        return float(m[1]), m[2]

    first = tc("tune", "matmul", "-p", "M=40,N=36,K=24,dtype=float32")
    assert first.returncode == 0, first.stderr[-2000:]
    assert estimate(first.stderr) == (1.8, "a first guess"), first.stderr  # today's formula: 18 x 0.1 s
    second = tc("tune", "matmul", "-p", "M=64,N=48,K=32,dtype=float32")
    assert second.returncode == 0, second.stderr[-2000:]
    guessed, basis = estimate(second.stderr)
    store = Store(db_url)
    try:
        (rec,) = [r for r in store.list_configs() if r.key.problem["M"] == 64]
    finally:
        store.close()
    took = rec.tune_seconds
    assert basis == "from 1 past tune here" and took is not None
    assert took / 2 <= guessed <= took * 2, f"estimated {guessed} s, the tune took {took:.2f} s"
    code = "import torch; from tunecache import ops; ops.matmul(torch.randn(48, 32), torch.randn(32, 40))"
    call = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    (line,) = [ln for ln in call.stderr.splitlines() if ln.startswith("tunecache: tuning matmul.portable")]
    assert call.returncode == 0 and "s (from 2 past tunes here); later calls" in line, call.stderr
