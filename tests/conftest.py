"""Test set-up: the CPU interpreter unless a GPU is present, and a fresh store per test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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

PG_URL = os.environ.get("TUNECACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


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
    admin = dict(host=base.host, port=base.port or 5432, user=base.username, dbname=base.database)
    try:
        conn = psycopg.connect(**admin, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        why = (f"Postgres at {PG_URL} is not reachable ({str(e).strip()[:200]}); start one (README: "
               f"'Running the tests') or set TUNECACHE_TEST_PG_URL")
        if os.environ.get("TUNECACHE_TEST_REQUIRE_PG") == "1":  # CI: a missing database is a failure
            pytest.fail(why)
        pytest.skip(why)
    conn.execute(f'CREATE DATABASE "{name}"')
    yield base.set(database=name).render_as_string(hide_password=False)
    conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    conn.close()


def run_py(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process with this test's environment."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
