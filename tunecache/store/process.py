"""The process's own store: opened once per URL, and the writes a call leaves behind it.

Kept apart from `tunecache.store` (SQLAlchemy, 0.5 s to import) so that a warm or fresh
host's first call can ask whether it has a store at all without importing it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tunecache.store import Store

_DEFAULT: dict[str, "Store"] = {}
_DEFAULT_LOCK = threading.Lock()


_BEHIND: list = []  # [the writer thread's ThreadPoolExecutor], made on first use
_PENDING: list = []  # its writes not yet done (Futures)
_WRITER = "tunecache-store-writer"
_LET_GO = threading.Event()  # cleared while a call's slow path holds the writes back
_LET_GO.set()
HOLD_S = 5.0


def store_is_open(url: str) -> bool:
    """Whether this process has opened its store for `url` already."""
    return url in _DEFAULT


def holds_nothing_yet(url: str) -> bool:
    """A SQLite store that this process has not opened and that has no file: a read of it
    finds nothing (tunecache.store.quick_read.no_file) but what the writer thread is about to write,
    which this process holds already (a fleet copy in its launcher's memo, a verdict among
    selfcheck's), so the read need not wait for it."""
    from tunecache.store.quick_read import no_file

    return url not in _DEFAULT and no_file(url)


def write_behind(write: Callable[[], None]) -> None:
    """Leave `write` (which opens the store through `default_store`) to one writer thread,
    which starts on it once the writes are let go (`hold_writes`). Every later
    `default_store()` of another thread lets them go and waits for them first, so the process
    reads what it wrote; the thread is joined at the interpreter's exit (concurrent.futures),
    so a script that ends at once still keeps them."""
    with _DEFAULT_LOCK:
        if not _BEHIND:
            from concurrent.futures import ThreadPoolExecutor

            _BEHIND.append(ThreadPoolExecutor(1, thread_name_prefix=_WRITER))
        _PENDING.append(_BEHIND[0].submit(_when_let_go, write))


def hold_writes() -> None:
    """Keep the writer thread off until `release_writes` (at most HOLD_S): opening a store is
    0.7 s of Python (SQLAlchemy, the schema) that would share the interpreter with the call's
    own work, so a call's slow path holds it until its kernel is launched."""
    _LET_GO.clear()


def release_writes() -> None:
    _LET_GO.set()


def _when_let_go(write: Callable[[], None]) -> None:
    _LET_GO.wait(HOLD_S)
    write()


def settle() -> None:
    """Wait for the writes left to the writer thread (from any other thread)."""
    if not _PENDING or threading.current_thread().name.startswith(_WRITER):
        return
    release_writes()  # whoever needs the store now is worth more than what held the writes
    with _DEFAULT_LOCK:
        pending = list(_PENDING)
    for f in pending:
        f.exception()  # the write reports its own faults (ConfigCache.store_call)
    with _DEFAULT_LOCK:
        _PENDING[:] = [f for f in _PENDING if f not in pending]


def default_store() -> "Store":
    """The process-wide store for the current TUNECACHE_DB_URL (opened once).

    A local SQLite store that cannot be used as it is still gives a store, read-only, fresh or
    in memory, with one warning (tunecache.store.local); a Postgres URL is the fleet's
    database, whose faults stay loud."""
    from tunecache import settings

    settle()
    url = settings.db_url()
    store = _DEFAULT.get(url)
    if store is None:
        with _DEFAULT_LOCK:
            store = _DEFAULT.get(url)
            if store is None:
                from tunecache.store.local import open_local_store

                store = _DEFAULT[url] = open_local_store(url).store
    return store
