"""The process's own store: opened once per URL, and the writes a call leaves beside it.

Kept apart from `tunecache.store` (SQLAlchemy, 0.5 s to import) so that a warm or fresh
host's first call can ask whether it has a store at all without importing it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tunecache.store import Store

_DEFAULT: dict[str, "Store"] = {}
_DEFAULT_LOCK = threading.Lock()


MAX_BEHIND = 10_000  # writes waiting beside the calls (a store locked for hours holds them all)
PROBE_S = 1.0  # how often a store found locked is asked again, without waiting
HOLD_S = 5.0
_WRITER = "tunecache-store-writer"
_LET_GO = threading.Event()  # cleared while a call's slow path holds the writes back
_LET_GO.set()
_LOCKED: set[str] = set()  # stores whose lock another process held past the busy timeout

log = logging.getLogger("tunecache")


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


# ---- a store another process holds locked -------------------------------------------------


def mark_locked(url: str) -> None:
    """A write to `url` waited out the busy timeout on another process's lock: its writes wait
    aside (the writer thread asks again every PROBE_S, without waiting) and no call waits for it."""
    _LOCKED.add(url)


def is_locked(url: str) -> bool:
    """Whether `url` was found locked and has not answered since (`mark_locked`)."""
    return url in _LOCKED


def _answers(url: str) -> bool:
    """Whether a store found locked can be written again: its write lock taken and given back
    at once, never waiting (a store that is not a SQLite file: the next write tries)."""
    import sqlite3

    from tunecache.store.engine import sqlite_path

    path = sqlite_path(url)
    if path is not None:
        try:
            conn = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            finally:
                conn.close()
        except sqlite3.Error:
            return False
    _LOCKED.discard(url)
    return True


# ---- the writer thread --------------------------------------------------------------------

Write = Callable[[], "bool | None"]  # False: the store was locked, to be tried again once it answers


class _Writer:
    """One thread that makes, in order, the writes calls leave beside them. The writes of a store
    found locked wait aside (`_held`) until it answers again; those of other stores, and the
    fleet's requests, go on. At the interpreter's exit it makes what is left, asks a locked store
    once more and says what it could not keep."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._todo: deque[tuple[str | None, Write]] = deque()
        self._held: deque[tuple[str | None, Write]] = deque()
        self._running = False
        self._stopping = False
        self._probe_at = 0.0
        self._dropped = 0
        self._thread: threading.Thread | None = None

    def put(self, write: Write, url: str | None) -> None:
        with self._cv:
            if self._stopping:
                pass  # the interpreter is exiting: made here, at once (below)
            elif len(self._todo) + len(self._held) >= MAX_BEHIND:
                self._dropped += 1
                if self._dropped == 1:
                    log.warning(
                        "tunecache: %d writes wait beside the calls (the local store is locked or slow); "
                        "dropping the newest until it catches up",
                        MAX_BEHIND,
                    )
                return
            else:
                self._todo.append((url, write))
                if self._thread is None:
                    self._start()
                self._cv.notify_all()
                return
        write()

    def _start(self) -> None:
        try:
            threading._register_atexit(self.stop)  # type: ignore[attr-defined] - joined before the interpreter exits
        except (AttributeError, RuntimeError):  # the interpreter is exiting already
            import atexit

            atexit.register(self.stop)
        self._thread = threading.Thread(target=self._run, name=_WRITER, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._todo and not self._stopping:
                    self._cv.wait(PROBE_S if self._held else None)
                if self._held and time.monotonic() >= self._probe_at:
                    self._probe()
                if not self._todo:
                    if self._stopping:
                        self._give_up()
                        return
                    continue
                url, write = self._todo.popleft()
                self._running = True
            try:
                if url is None or url not in _LOCKED:
                    _LET_GO.wait(HOLD_S)
                    done = write()
                else:
                    done = False
            except Exception as e:  # noqa: BLE001 - a write reports its own faults; this thread goes on
                log.debug("tunecache: a write beside the call failed: %s", e)
                done = True
            with self._cv:
                if done is False and url is not None:
                    self._held.append((url, write))
                self._running = False
                self._cv.notify_all()

    def _probe(self) -> None:
        """Ask each locked store of the held writes again; the writes of one that answers go first."""
        self._probe_at = time.monotonic() + PROBE_S
        answering = {url for url, _ in self._held if url not in _LOCKED or _answers(url)}
        if answering:
            back = [w for w in self._held if w[0] in answering]
            self._held = deque(w for w in self._held if w[0] not in answering)
            self._todo.extendleft(reversed(back))
        if self._stopping:
            self._probe_at = float("inf")  # at the exit: asked once more, not again

    def _give_up(self) -> None:
        if self._held:
            urls = sorted({url for url, _ in self._held if url})
            # info: the warning given when it was found locked said that these would be lost
            log.info(
                "tunecache: %d write(s) to the local store were not kept: %s is still locked by another process",
                len(self._held),
                ", ".join(urls),
            )
            self._held.clear()

    def settle(self) -> None:
        """Wait until the writes left so far are made (those of a locked store excepted)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return
        with self._cv:
            self._cv.wait_for(lambda: not self._todo and not self._running)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._probe_at = 0.0
            self._cv.notify_all()
        _LET_GO.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()


_BEHIND = _Writer()


def _after_fork() -> None:  # a forked child has no writer thread: it starts its own
    global _BEHIND
    _BEHIND = _Writer()


os.register_at_fork(after_in_child=_after_fork)


def write_behind(write: Write, url: str | None = None) -> None:
    """Leave `write` to the writer thread: the call that leaves it never waits for it (nor for
    the store it writes, `url`, being locked by another process), and it is made before a clean
    exit of the interpreter. The thread starts on it once the writes are let go (`hold_writes`);
    `default_store()` of another thread lets them go and waits for them first (`settle`), so a
    reader that asks reads what was written. `write` returns False when it found `url` locked:
    it waits aside and is made once the store answers again."""
    _BEHIND.put(write, url)


def hold_writes() -> None:
    """Keep the writer thread off until `release_writes` (at most HOLD_S): opening a store is
    0.7 s of Python (SQLAlchemy, the schema) that would share the interpreter with the call's
    own work, so a call's slow path holds it until its kernel is launched."""
    _LET_GO.clear()


def release_writes() -> None:
    _LET_GO.set()


def settle() -> None:
    """Wait for the writes left to the writer thread (from any other thread), but for those
    that wait for a store another process holds locked."""
    release_writes()  # whoever needs the store now is worth more than what held the writes
    _BEHIND.settle()


def default_store(url: str | None = None, *, settle_writes: bool = True) -> "Store":
    """The process-wide store for `url` (default: the current TUNECACHE_DB_URL), opened once,
    after the writes left beside the calls are made (`settle_writes=False`: a call's read, which
    never waits for them).

    A local SQLite store that cannot be used as it is still gives a store, read-only, fresh or
    in memory, with one warning (tunecache.store.local); a Postgres URL is the fleet's
    database, whose faults stay loud."""
    from tunecache import settings

    if settle_writes:
        settle()
    url = url or settings.db_url()
    store = _DEFAULT.get(url)
    if store is None:
        with _DEFAULT_LOCK:
            store = _DEFAULT.get(url)
            if store is None:
                from tunecache.store.local import open_local_store

                store = _DEFAULT[url] = open_local_store(url).store
    return store
