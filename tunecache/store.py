"""The store: tuned configs, tuning jobs and trials in SQLite (local) or Postgres (fleet).

This is the only module that speaks SQL. The schema is created and upgraded by the Alembic
revisions in `tunecache_migrations`; a local SQLite file is migrated on first open.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import sqlite3
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import quote, unquote

from sqlalchemy import (JSON, Boolean, DateTime, Float, Integer, String, Text, and_, create_engine, event,
                        false, func, or_, select, update)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from .key import TuneKey

log = logging.getLogger("tunecache.store")

# A new result replaces a stored one only when it is this much faster: timing noise must
# not flip the winner back and forth between hosts.
REPLACE_MARGIN = 0.03
# a failed job waits at most this long before its next attempt
MAX_BACKOFF_S = 24 * 3600.0


class StoreError(RuntimeError):
    """The store could not be opened or used; the message names the URL."""


class ReadOnlyStoreError(StoreError):
    """A write to a store opened read-only (by tunecache.local_store, which has already warned
    once saying why). put_config and add_trials skip instead of raising this."""


class NewerSchemaError(StoreError):
    """The store was migrated by a newer tunecache: this one must neither migrate nor write it."""

    def __init__(self, message: str, revision: str, head: str) -> None:
        super().__init__(message)
        self.revision, self.head = revision, head


# What a store call raises when the database itself fails: a full disk, a read-only, corrupt
# or locked file, a newer schema, an unreachable server. Callers that must not fail catch
# these and word them with describe_fault(); anything else is a bug and stays loud.
STORE_ERRORS: tuple[type[BaseException], ...] = (StoreError, SQLAlchemyError, sqlite3.Error, OSError)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class TunedConfigRow(Base):
    __tablename__ = "tuned_configs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    kernel: Mapped[str] = mapped_column(String(128), index=True)
    kernel_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(32))
    arch: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    device_name: Mapped[str] = mapped_column(String(128), default="")
    problem: Mapped[Any] = mapped_column(JSON)
    config: Mapped[Any] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    candidates: Mapped[int] = mapped_column(Integer, default=0)
    tuned_by: Mapped[str] = mapped_column(String(128), default="")
    tuned_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    source: Mapped[str] = mapped_column(String(16), default="inline")
    # a copy of a fleet winner (source "fleet"): when this host last checked it with the fleet,
    # and the fleet's generation then (a host rechecks its copies after TUNECACHE_FLEET_TTL_S
    # or when the generation moves, which it does whenever the fleet removes or replaces one)
    fleet_checked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    fleet_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)


class FleetMetaRow(Base):
    """Named counters of the fleet's store; `generation` moves on every removed or replaced winner."""

    __tablename__ = "fleet_meta"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(Integer)


class SelfCheckRow(Base):
    """A backend's first-contact verdict on a device class (see tunecache.selfcheck)."""

    __tablename__ = "selfchecks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kernel: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(32))
    arch: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    ok: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    device_name: Mapped[str] = mapped_column(String(128), default="")
    checked_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class TuningJobRow(Base):
    __tablename__ = "tuning_jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    kernel: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(32))
    arch: Mapped[str] = mapped_column(String(16), index=True)
    sm_count: Mapped[int] = mapped_column(Integer)
    problem: Mapped[Any] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    not_before: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class TrialRow(Base):
    __tablename__ = "trials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[str] = mapped_column(String(32), index=True)
    kernel: Mapped[str] = mapped_column(String(128))
    config: Mapped[Any] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # ok | failed | wrong
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


# ---- plain records handed out of the store (never ORM objects) ---------------------------


@dataclass
class ConfigRecord:
    key: TuneKey
    config: dict
    median_ms: float
    tflops: float | None = None
    candidates: int = 0
    device_name: str = ""
    tuned_by: str = ""
    tuned_at: datetime | None = None
    source: str = "inline"
    # local bookkeeping of fleet copies (never sent or received)
    fleet_checked_at: datetime | None = None
    fleet_generation: int | None = None

    @property
    def digest(self) -> str:
        return self.key.digest

    def to_json(self) -> dict:
        d = self.key.fields()
        d.update(digest=self.digest, config=self.config, median_ms=self.median_ms, tflops=self.tflops,
                 candidates=self.candidates, device_name=self.device_name, tuned_by=self.tuned_by,
                 tuned_at=self.tuned_at.isoformat() if self.tuned_at else None, source=self.source)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ConfigRecord":
        """Inverse of to_json; raises ValueError/KeyError/TypeError on a malformed entry."""
        key = TuneKey.from_fields(d)
        if "digest" in d and d["digest"] != key.digest:
            raise ValueError(f"digest {d['digest']!r} does not match the key's fields")
        if not isinstance(d["config"], dict):
            raise ValueError("config must be an object")
        median = float(d["median_ms"])
        if not median > 0:
            raise ValueError(f"median_ms must be positive, got {median}")
        tuned_at = d.get("tuned_at")
        return cls(key=key, config=dict(d["config"]), median_ms=median,
                   tflops=None if d.get("tflops") is None else float(d["tflops"]),
                   candidates=int(d.get("candidates") or 0), device_name=str(d.get("device_name") or ""),
                   tuned_by=str(d.get("tuned_by") or ""),
                   tuned_at=datetime.fromisoformat(tuned_at) if tuned_at else None,
                   source=str(d.get("source") or "import"))


