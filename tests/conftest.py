"""Test set-up: the CPU interpreter unless a GPU is present, the gpu/postgres markers, a fresh
store per test (`db_url`) and a Postgres database per session (`pg_url`).

The tests are split by cost: unit/ (in-process, CPU), integration/ (Postgres, a real uvicorn,
Chromium, fresh processes; its conftest.py has the fleet fixtures) and gpu/ (a CUDA GPU for
every test). Plain helpers are imported from support/ (`from support import run_py`)."""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()
if not HAS_GPU:
    # must be set before any @triton.jit runs at import time
    os.environ["TRITON_INTERPRET"] = "1"

if not os.environ.get("TUNECACHE_RUNTIME_DIR"):
    # the runner servers this session starts (tunecache.tuning.forkserver) live here and stop with it
    os.environ["TUNECACHE_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tc-rt-")

PG_URL = os.environ.get("TUNECACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def pytest_sessionfinish(session, exitstatus):
    from tunecache.tuning import forkserver

    for sock in Path(os.environ["TUNECACHE_RUNTIME_DIR"]).glob("*.sock"):
        forkserver.stop(str(sock))


def pytest_unconfigure(config):
    # Everything pytest has to say is said. What follows on stderr is libtriton's nanobind
    # reporting, at interpreter exit, the IR objects of the Gluon kernels this process compiled
    # itself (test_compile_matches_launch, test_triton_key_cache) as "leaked": ~35 lines of noise
    # about objects the exiting interpreter frees anyway. The compile workers silence it the
    # same way (tunecache.tuning.isolated_main). At exit, not now: pytest's capture plugin puts
    # stderr back after this hook.
    atexit.register(_quiet_stderr)


def _quiet_stderr() -> None:
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "pg_url" in getattr(item, "fixturenames", ()):  # directly or through the fleet fixtures
            item.add_marker(pytest.mark.postgres)


@pytest.fixture
def db_url(tmp_path, monkeypatch) -> str:
    """A fresh SQLite store for this test, also seen by subprocesses through the env."""
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    monkeypatch.setenv("TUNECACHE_DB_URL", url)
    monkeypatch.delenv("TUNECACHE_SERVER_URL", raising=False)
    monkeypatch.delenv("TUNECACHE_MISS_POLICY", raising=False)
    monkeypatch.delenv("TUNECACHE_DEVICE", raising=False)
    from tunecache import ops

    ops.clear_memo()
    yield url
    ops.clear_memo()


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A fresh Postgres database for this test session, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    from sqlalchemy.engine import make_url

    base = make_url(PG_URL)
    name = f"tc_test_{uuid.uuid4().hex[:10]}"
    admin = dict(host=base.host, port=base.port or 5432, user=base.username, password=base.password)
    try:
        try:
            conn = psycopg.connect(**admin, dbname=base.database, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as e:
            if "does not exist" not in str(e):
                raise
            # a fresh server has no database of that name: the session's own is made from the
            # server's maintenance database instead (the URL's database is only where to connect)
            conn = psycopg.connect(**admin, dbname="postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        why = (
            f"Postgres at {PG_URL} is not reachable ({str(e).strip()[:200]}); start one (README: "
            f"'Running the tests') or set TUNECACHE_TEST_PG_URL"
        )
        if os.environ.get("TUNECACHE_TEST_REQUIRE_PG") == "1":  # CI: a missing database is a failure
            pytest.fail(why)
        pytest.skip(why)
    conn.execute(f'CREATE DATABASE "{name}"')
    yield base.set(database=name).render_as_string(hide_password=False)
    conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    conn.close()
