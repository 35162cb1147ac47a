"""The process's own store: opened once per URL, and the writes a call leaves behind it.

Kept apart from `tunecache.store` (SQLAlchemy, 0.5 s to import) so that a warm or fresh
host's first call can ask whether it has a store at all without importing it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .store import Store

_DEFAULT: dict[str, "Store"] = {}
_DEFAULT_LOCK = threading.Lock()


_BEHIND: list = []  # [the writer thread's ThreadPoolExecutor], made on first use
_PENDING: list = []  # its writes not yet done (Futures)
_WRITER = "tunecache-store-writer"


def store_is_open(url: str) -> bool:
    """Whether this process has opened its store for `url` already."""
    return url in _DEFAULT


def holds_nothing_yet(url: str) -> bool:
    """A SQLite store that this process has not opened, with no file and nothing left to the
    writer thread: every read of it finds nothing (tunecache.quick_read.no_file)."""
    from .quick_read import no_file

    return url not in _DEFAULT and not _PENDING and no_file(url)


def write_behind(write: Callable[[], None]) -> None:
    """Leave `write` (which opens the store through `default_store`) to one writer thread.
    Every later `default_store()` of another thread waits for it first, so the process reads
    what it wrote; the thread is joined at the interpreter's exit (concurrent.futures), so a
    script that ends at once still keeps it."""
    with _DEFAULT_LOCK:
        if not _BEHIND:
            from concurrent.futures import ThreadPoolExecutor

            _BEHIND.append(ThreadPoolExecutor(1, thread_name_prefix=_WRITER))
        _PENDING.append(_BEHIND[0].submit(write))


def settle() -> None:
    """Wait for the writes left to the writer thread (from any other thread)."""
    if not _PENDING or threading.current_thread().name.startswith(_WRITER):
        return
    with _DEFAULT_LOCK:
        pending = list(_PENDING)
    for f in pending:
        f.exception()  # the write reports its own faults (ConfigCache.store_call)
    with _DEFAULT_LOCK:
        _PENDING[:] = [f for f in _PENDING if f not in pending]


def default_store() -> "Store":
    """The process-wide store for the current TUNECACHE_DB_URL (opened once).

    A local SQLite store that cannot be used as it is still gives a store, read-only, fresh or
    in memory, with one warning (tunecache.local_store); a Postgres URL is the fleet's
    database, whose faults stay loud."""
    from . import settings

    settle()
    url = settings.db_url()
    store = _DEFAULT.get(url)
    if store is None:
        with _DEFAULT_LOCK:
            store = _DEFAULT.get(url)
            if store is None:
                from .local_store import open_local_store

                store = _DEFAULT[url] = open_local_store(url).store
    return store