@dataclass
class TrialRecord:
    config: dict
    status: str  # ok | failed | wrong
    median_ms: float | None = None
    error: str | None = None


@dataclass
class JobRecord:
    id: int
    key: TuneKey
    status: str
    priority: int
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    last_error: str | None

    @property
    def digest(self) -> str:
        return self.key.digest


class CorruptJSON(str):
    """A JSON column whose text does not parse: reported and skipped, never launched."""


def _safe_json_loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return CorruptJSON(text)


def _key_of(row: TunedConfigRow | TuningJobRow) -> TuneKey:
    problem = row.problem
    if isinstance(problem, str):  # corrupt, or a row written by hand or by a foreign tool
        problem = json.loads(problem)
    if not isinstance(problem, dict):
        raise ValueError(f"problem is a {type(problem).__name__}, not an object")
    return TuneKey(row.kernel, row.kernel_version, row.triton_version, row.arch, row.sm_count, problem)


def _config_record(row: TunedConfigRow) -> ConfigRecord:
    config = row.config
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, dict):
        raise ValueError(f"config is a {type(config).__name__}, not an object")
    return ConfigRecord(key=_key_of(row), config=config, median_ms=row.median_ms, tflops=row.tflops,
                        candidates=row.candidates, device_name=row.device_name, tuned_by=row.tuned_by,
                        tuned_at=row.tuned_at, source=row.source, fleet_checked_at=row.fleet_checked_at,
                        fleet_generation=row.fleet_generation)


def _job_record(row: TuningJobRow) -> JobRecord:
    return JobRecord(id=row.id, key=_key_of(row), status=row.status, priority=row.priority,
                     attempts=row.attempts, max_attempts=row.max_attempts, lease_owner=row.lease_owner,
                     lease_expires_at=row.lease_expires_at, last_error=row.last_error)


def whoami() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# ---- faults of the database, in words --------------------------------------------------

# SQLite's primary result codes (the low byte of an extended code) that say what is wrong
_SQLITE_FAULTS = {5: "locked", 6: "locked", 8: "read-only", 10: "io", 11: "corrupt", 13: "full",
                  14: "cantopen", 26: "corrupt"}
# the same, from an error's text (a driver without codes, or a message passed on as text)
_TEXT_FAULTS = (("database or disk is full", "full"), ("disk i/o error", "io"),
                ("readonly database", "read-only"), ("file is not a database", "corrupt"),
                ("disk image is malformed", "corrupt"), ("is locked", "locked"),
                ("unable to open database file", "cantopen"), ("can't locate revision", "newer"))
_OS_FAULTS = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "read-only", errno.EACCES: "denied",
              errno.EPERM: "denied", errno.EIO: "io"}
# below this much free space, a disk I/O error is taken for a full disk (SQLite's shared
# memory file, the first thing a reader writes, needs 32 KiB)
_NEARLY_FULL_BYTES = 64 << 10


def _error_chain(exc: BaseException) -> list[BaseException]:
    """`exc`, the driver error a SQLAlchemy error wraps, and what it was raised from or during
    (a StoreError raised `from None` still keeps its context)."""
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < 16:
        e = todo.pop(0)
        if any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [x for x in (getattr(e, "orig", None), e.__cause__, e.__context__) if isinstance(x, BaseException)]
    return out


def fault_kind(exc: BaseException) -> str | None:
    """What a store error says of the database: "full", "io", "read-only", "denied",
    "corrupt", "locked", "cantopen" or "newer" (schema); None if none of these."""
    chain = _error_chain(exc)
    # the first error with a code decides: an error raised while handling another one keeps
    # that one as its context, and must not be taken for it
    for e in chain:
        if isinstance(e, NewerSchemaError):
            return "newer"
        if isinstance(e, ReadOnlyStoreError):
            return "read-only"
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(e, sqlite3.Error) and isinstance(code, int):
            return _SQLITE_FAULTS.get(code & 0xFF)
        if isinstance(e, OSError) and e.errno is not None:
            return _OS_FAULTS.get(e.errno)
    for e in chain:
        text = str(e).lower()
        kind = next((kind for needle, kind in _TEXT_FAULTS if needle in text), None)
        if kind is not None:
            return kind
    return None


def _existing_dir(path: Path) -> Path:
    """The nearest directory at or above path's parent that exists."""
    d = path.absolute().parent
    while not d.is_dir() and d != d.parent:
        d = d.parent
    return d


