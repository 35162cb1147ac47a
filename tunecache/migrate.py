"""Run the Alembic revisions in `tunecache_migrations` against a store's engine."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

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
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _sqlite_file_lock(engine: Engine):
    """Serialise first-open migrations of one SQLite file across processes."""
    db = engine.url.database
    if not db or db == ":memory:":
        yield
        return
    with open(f"{db}.migrate-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    cfg = alembic_config()
    lock = _sqlite_file_lock(engine) if engine.dialect.name == "sqlite" else contextlib.nullcontext()
    with lock, engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # one migrator at a time across the fleet
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7462531)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def ensure_schema(engine: Engine) -> None:
    """Upgrade to head unless already there (the common case costs one small query)."""
    head = head_revision()
    if current_revision(engine) != head:
        upgrade(engine)
