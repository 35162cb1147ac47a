"""A host that already has its config pays for the call, not for the cache: the first call of a
fresh process reads the store without importing SQLAlchemy or opening the Store, and a store
it cannot read that way is still read the usual way."""

from __future__ import annotations

import json
import sqlite3

from support import run_py

# on the GPU where there is one (CPU tensors there run PyTorch's op), else on the interpreter
INPUTS = (
    "import torch; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; "
    "a = torch.randn(48, 40, device=dev); b = torch.randn(40, 24, device=dev)\n"
)
TUNE_ONCE = INPUTS + "import tunecache.ops as ops; ops.matmul(a, b)"
FIRST_CALL = (
    "import sys, json\n" + INPUTS + "import tunecache.ops as ops\n"
    "out = ops.matmul(a, b)\n"
    "print(json.dumps({'sqlalchemy': 'sqlalchemy' in sys.modules, "
    "'ok': bool(((out - a @ b).norm() / (a @ b).norm()).item() < 5e-3)}))"
)  # tf32 dots on a GPU


def _first_call(db_url: str) -> dict:
    return json.loads(run_py(FIRST_CALL, {"TUNECACHE_DB_URL": db_url}).stdout.strip().splitlines()[-1])


def test_a_warm_first_call_imports_no_database_layer(db_url):
    run_py(TUNE_ONCE, {"TUNECACHE_DB_URL": db_url})
    got = _first_call(db_url)
    assert got["ok"] and got["sqlalchemy"] is False


def test_a_store_at_another_revision_is_read_through_the_store(db_url, tmp_path):
    run_py(TUNE_ONCE, {"TUNECACHE_DB_URL": db_url})
    path = db_url[len("sqlite:///") :]
    _downgrade(db_url, "0004")  # as an older tunecache left it: the Store migrates it
    got = _first_call(db_url)
    assert got["ok"] and got["sqlalchemy"] is True  # the Store opened it, migrated it, and read it
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] != "0004"
        assert conn.execute("SELECT count(*) FROM tuned_configs").fetchone()[0] == 1
    assert _first_call(db_url)["sqlalchemy"] is False


def _downgrade(db_url: str, revision: str) -> None:
    from sqlalchemy import create_engine

    from support.migrations import downgrade

    engine = create_engine(db_url)
    downgrade(engine, revision)
    engine.dispose()