def _on_read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(_existing_dir(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _nearly_full(path: Path) -> bool:
    try:
        st = os.statvfs(_existing_dir(path))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _NEARLY_FULL_BYTES


def describe_fault(exc: BaseException, path: str | os.PathLike | None = None) -> str | None:
    """The cause of a store error in words a user understands ("the disk holding
    /x/y.sqlite is full"), or None if it is not a fault of the database (a bug, a bad
    argument). `path` is the store's file (`Store.path`), checked to tell a read-only file
    system or a full disk from other causes of the same SQLite error."""
    kind = fault_kind(exc)
    if kind is None:
        return None
    if kind == "newer":
        newer = next((e for e in _error_chain(exc) if isinstance(e, NewerSchemaError)), None)
        if newer is not None:
            return str(newer)
    p = Path(path) if path is not None else None
    name = f"the store file {p}" if p is not None else "the store"
    if p is not None and kind in ("read-only", "denied", "cantopen") and _on_read_only_fs(p):
        return f"{name} is on a read-only file system"
    if p is not None and kind == "io" and _nearly_full(p):
        kind = "full"
    if kind == "corrupt":
        damaged = any((getattr(e, "sqlite_errorcode", None) or 0) & 0xFF == 11 or "malformed" in str(e).lower()
                      for e in _error_chain(exc))
        return f"{name} is damaged (corrupt)" if damaged else f"{name} is not a SQLite database (corrupt)"
    if kind == "locked":
        from . import settings

        return (f"{name} is locked by another process (it held a write lock past the busy timeout of "
                f"{settings.db_busy_timeout_s():g} s)")
    return {
        "full": f"the disk holding {p if p is not None else 'the store'} is full",
        "io": f"reading or writing {name} failed with a disk I/O error (the disk may be failing)",
        "read-only": f"{name} is read-only",
        "denied": f"{name} cannot be written (permission denied)",
        "cantopen": f"{name} cannot be opened or created",
        "newer": f"{name} was written by a newer tunecache (its schema revision is unknown to this one)",
    }[kind]


# ---- engine ------------------------------------------------------------------------------


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
        db = unquote(db[len("file:"):])
        if db.startswith("//"):  # file://localhost/abs or file:///abs
            db = "/" + db[2:].partition("/")[2]
    return None if db == ":memory:" else Path(db)


def sqlite_url(path: str | os.PathLike, **params: str) -> str:
    """A SQLAlchemy URL that opens `path` with SQLite URI parameters (mode="ro", immutable="1").
    The path is quoted twice: SQLAlchemy's URL parsing undoes one, SQLite's URI parsing the other."""
    query = "&".join(f"{k}={v}" for k, v in {**params, "uri": "true"}.items())
    return f"sqlite:///file:{quote(quote(os.path.abspath(path)))}?{query}"


def _make_engine(url: str, *, writable: bool = True) -> Engine:
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise StoreError(f"store URL {url!r} (TUNECACHE_DB_URL) is not a valid SQLAlchemy URL: {e}") from None
    if u.get_backend_name() == "sqlite":
        from . import settings

        file = sqlite_path(url)
        if file is not None and writable:
            path = file.expanduser()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create the store directory {path.parent} for {url!r}: {e}") from None
        busy_s = settings.db_busy_timeout_s()
        kwargs = {}
        if u.query.get("mode") == "memory":
            from sqlalchemy.pool import QueuePool

            kwargs["poolclass"] = QueuePool  # a shared in-memory database: see Store.in_memory
        engine = create_engine(url, connect_args={"timeout": busy_s, "check_same_thread": False},
                               json_deserializer=_safe_json_loads, **kwargs)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # let SQLAlchemy, not pysqlite, decide when transactions begin (see _on_begin)
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            if writable:  # setting the journal mode writes the file's header
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_s * 1000)}")
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
        kwargs["pool_size"] = int(os.environ.get("TUNECACHE_DB_POOL_SIZE", "16"))
        kwargs["max_overflow"] = int(os.environ.get("TUNECACHE_DB_MAX_OVERFLOW", "16"))
    try:
        return create_engine(url, **kwargs)
    except (ImportError, ArgumentError) as e:
        raise StoreError(f"cannot open store URL {url!r} (TUNECACHE_DB_URL): {e}") from None


def _dialect_insert(session: Session):
    """The dialect's `insert`, which has ON CONFLICT."""
    name = session.get_bind().dialect.name
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        raise StoreError(f"unsupported database dialect {name!r}; use SQLite or PostgreSQL")
    return insert


