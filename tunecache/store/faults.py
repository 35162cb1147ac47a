"""What the store raises, and what a fault of the database means, in words a user understands
("the disk holding /x/y.sqlite is full").

No SQLAlchemy here (the queue adapters catch JobStateError without loading it). The tuple of
everything a store call raises when the database itself fails, STORE_ERRORS, is in
`tunecache.store.engine`, since it names SQLAlchemy's errors.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path


class StoreError(RuntimeError):
    """The store could not be opened or used; the message names the URL."""


class ReadOnlyStoreError(StoreError):
    """A write to a store opened read-only (by tunecache.store.local, which has already warned
    once saying why). put_config and add_trials skip instead of raising this."""


class JobStateError(ValueError):
    """A queue operation that the job's state does not allow (retrying a running job); the
    message says what to do instead."""


class NewerSchemaError(StoreError):
    """The store was migrated by a newer tunecache: this one must neither migrate nor write it."""

    def __init__(self, message: str, revision: str, head: str) -> None:
        super().__init__(message)
        self.revision, self.head = revision, head


# ---- faults of the database, in words --------------------------------------------------

# SQLite's primary result codes (the low byte of an extended code) that say what is wrong
_SQLITE_FAULTS = {
    5: "locked",
    6: "locked",
    8: "read-only",
    10: "io",
    11: "corrupt",
    13: "full",
    14: "cantopen",
    26: "corrupt",
}
# the same, from an error's text (a driver without codes, or a message passed on as text)
_TEXT_FAULTS = (
    ("database or disk is full", "full"),
    ("disk i/o error", "io"),
    ("readonly database", "read-only"),
    ("file is not a database", "corrupt"),
    ("disk image is malformed", "corrupt"),
    ("is locked", "locked"),
    ("unable to open database file", "cantopen"),
    ("can't locate revision", "newer"),
)
_OS_FAULTS = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "full",
    errno.EROFS: "read-only",
    errno.EACCES: "denied",
    errno.EPERM: "denied",
    errno.EIO: "io",
}
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
        damaged = any(
            (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF == 11 or "malformed" in str(e).lower()
            for e in _error_chain(exc)
        )
        return f"{name} is damaged (corrupt)" if damaged else f"{name} is not a SQLite database (corrupt)"
    if kind == "locked":
        from tunecache import settings

        return (
            f"{name} is locked by another process (it held a write lock past the busy timeout of "
            f"{settings.db_busy_timeout_s():g} s)"
        )
    return {
        "full": f"the disk holding {p if p is not None else 'the store'} is full",
        "io": f"reading or writing {name} failed with a disk I/O error (the disk may be failing)",
        "read-only": f"{name} is read-only",
        "denied": f"{name} cannot be written (permission denied)",
        "cantopen": f"{name} cannot be opened or created",
        "newer": f"{name} was written by a newer tunecache (its schema revision is unknown to this one)",
    }[kind]
