"""Opening a store's database: SQLite and Postgres URLs, the engine and its per-connection
settings, and the one SQL idiom both dialects need (INSERT ... ON CONFLICT)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from tunecache.store.faults import StoreError

# What a store call raises when the database itself fails: a full disk, a read-only, corrupt
# or locked file, a newer schema, an unreachable server. Callers that must not fail catch
# these and word them with describe_fault(); anything else is a bug and stays loud.
STORE_ERRORS: tuple[type[BaseException], ...] = (StoreError, SQLAlchemyError, sqlite3.Error, OSError)


class CorruptJSON(str):
    """A JSON column whose text does not parse: reported and skipped, never launched."""


def _safe_json_loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return CorruptJSON(text)


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL opens (as SQLite sees it: relative to the working directory if
    relative), or None: in memory, not SQLite, or not a valid URL."""
    try:
        u = make_url(url)
    except ArgumentError:
        return None
    db = u.database
    if u.get_backend_name() != "sqlite" or not db or u.query.get("mode") == "memory":
        return None
    if str(u.query.get("uri", "")).lower() in ("true", "1") and db.startswith("file:"):
        db = unquote(db[len("file:") :])
        if db.startswith("//"):  # file://localhost/abs or file:///abs
            db = "/" + db[2:].partition("/")[2]
    return None if db == ":memory:" else Path(db)


def sqlite_url(path: str | os.PathLike, **params: str) -> str:
    """A SQLAlchemy URL that opens `path` with SQLite URI parameters (mode="ro", immutable="1").
    The path is quoted twice: SQLAlchemy's URL parsing undoes one, SQLite's URI parsing the other."""
    query = "&".join(f"{k}={v}" for k, v in {**params, "uri": "true"}.items())
    return f"sqlite:///file:{quote(quote(os.path.abspath(path)))}?{query}"


def _url_hint(u) -> str:
    """What to write instead of a Postgres URL SQLAlchemy cannot open as it stands."""
    if u.drivername in ("postgres", "postgresql", "postgresql+psycopg2"):
        fixed = u.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
        return f"; for Postgres write postgresql+psycopg://... (the psycopg 3 driver tunecache installs): {fixed}"
    return ""


def _wal(cur: sqlite3.Cursor, busy_s: float) -> None:
    """Put the file in WAL mode. SQLite answers "database is locked" at once, without its busy
    handler, while another connection reads a file still in rollback mode: two processes that
    open one fresh store together (the ranks of a job on a new host). Asked again until the
    busy timeout, as any other lock wait."""
    deadline = time.monotonic() + busy_s
    pause = 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def make_engine(url: str, *, writable: bool = True) -> Engine:
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise StoreError(f"store URL {url!r} (TUNECACHE_DB_URL) is not a valid SQLAlchemy URL: {e}") from None
    if u.get_backend_name() == "sqlite":
        from tunecache import settings

        file = sqlite_path(url)
        if file is not None and writable:
            path = file.expanduser()
            own = not settings.db_url_given() and url == settings.db_url()  # this host's, in the user cache dir
            if not own and not path.parent.is_dir():
                # a URL someone typed: a directory that is not there is likelier a typo than a wish
                raise StoreError(
                    f"the store directory {path.parent} does not exist ({url}): create it "
                    f"(mkdir -p {path.parent}) or correct the URL (TUNECACHE_DB_URL, --db-url)"
                )
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create the store directory {path.parent} for {url!r}: {e}") from None
        busy_s = settings.db_busy_timeout_s()
        kwargs = {}
        if u.query.get("mode") == "memory":
            from sqlalchemy.pool import QueuePool

            kwargs["poolclass"] = QueuePool  # a shared in-memory database: see Store.in_memory
        engine = create_engine(
            url,
            connect_args={"timeout": busy_s, "check_same_thread": False},
            json_deserializer=_safe_json_loads,
            **kwargs,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # let SQLAlchemy, not pysqlite, decide when transactions begin (see _on_begin)
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={int(busy_s * 1000)}")
            if writable:  # setting the journal mode writes the file's header
                _wal(cur, busy_s)
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            # Writers take the write lock up front: a deferred transaction that reads and
            # then writes can fail with SQLITE_BUSY without waiting on the busy timeout.
            mode = "IMMEDIATE" if conn.get_execution_options().get("tunecache_write") else "DEFERRED"
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "json_deserializer": _safe_json_loads}
    if u.get_backend_name() == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": 10}
        # the service runs up to 16 requests at once; connections opened past the pool size
        # are closed on return, and reconnecting on every request under load is slow
        from tunecache import settings

        kwargs["pool_size"], kwargs["max_overflow"] = settings.db_pool()
    try:
        return create_engine(url, **kwargs)
    except (ImportError, ArgumentError) as e:
        raise StoreError(f"cannot open store URL {url!r} (TUNECACHE_DB_URL): {e}{_url_hint(u)}") from None


def dialect_insert(session: Session):
    """The dialect's `insert`, which has ON CONFLICT."""
    name = session.get_bind().dialect.name
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        raise StoreError(f"unsupported database dialect {name!r}; use SQLite or PostgreSQL")
    return insert


def insert_ignore(session: Session, table, values: dict) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True if the row was inserted."""
    stmt = dialect_insert(session)(table).values(**values).on_conflict_do_nothing().returning(table.c.id)
    return session.execute(stmt).first() is not None