def _insert_ignore(session: Session, table, values: dict) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True if the row was inserted."""
    stmt = _dialect_insert(session)(table).values(**values).on_conflict_do_nothing().returning(table.c.id)
    return session.execute(stmt).first() is not None


class Store:
    """One database, local or fleet. Thread-safe; safe for many processes on one SQLite file.

    A store opened with `writable=False` (tunecache.local_store does, for a file it may only
    read) skips put_config and add_trials, and raises ReadOnlyStoreError on any other write.
    """

    def __init__(self, url: str | None = None, *, migrate: bool = True, writable: bool = True) -> None:
        from . import settings

        self.url = url or settings.db_url()
        self.writable = writable
        self.path = sqlite_path(self.url)  # the SQLite file; None in memory or on Postgres
        self._keepalive: Any = None
        self.engine = _make_engine(self.url, writable=writable)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write_maker = sessionmaker(self.engine.execution_options(tunecache_write=True),
                                         expire_on_commit=False)
        try:
            if migrate:
                self._migrate()
            else:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
        except DatabaseError as e:
            raise StoreError(f"cannot open the store at {self.safe_url} (TUNECACHE_DB_URL): "
                             f"{describe_fault(e, self.path) or e.orig}") from None

    def _migrate(self) -> None:
        """Upgrade to head unless already there (the common case costs one small query and no
        Alembic import); a store migrated by a newer tunecache is refused, never downgraded."""
        from .migrate import current_revision, head_revision

        head = head_revision()
        current = current_revision(self.engine)
        if current == head:
            return
        if current is not None and not (current.isdigit() and int(current) < int(head)):
            what = (f"was written by a newer tunecache (schema revision {current}, this one knows up to {head})"
                    if current.isdigit() else
                    f"has schema revision {current!r}, unknown to this tunecache (it knows up to {head})")
            raise NewerSchemaError(f"{self._where()} {what}", current, head)
        from .migrate import upgrade

        upgrade(self.engine)

    @classmethod
    def in_memory(cls) -> "Store":
        """A store in this process's memory, schema created: what this process tunes is kept
        for its lifetime only (the last resort of tunecache.local_store)."""
        # a named shared-cache database, so that every pooled connection (one per thread at
        # a time) sees the same one; it lives while a connection to it is open
        store = cls(f"sqlite:///file:tunecache-{uuid.uuid4().hex}?mode=memory&cache=shared&uri=true",
                    migrate=False)
        store._keepalive = store.engine.raw_connection()
        Base.metadata.create_all(store.engine)
        return store

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _where(self) -> str:
        return f"the store file {self.path}" if self.path is not None else f"the store at {self.safe_url}"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        if not self.writable:
            raise ReadOnlyStoreError(f"{self._where()} is open read-only: nothing can be written to it (the "
                                     f"warning given when it was opened says why)")
        with self._write_maker.begin() as s:
            yield s

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        self.engine.dispose()

    # ---- configs ------------------------------------------------------------------------

    def get_config(self, digest: str) -> ConfigRecord | None:
        """The stored winner, or None. A corrupt row is reported and treated as a miss."""
        with self._read() as s:
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == digest)).scalar_one_or_none()
            if row is None:
                return None
            try:
                rec = _config_record(row)
            except (ValueError, TypeError, KeyError) as e:
                log.warning("tunecache: skipping corrupt store row %s (%s)", digest[:12], e)
                return None
        if rec.digest != digest:
            log.warning("tunecache: skipping store row %s whose fields hash to %s", digest[:12], rec.digest[:12])
            return None
        return rec

    def put_config(self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), run_id: str | None = None
                   ) -> tuple[ConfigRecord, bool]:
        """Store a result unless a faster one is kept; returns (the kept record, whether `rec` won).

        On a read-only store nothing is written and `rec` is returned as kept: this process
        goes on with its own result (and still publishes it to a fleet)."""
        if not self.writable:
            log.debug("tunecache: not keeping %s in the read-only store %s", rec.digest[:12], self.safe_url)
            return rec, True
        values = dict(digest=rec.digest, **{k: v for k, v in rec.key.fields().items()},
                      device_name=rec.device_name, config=rec.config, median_ms=rec.median_ms,
                      tflops=rec.tflops, candidates=rec.candidates, tuned_by=rec.tuned_by or whoami(),
                      tuned_at=rec.tuned_at or utcnow(), source=rec.source)
        with self._write() as s:
            self._add_trials(s, rec.key, trials, run_id)
            return self._keep_faster(s, rec, values)

    def _keep_faster(self, s: Session, rec: ConfigRecord, values: dict) -> tuple[ConfigRecord, bool]:
        if _insert_ignore(s, TunedConfigRow.__table__, values):
            return rec, True
        row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == rec.digest)
                        .with_for_update()).scalar_one()
        try:
            old = _config_record(row)
        except (ValueError, TypeError, KeyError):
            old = None  # a corrupt row loses to any valid result
        # a fleet copy's claimed time is the fleet's word, not a measurement of this host:
        # it never keeps a result of this host out
        fleet_copy = old is not None and old.source == "fleet" and rec.source != "fleet"
        if old is not None and not fleet_copy and rec.median_ms >= old.median_ms * (1 - REPLACE_MARGIN):
            return old, False
        for k, v in values.items():
            setattr(row, k, v)
        row.fleet_checked_at = row.fleet_generation = None
        self._bump_generation(s)
        return rec, True

    # ---- fleet copies and the fleet's generation ------------------------------------------

    def _bump_generation(self, s: Session) -> None:
        table = FleetMetaRow.__table__
        stmt = _dialect_insert(s)(table).values(name="generation", value=1)
        s.execute(stmt.on_conflict_do_update(index_elements=[table.c.name], set_={"value": table.c.value + 1}))

    def generation(self) -> int:
        """The fleet's generation: moves whenever a winner is removed or replaced."""
        with self._read() as s:
            v = s.execute(select(FleetMetaRow.value).where(FleetMetaRow.name == "generation")).scalar()
            return int(v or 0)

    def put_fleet_copy(self, rec: ConfigRecord, generation: int | None) -> bool:
        """Keep (or refresh) this host's copy of the fleet's winner. A result of this host's own
        for the key is never overwritten; returns whether the copy was written."""
        values = dict(digest=rec.digest, **rec.key.fields(), device_name=rec.device_name, config=rec.config,
                      median_ms=rec.median_ms, tflops=rec.tflops, candidates=rec.candidates,
                      tuned_by=rec.tuned_by or "", tuned_at=rec.tuned_at or utcnow(), source="fleet",
                      fleet_checked_at=utcnow(), fleet_generation=generation)
        with self._write() as s:
            if _insert_ignore(s, TunedConfigRow.__table__, values):
                return True
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == rec.digest)
                            .with_for_update()).scalar_one()
            if row.source != "fleet":
                return False
            for k, v in values.items():
                setattr(row, k, v)
            return True

    def mark_fleet_checked(self, digest: str, generation: int | None) -> None:
        with self._write() as s:
            s.execute(update(TunedConfigRow).where(TunedConfigRow.digest == digest, TunedConfigRow.source == "fleet")
                      .values(fleet_checked_at=utcnow(), fleet_generation=generation))

    def delete_fleet_copy(self, digest: str) -> bool:
        """Remove this host's copy of a winner the fleet no longer has (never a result of its own)."""
        with self._write() as s:
            res = s.execute(TunedConfigRow.__table__.delete().where(TunedConfigRow.digest == digest,
                                                                   TunedConfigRow.source == "fleet"))
            return res.rowcount == 1

    # ---- backend self-checks ----------------------------------------------------------------

    def get_selfcheck(self, kernel: str, kernel_version: str, triton_version: str, arch: str,
                      sm_count: int) -> tuple[bool, str | None] | None:
        """(ok, detail) of the stored verdict, or None if this backend never met this device class."""
        with self._read() as s:
            row = s.execute(select(SelfCheckRow).where(
                SelfCheckRow.kernel == kernel, SelfCheckRow.kernel_version == kernel_version,
                SelfCheckRow.triton_version == triton_version, SelfCheckRow.arch == arch,
                SelfCheckRow.sm_count == sm_count)).scalar_one_or_none()
            return None if row is None else (bool(row.ok), row.detail)

    def put_selfcheck(self, kernel: str, kernel_version: str, triton_version: str, arch: str, sm_count: int,
                      ok: bool, detail: str | None, seconds: float | None, device_name: str = "") -> None:
        values = dict(kernel=kernel, kernel_version=kernel_version, triton_version=triton_version, arch=arch,
                      sm_count=sm_count)
        with self._write() as s:
            s.execute(SelfCheckRow.__table__.delete().where(*(getattr(SelfCheckRow, k) == v
                                                              for k, v in values.items())))
            s.add(SelfCheckRow(**values, ok=ok, detail=(detail or None) and detail[:8000], seconds=seconds,
                               device_name=device_name[:128], checked_at=utcnow()))

    def _add_trials(self, s: Session, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None) -> None:
        run_id = run_id or uuid.uuid4().hex
        rows = [TrialRow(digest=key.digest, run_id=run_id, kernel=key.kernel, config=t.config, status=t.status,
                         median_ms=t.median_ms, error=(t.error or None) and t.error[:4000]) for t in trials]
        s.add_all(rows)

    def add_trials(self, key: TuneKey, trials: Iterable[TrialRecord], run_id: str | None = None) -> None:
        if not self.writable:
            return  # as put_config: a read-only store keeps nothing, and says so once when opened
        with self._write() as s:
            self._add_trials(s, key, trials, run_id)

    def trials(self, digest: str | None = None) -> list[TrialRecord]:
        with self._read() as s:
            q = select(TrialRow).order_by(TrialRow.id)
            if digest:
                q = q.where(TrialRow.digest == digest)
            return [TrialRecord(r.config, r.status, r.median_ms, r.error) for r in s.execute(q).scalars()]

    def list_configs(self, kernel: str | None = None, arch: str | None = None,
                     limit: int | None = None, offset: int = 0) -> list[ConfigRecord]:
        with self._read() as s:
            q = select(TunedConfigRow).order_by(TunedConfigRow.kernel, TunedConfigRow.id)
            if kernel:
                q = q.where(TunedConfigRow.kernel == kernel)
            if arch:
                q = q.where(TunedConfigRow.arch == arch)
            if offset:
                q = q.offset(offset)
            if limit is not None:
                q = q.limit(limit)
            out = []
            for row in s.execute(q).scalars():
                try:
                    out.append(_config_record(row))
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("tunecache: skipping corrupt store row %s (%s)", row.digest[:12], e)
            return out

    def find_configs(self, prefix: str) -> list[ConfigRecord]:
        """Rows whose digest starts with `prefix` (for `tunecache show`)."""
        with self._read() as s:
            q = select(TunedConfigRow).where(TunedConfigRow.digest.startswith(prefix)).limit(20)
            return [_config_record(r) for r in s.execute(q).scalars()]

    def delete_config(self, digest: str) -> bool:
        with self._write() as s:
            row = s.execute(select(TunedConfigRow).where(TunedConfigRow.digest == digest)).scalar_one_or_none()
            if row is None:
                return False
            s.delete(row)
            self._bump_generation(s)
            return True

    def counts(self) -> dict[str, int]:
        with self._read() as s:
            out = {}
            for name, model in (("tuned_configs", TunedConfigRow), ("tuning_jobs", TuningJobRow),
                                ("trials", TrialRow)):
                out[name] = s.execute(select(func.count()).select_from(model)).scalar_one()
            for status, n in s.execute(select(TuningJobRow.status, func.count()).group_by(TuningJobRow.status)):
                out[f"jobs_{status}"] = n
            return out

    # ---- jobs ---------------------------------------------------------------------------

    def enqueue(self, key: TuneKey, priority: int = 0, max_attempts: int = 3) -> JobRecord:
        """One active job per digest: a queued or running job is returned as it is."""
        now = utcnow()
        values = dict(digest=key.digest, **key.fields(), status="queued", priority=priority, attempts=0,
                      max_attempts=max_attempts, not_before=now, created_at=now, updated_at=now)
        with self._write() as s:
            _insert_ignore(s, TuningJobRow.__table__, values)
            row = s.execute(select(TuningJobRow).where(TuningJobRow.digest == key.digest)
                            .with_for_update()).scalar_one()
            if row.status == "done" and s.execute(select(TunedConfigRow.id).where(
                    TunedConfigRow.digest == key.digest)).first() is None:
                # done, but its winner is gone (deleted): tune again
                row.status, row.attempts, row.not_before, row.updated_at = "queued", 0, now, now
            if priority > row.priority and row.status == "queued":
                row.priority = priority
            return _job_record(row)

    def claim_job(self, owner: str, arch: str | None = None, sm_count: int | None = None,
                  lease_s: float = 60.0, kernels: Iterable[str] | None = None, *,
                  kernel_versions: Mapping[str, str] | None = None,
                  triton_version: str | None = None) -> JobRecord | None:
        """Lease the most urgent job of this device class: queued, or running with a lapsed lease.

        `kernel_versions` ({kernel: version}) and `triton_version` restrict the claim to jobs
        whose key this worker reproduces: a worker on other code would tune another digest.
        """
        now = utcnow()
        with self._write() as s:
            q = select(TuningJobRow).where(
                ((TuningJobRow.status == "queued") & (TuningJobRow.not_before <= now))
                | ((TuningJobRow.status == "running") & (TuningJobRow.lease_expires_at < now)))
            if arch is not None:
                q = q.where(TuningJobRow.arch == arch)
            if sm_count is not None:
                q = q.where(TuningJobRow.sm_count == sm_count)
            if kernels is not None:
                q = q.where(TuningJobRow.kernel.in_(list(kernels)))
            if kernel_versions is not None:
                q = q.where(or_(false(), *(and_(TuningJobRow.kernel == k, TuningJobRow.kernel_version == v)
                                           for k, v in kernel_versions.items())))
            if triton_version is not None:
                q = q.where(TuningJobRow.triton_version == triton_version)
            q = q.order_by(TuningJobRow.priority.desc(), TuningJobRow.id).limit(1)
            if self.dialect == "postgresql":
                q = q.with_for_update(skip_locked=True)
            row = s.execute(q).scalar_one_or_none()
            if row is None:
                return None
            if row.status == "running" and row.attempts >= row.max_attempts:
                # its last lease ran out: the worker died on the final attempt
                row.status, row.lease_owner, row.updated_at = "failed", None, now
                row.last_error = (row.last_error or "") + f"\nlease of {row.lease_owner} expired on the last attempt"
                return None
            row.status, row.lease_owner = "running", owner
            row.lease_expires_at = now + timedelta(seconds=lease_s)
            row.attempts += 1
            row.updated_at = now
            return _job_record(row)

    def heartbeat(self, job_id: int, owner: str, lease_s: float = 60.0) -> bool:
        """Extend the lease; False if the job is no longer this owner's (it was reclaimed)."""
        now = utcnow()
        with self._write() as s:
            res = s.execute(update(TuningJobRow).where(
                TuningJobRow.id == job_id, TuningJobRow.lease_owner == owner, TuningJobRow.status == "running")
                .values(lease_expires_at=now + timedelta(seconds=lease_s), updated_at=now))
            return res.rowcount == 1

    def complete_job(self, job_id: int, owner: str) -> bool:
        with self._write() as s:
            res = s.execute(update(TuningJobRow).where(
                TuningJobRow.id == job_id, TuningJobRow.lease_owner == owner, TuningJobRow.status == "running")
                .values(status="done", lease_owner=None, lease_expires_at=None, updated_at=utcnow()))
            return res.rowcount == 1

    def fail_job(self, job_id: int, owner: str, error: str, backoff_s: float = 5.0) -> str | None:
        """Record a failure: back to the queue after a backoff, or `failed` after max attempts."""
        now = utcnow()
        with self._write() as s:
            row = s.execute(select(TuningJobRow).where(TuningJobRow.id == job_id).with_for_update()
                            ).scalar_one_or_none()
            if row is None or row.lease_owner != owner or row.status != "running":
                return None
            row.last_error = error[:8000]
            row.lease_owner, row.lease_expires_at, row.updated_at = None, None, now
            if row.attempts >= row.max_attempts:
                row.status = "failed"
            else:
                row.status = "queued"
                # capped: an exponent of a few dozen attempts would overflow datetime
                row.not_before = now + timedelta(seconds=min(backoff_s * 2 ** min(row.attempts - 1, 30),
                                                             MAX_BACKOFF_S))
            return row.status

    def get_job(self, digest: str) -> JobRecord | None:
        with self._read() as s:
            row = s.execute(select(TuningJobRow).where(TuningJobRow.digest == digest)).scalar_one_or_none()
            return None if row is None else _job_record(row)

    def list_jobs(self, status: str | None = None, limit: int = 1000) -> list[JobRecord]:
        with self._read() as s:
            q = select(TuningJobRow).order_by(TuningJobRow.id).limit(limit)
            if status:
                q = q.where(TuningJobRow.status == status)
            return [_job_record(r) for r in s.execute(q).scalars()]

    # ---- fleet: submissions, tokens and queue state (the service's side of the store) ------

    def publish(self, rec: ConfigRecord, trials: Iterable[TrialRecord] = (), run_id: str | None = None, *,
                submitted_by: str = "", tune_seconds: float | None = None) -> tuple[ConfigRecord, bool, int]:
        """put_config that also records the submission, won or lost, in the same transaction.

        Returns (the kept record, whether `rec` won, the submission's id)."""
        values = _config_values(rec)
        with self._write() as s:
            self._add_trials(s, rec.key, trials, run_id)
            kept, won = self._keep_faster(s, rec, values)
            row = SubmissionRow(**values, submitted_by=submitted_by[:128], accepted=won,
                                tune_seconds=tune_seconds, created_at=utcnow())
            s.add(row)
            s.flush()
            return kept, won, row.id

    def submissions(self, digest: str | None = None, limit: int = 1000) -> list[SubmissionRecord]:
        with self._read() as s:
            q = select(SubmissionRow).order_by(SubmissionRow.id).limit(limit)
            if digest:
                q = q.where(SubmissionRow.digest == digest)
            return [_submission_record(r) for r in s.execute(q).scalars()]

    def create_token(self, name: str, scopes: Iterable[str]) -> tuple[str, TokenRecord]:
        """A new API token; returns (the secret, shown once, never stored; its record)."""
        scopes = tuple(dict.fromkeys(scopes))
        bad = [sc for sc in scopes if sc not in TOKEN_SCOPES]
        if bad or not scopes:
            raise ValueError(f"scopes must be some of {list(TOKEN_SCOPES)}, got {list(scopes)}")
        if not name or len(name) > 128:
            raise ValueError("a token needs a name of 1 to 128 characters")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._write() as s:
            row = ApiTokenRow(name=name, token_hash=hash_token(secret), scopes=",".join(scopes),
                              created_at=utcnow())
            s.add(row)
            s.flush()
            return secret, _token_record(row)

    def verify_token(self, secret: str) -> TokenRecord | None:
        """The live token with this secret, or None (unknown or revoked)."""
        with self._read() as s:
            row = s.execute(select(ApiTokenRow).where(ApiTokenRow.token_hash == hash_token(secret),
                                                      ApiTokenRow.revoked_at.is_(None))).scalar_one_or_none()
            return None if row is None else _token_record(row)

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as s:
            return [_token_record(r) for r in s.execute(select(ApiTokenRow).order_by(ApiTokenRow.id)).scalars()]

    def revoke_token(self, name: str) -> int:
        """Revoke every live token with this name; returns how many."""
        with self._write() as s:
            res = s.execute(update(ApiTokenRow).where(ApiTokenRow.name == name, ApiTokenRow.revoked_at.is_(None))
                            .values(revoked_at=utcnow()))
            return res.rowcount

    def job_counts(self, arch: str | None = None, sm_count: int | None = None) -> dict[str, int]:
        """Jobs per status (the queue depth), optionally of one device class."""
        with self._read() as s:
            q = select(TuningJobRow.status, func.count()).group_by(TuningJobRow.status)
            if arch is not None:
                q = q.where(TuningJobRow.arch == arch)
            if sm_count is not None:
                q = q.where(TuningJobRow.sm_count == sm_count)
            out = {status: 0 for status in JOB_STATUSES}
            out.update({status: n for status, n in s.execute(q)})
            return out

    def get_job_by_id(self, job_id: int) -> JobRecord | None:
        with self._read() as s:
            row = s.get(TuningJobRow, job_id)
            return None if row is None else _job_record(row)

    def job_statuses(self, digests: Iterable[str]) -> dict[str, str]:
        """{digest: status} of the jobs for these digests (absent: no job)."""
        digests = list(digests)
        out: dict[str, str] = {}
        with self._read() as s:
            for i in range(0, len(digests), 500):
                q = select(TuningJobRow.digest, TuningJobRow.status).where(TuningJobRow.digest.in_(digests[i:i + 500]))
                out.update({d: st for d, st in s.execute(q)})
        return out

    def release_job(self, job_id: int, owner: str) -> bool:
        """Give a leased job back to the queue now, without spending an attempt (a worker
        stopped by Ctrl-C or SIGTERM: its job need not wait for the lease to run out)."""
        now = utcnow()
        with self._write() as s:
            res = s.execute(update(TuningJobRow).where(
                TuningJobRow.id == job_id, TuningJobRow.lease_owner == owner, TuningJobRow.status == "running")
                .values(status="queued", lease_owner=None, lease_expires_at=None, not_before=now,
                        attempts=func.max(TuningJobRow.attempts - 1, 0) if self.dialect == "sqlite"
                        else func.greatest(TuningJobRow.attempts - 1, 0), updated_at=now))
            return res.rowcount == 1


