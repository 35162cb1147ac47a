"""Opening the local SQLite store so that its faults never fail the caller.

The local store can sit on a read-only file system or a full disk, be corrupt, be migrated by
a newer tunecache or be locked by a stuck process. `open_local_store` returns the best store
that still works (the file as it is, the file read-only, a fresh file with the corrupt one
moved aside, or a store in memory that keeps this process's results) and logs one warning
that says what happened and what it did about it. A healthy store opens as `Store(url)` does
(one small query, no Alembic import) plus one access(2) call.

Faults that come later (the disk fills up, the file is replaced) surface from the Store's
methods as one of `STORE_ERRORS`, which `describe_fault` words for the caller to warn with.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from tunecache.errors import short
from tunecache.store import STORE_ERRORS, Store, describe_fault, fault_kind, sqlite_path, sqlite_url
from tunecache.store.migrate import store_file_lock

log = logging.getLogger("tunecache.store")

_SQLITE_HEADER = b"SQLite format 3\x00"


@dataclass(frozen=True)
class LocalStoreHandle:
    """The store to use, and what opening it ran into."""

    store: Store
    outcome: str = "ok"  # ok | read-only | fresh (a corrupt file was moved aside) | memory
    fault: str | None = None  # the warning that was logged, in words; None if it opened as it is
    moved_to: Path | None = None  # where the corrupt file went (outcome "fresh")


def open_local_store(url: str | None = None) -> LocalStoreHandle:
    """Open the SQLite store at `url` (default: TUNECACHE_DB_URL or the user cache dir's), never
    failing for a fault of the file: see the module's docstring. A URL that is not a SQLite
    file (Postgres, an invalid URL, `sqlite://`) opens as `Store(url)` does, errors included."""
    from tunecache import settings

    url = url or settings.db_url()
    path = sqlite_path(url)
    if path is None:
        return LocalStoreHandle(Store(url))
    try:
        store = Store(url)
    except Exception as e:  # only the store's faults: anything else is re-raised
        if not _is_store_fault(e):
            raise
        fault: BaseException = e
    else:
        if os.access(path, os.W_OK):
            return LocalStoreHandle(store)
        # SQLite opens a file it may not write read-only without a word: every write would fail
        store.close()
        fault = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    # outside the `except`: what goes wrong while recovering must not carry this fault as context
    handle = _recover(url, path, fault)
    log.warning("tunecache: %s", handle.fault)
    return handle


def _is_store_fault(e: BaseException) -> bool:
    # Alembic's errors too (a revision it cannot find), without importing Alembic to name them
    return isinstance(e, STORE_ERRORS) or type(e).__module__.split(".")[0] == "alembic"


def _recover(url: str, path: Path, exc: BaseException) -> LocalStoreHandle:
    kind = fault_kind(exc)
    cause = describe_fault(exc, path) or f"the store file {path} cannot be opened ({_driver_error(exc)})"
    if kind == "corrupt":
        return _replace_corrupt(url, path, cause)
    # read-only, full, locked, newer schema, or not known: read what is there, if anything
    if _has_content(path):
        try:
            return LocalStoreHandle(_open_read_only(path), "read-only", f"{cause}: using it read-only")
        except STORE_ERRORS as e:
            cause += f", and it cannot be read either ({_why(e, path)})"
    return _in_memory(cause)


def _open_read_only(path: Path) -> Store:
    """The file opened read-only, with a lookup tried (it reads every column we read). SQLite
    reads a WAL store through a shared-memory file next to it; where that cannot be created (a
    read-only file system, a full disk) the file is opened as immutable: nothing can change it
    there, and what a crashed writer left in its -wal file is not seen."""
    last: BaseException | None = None
    for params in ({"mode": "ro"}, {"mode": "ro", "immutable": "1"}):
        store = None
        try:
            store = Store(sqlite_url(path, **params), migrate=False, writable=False)
            store.get_config("0" * 64)
            return store
        except STORE_ERRORS as e:
            last = e
            if store is not None:
                store.close()
    assert last is not None
    raise last


def _in_memory(cause: str) -> LocalStoreHandle:
    return LocalStoreHandle(Store.in_memory(), "memory", f"{cause}: keeping results in memory for this process")


def _replace_corrupt(url: str, path: Path, cause: str) -> LocalStoreHandle:
    """Move the corrupt file (and its -wal and -shm) aside and start a fresh store in its place."""
    try:
        with store_file_lock(path):
            # another process may have moved it and started a fresh one since we looked
            moved = _move_aside(path) if _still_corrupt(path) else None
    except OSError as e:
        return _in_memory(f"{cause}, and it cannot be moved aside ({_why(e, path)})")
    try:
        store = Store(url)
    except STORE_ERRORS as e:
        what = (
            f": moved aside to {moved}, but a fresh store cannot be made"
            if moved
            else ", and it still cannot be opened"
        )
        return _in_memory(f"{cause}{what} ({_why(e, path)})")
    if moved is None:  # another process moved it aside first
        return LocalStoreHandle(store, "ok", f"{cause} when first opened; another process has replaced it since")
    return LocalStoreHandle(store, "fresh", f"{cause}: moved aside to {moved} and started a fresh store", moved)


def _still_corrupt(path: Path) -> bool:
    """Whether the file is corrupt now: a header that is not SQLite's, or a failed quick check.
    A missing or empty file is not (an empty file is a new store)."""
    try:
        with open(path, "rb") as f:
            header = f.read(len(_SQLITE_HEADER))
    except FileNotFoundError:
        return False
    if not header:
        return False
    if header != _SQLITE_HEADER:
        return True
    try:
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("PRAGMA quick_check").fetchone()[0] != "ok"
        finally:
            conn.close()
    except sqlite3.Error as e:
        return fault_kind(e) == "corrupt"


def _move_aside(path: Path) -> Path:
    """Rename the file to `<name>.corrupt-<UTC time>`, its -wal and -shm first: a fresh store
    must never find the old one's write-ahead log beside it."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    dest = base = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while any(Path(f"{dest}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
        dest, n = base.with_name(f"{base.name}-{n}"), n + 1
    for suffix in ("-wal", "-shm", ""):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{dest}{suffix}")
    return dest


def _has_content(path: Path) -> bool:
    """A file with something to read (a store whose creation failed on a full disk is empty)."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _why(e: BaseException, path: Path) -> str:
    words = describe_fault(e, path)
    if words is not None:
        return words
    if "no such column" in str(e) or "no such table" in str(e):
        return "it lacks tables or columns this tunecache reads"
    return _driver_error(e)


def _driver_error(e: BaseException) -> str:
    """An unforeseen error, briefly: the driver's message rather than SQLAlchemy's with its SQL."""
    orig = getattr(e, "orig", None)
    return short(f"{type(e).__name__}: {orig if isinstance(orig, BaseException) else e}")
