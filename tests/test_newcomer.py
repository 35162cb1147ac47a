"""What a newcomer meets first: the test suite on a machine without Postgres, and the REST API
refusing what it does not understand instead of answering as if it did."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from conftest import ROOT
from fleet_support import clean_fleet, fleet  # noqa: F401

ONE_PG_TEST = "tests/test_store.py::test_schema_is_at_head_after_open[postgres]"


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **env})


def test_without_postgres_its_tests_skip_and_say_why():
    nowhere = "postgresql+psycopg://postgres@127.0.0.1:9/test"  # the discard port: nothing listens
    proc = _pytest(ONE_PG_TEST, TUNECACHE_TEST_PG_URL=nowhere, TUNECACHE_TEST_REQUIRE_PG="0")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 skipped" in proc.stdout and "is not reachable" in proc.stdout and "Running the tests" in proc.stdout
    required = _pytest(ONE_PG_TEST, TUNECACHE_TEST_PG_URL=nowhere, TUNECACHE_TEST_REQUIRE_PG="1")
    assert required.returncode != 0 and "is not reachable" in required.stdout


def test_the_postgres_marker_selects_the_tests_that_need_it():
    proc = _pytest("--collect-only", "-m", "postgres", "tests/test_store.py")
    assert proc.returncode == 0, proc.stdout[-2000:]
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids and all(i.endswith("[postgres]") for i in ids)


def test_an_unknown_query_parameter_is_refused_by_name(clean_fleet):
    headers = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
    with httpx.Client(base_url=clean_fleet.url, headers=headers, timeout=10) as api:
        r = api.get("/v1/configs", params={"kernal": "matmul.hopper"})
        assert r.status_code == 422 and "'kernal'" in r.json()["detail"] and "kernel" in r.json()["detail"]
        assert api.get("/v1/configs", params={"kernel": "matmul.hopper"}).status_code == 200