_DEFAULT: dict[str, Store] = {}
_DEFAULT_LOCK = threading.Lock()


def default_store() -> Store:
    """The process-wide store for the current TUNECACHE_DB_URL (opened once).

    A local SQLite store that cannot be used as it is still gives a store, read-only, fresh or
    in memory, with one warning (tunecache.local_store); a Postgres URL is the fleet's
    database, whose faults stay loud."""
    from . import settings

    url = settings.db_url()
    store = _DEFAULT.get(url)
    if store is None:
        with _DEFAULT_LOCK:
            store = _DEFAULT.get(url)
            if store is None:
                from .local_store import open_local_store

                store = _DEFAULT[url] = open_local_store(url).store
    return store


# ---- fleet tables: every published result, and the service's API tokens -----------------

JOB_STATUSES = ("queued", "running", "done", "failed")
# what a token may do; a scope implies the ones listed with it
TOKEN_SCOPES = {
    "read": ("read",),
    "publish": ("read", "publish"),
    "worker": ("read", "publish", "worker"),
    "admin": ("read", "publish", "worker", "admin"),
}
TOKEN_PREFIX = "tc_"


class SubmissionRow(Base):
    """One published result, kept whether or not it became the winner (for audit and noise)."""

    __tablename__ = "submissions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    kernel: Mapped[str] = mapped_column(String(128))
    kernel_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(32))
    arch: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    device_name: Mapped[str] = mapped_column(String(128), default="")
    problem: Mapped[Any] = mapped_column(JSON)
    config: Mapped[Any] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    candidates: Mapped[int] = mapped_column(Integer, default=0)
    tuned_by: Mapped[str] = mapped_column(String(128), default="")
    tuned_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    source: Mapped[str] = mapped_column(String(16), default="inline")
    submitted_by: Mapped[str] = mapped_column(String(128), default="")
    accepted: Mapped[bool] = mapped_column(Boolean, default=False)
    tune_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class ApiTokenRow(Base):
    """A service token: only the sha256 of the secret is stored (secrets are 256-bit random,
    so a plain hash is enough; there is nothing to brute-force)."""

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    scopes: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


