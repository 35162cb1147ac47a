"""Run the Alembic revisions in `tunecache_migrations` against a store's engine."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine


def alembic_config(url: str | None = None):
    from alembic.config import Config

    import tunecache_migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(tunecache_migrations.__file__).parent))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision (see `tunecache.store.quick_read.head_revision`: read from file names)."""
    from tunecache.store.quick_read import head_revision as head

    found = head()
    if found is None:
        raise RuntimeError("no Alembic revisions found in tunecache_migrations/versions")
    return found


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


@contextlib.contextmanager
def store_file_lock(db: str | Path | None):
    """Serialise first-open work on one SQLite file across processes: migrations, and the
    recovery of a corrupt file (tunecache.store.local), never at the same time. The lock file
    lives in TUNECACHE_LOCK_DIR, named for the store's absolute path: nothing is left beside it."""
    if not db or str(db) == ":memory:":
        yield
        return
    from tunecache.locks import lock_file

    where = os.path.abspath(os.fspath(Path(db).expanduser()))
    name = f"{hashlib.sha256(where.encode()).hexdigest()[:16]}-{Path(where).name[:60]}.migrate-lock"
    with open(lock_file(name, "stores"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    cfg = alembic_config()
    if engine.dialect.name == "sqlite":
        from tunecache.store.engine import sqlite_path

        lock = store_file_lock(sqlite_path(engine.url.render_as_string(hide_password=False)))
    else:
        lock = contextlib.nullcontext()
    with lock, engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # one migrator at a time across the fleet
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7462531)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
