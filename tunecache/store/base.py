"""The store's connection: opening a database (migrated on first open), its sessions and clock.

The other concerns of `Store` (tunecache.store.configs, .jobs, .trust) build on this one."""

from __future__ import annotations

import contextlib
import logging
import uuid
from datetime import datetime
from typing import Any, Iterable, Iterator, TypeVar

from sqlalchemy import DateTime, func, literal_column, select, type_coerce
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import Session, sessionmaker

from tunecache.store.engine import make_engine, sqlite_path
from tunecache.store.faults import (
    NewerSchemaError,
    ReadOnlyStoreError,
    StoreError,
    describe_fault,
)
from tunecache.store.records import (
    ConfigRecord,
)
from tunecache.store.rows import (
    Base,
    TunedConfigRow,
    config_record,
)

log = logging.getLogger("tunecache.store")

# A new result replaces a stored one only when it is this much faster: timing noise must
# not flip the winner back and forth between hosts.
REPLACE_MARGIN = 0.03
# a claim passes over at most this many lapsed last attempts and unreadable rows per call
CLAIM_SCAN = 100
LEASE_PREFIX = "tcl_"
TOKEN_PREFIX = "tc_"


def _readable(rows: Iterable[TunedConfigRow]) -> list[ConfigRecord]:
    """The rows as records, a corrupt one reported and skipped."""
    out = []
    for row in rows:
        try:
            out.append(config_record(row))
        except (ValueError, TypeError, KeyError) as e:
            log.warning("tunecache: skipping corrupt store row %s (%s)", row.digest[:12], e)
    return out


def locked(s: Session, row_type: Any, digest: str) -> Any:
    """The `row_type` row (TunedConfigRow, TuningJobRow) of `digest`, locked for this write
    (FOR UPDATE, where the database has it); None if there is none."""
    return s.execute(select(row_type).where(row_type.digest == digest).with_for_update()).scalar_one_or_none()


_S = TypeVar("_S", bound="StoreBase")


class StoreBase:
    """One database, local or fleet. Thread-safe; safe for many processes on one SQLite file.

    A store opened with `writable=False` (tunecache.store.local does, for a file it may only
    read) skips put_config and add_trials, and raises ReadOnlyStoreError on any other write.
    """

    def __init__(self, url: str | None = None, *, migrate: bool = True, writable: bool = True) -> None:
        from tunecache import settings

        self.url = url or settings.db_url()
        self.writable = writable
        self.path = sqlite_path(self.url)  # the SQLite file; None in memory or on Postgres
        self._keepalive: Any = None
        self.engine = make_engine(self.url, writable=writable)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write_maker = sessionmaker(self.engine.execution_options(tunecache_write=True), expire_on_commit=False)
        try:
            if migrate:
                self._migrate()
            else:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
        except DatabaseError as e:
            raise StoreError(
                f"cannot open the store at {self.safe_url} (TUNECACHE_DB_URL): {describe_fault(e, self.path) or e.orig}"
            ) from None

    def _migrate(self) -> None:
        """Upgrade to head unless already there (the common case costs one small query and no
        Alembic import); a store migrated by a newer tunecache is refused, never downgraded."""
        from tunecache.store.migrate import current_revision, head_revision

        head = head_revision()
        current = current_revision(self.engine)
        if current == head:
            return
        if current is not None and not (current.isdigit() and int(current) < int(head)):
            what = (
                f"was written by a newer tunecache (schema revision {current}, this one knows up to {head})"
                if current.isdigit()
                else f"has schema revision {current!r}, unknown to this tunecache (it knows up to {head})"
            )
            raise NewerSchemaError(f"{self._where()} {what}", current, head)
        from tunecache.store.migrate import upgrade

        upgrade(self.engine)

    @classmethod
    def in_memory(cls: type[_S]) -> _S:
        """A store in this process's memory, schema created: what this process tunes is kept
        for its lifetime only (the last resort of tunecache.store.local)."""
        # a named shared-cache database, so that every pooled connection (one per thread at
        # a time) sees the same one; it lives while a connection to it is open
        store = cls(f"sqlite:///file:tunecache-{uuid.uuid4().hex}?mode=memory&cache=shared&uri=true", migrate=False)
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
            raise ReadOnlyStoreError(
                f"{self._where()} is open read-only: nothing can be written to it (the "
                f"warning given when it was opened says why)"
            )
        with self._write_maker.begin() as s:
            yield s

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        self.engine.dispose()

    # ---- configs ------------------------------------------------------------------------

    def _now_sql(self, plus_s: float = 0.0) -> Any:
        """The database's time (+ `plus_s` seconds) as naive UTC, computed in SQL: replicas of
        the service whose clocks disagree still agree on every lease and backoff."""
        if self.dialect == "postgresql":
            now = func.now()
            if plus_s:
                now = now + literal_column("interval '1 second'") * float(plus_s)
            return type_coerce(func.timezone("UTC", now), DateTime)
        # SQLite's own clock, in the text form SQLAlchemy stores DateTime in (text order = time order)
        return type_coerce(func.strftime("%Y-%m-%d %H:%M:%f000", "now", f"{float(plus_s):+.3f} seconds"), DateTime)

    def db_now(self) -> datetime:
        """The database's time now (naive UTC): the clock of every lease, backoff and wait."""
        with self._read() as s:
            return s.execute(select(self._now_sql())).scalar_one()