@dataclass
class SubmissionRecord:
    id: int
    key: TuneKey
    config: dict
    median_ms: float
    tflops: float | None
    candidates: int
    device_name: str
    tuned_by: str
    source: str
    submitted_by: str
    accepted: bool
    tune_seconds: float | None
    created_at: datetime

    @property
    def digest(self) -> str:
        return self.key.digest


@dataclass
class TokenRecord:
    id: int
    name: str
    scopes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None = None

    def allows(self, scope: str) -> bool:
        return any(scope in TOKEN_SCOPES.get(sc, ()) for sc in self.scopes)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def _config_values(rec: ConfigRecord) -> dict:
    return dict(digest=rec.digest, **rec.key.fields(), device_name=rec.device_name, config=rec.config,
                median_ms=rec.median_ms, tflops=rec.tflops, candidates=rec.candidates,
                tuned_by=rec.tuned_by or whoami(), tuned_at=rec.tuned_at or utcnow(), source=rec.source)


def _submission_record(row: SubmissionRow) -> SubmissionRecord:
    return SubmissionRecord(id=row.id, key=_key_of(row), config=row.config, median_ms=row.median_ms,
                            tflops=row.tflops, candidates=row.candidates, device_name=row.device_name,
                            tuned_by=row.tuned_by, source=row.source, submitted_by=row.submitted_by,
                            accepted=bool(row.accepted), tune_seconds=row.tune_seconds, created_at=row.created_at)


def _token_record(row: ApiTokenRow) -> TokenRecord:
    return TokenRecord(id=row.id, name=row.name, scopes=tuple(filter(None, row.scopes.split(","))),
                       created_at=row.created_at, revoked_at=row.revoked_at)
