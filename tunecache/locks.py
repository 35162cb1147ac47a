"""Where the processes of one host meet: one tune per key (`tune_turn`), one timer per GPU
(`gpu_timer`).

The ranks of a job (torchrun: one process per GPU, several per GPU at times) meet the same new
shapes at the same moment. Without a meeting point every rank tunes every shape, and two
processes time candidates on one GPU at once, each timing the other's noise. Both locks are
file locks (flock, through `filelock`) in TUNECACHE_LOCK_DIR: the kernel releases them when
their process dies, so a killed process never leaves one held, and any user of the host may take
them (the files are made world-writable in a sticky directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tunecache import settings

log = logging.getLogger("tunecache")


def _dir(*parts: str) -> Path:
    d = Path(settings.lock_dir())
    if not d.is_dir():
        d.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # someone else's directory: it is theirs to open up
            os.chmod(d, 0o1777)
    for p in parts:
        d = d / p
        d.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(d, 0o1777)
    return d


def lock_file(name: str, *parts: str) -> Path:
    """The path of a lock file `name` in TUNECACHE_LOCK_DIR (under the folders `parts`), made
    there: the one place where the processes of a host meet, so none is left beside user files."""
    return _dir(*parts) / name


def _lock(path: Path):
    from filelock import FileLock

    # not reentrant across threads: two threads of a process tune (or time) one at a time too
    return FileLock(str(path), mode=0o666, thread_local=False, is_singleton=False)


# ---- one timer per GPU ----------------------------------------------------------------------


@contextlib.contextmanager
def gpu_timer(device: str) -> Iterator[None]:
    """Hold the timer of `device` (a GPU's UUID, or "cpu" for the interpreter) while the block
    runs candidates and times them: no other process of the host times on that GPU meanwhile.
    Compiles never take it."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", device)[:100] or "gpu"
    with _lock(_dir() / f"timer-{name}.lock"):
        start = time.time()
        try:
            yield
        finally:
            trace = settings.timing_trace()
            if trace:
                line = json.dumps({"pid": os.getpid(), "device": device, "start": start, "end": time.time()})
                with contextlib.suppress(OSError), open(trace, "a") as f:
                    f.write(line + "\n")


# ---- one tune per key ----------------------------------------------------------------------


@dataclass
class Turn:
    """A process's turn at a key: whether it waited for another process's tune first (then the
    winner is likely kept already: read it before tuning), and whether it holds the key now."""

    waited: bool
    held: bool
    # a config another host of the fleet tuned this key to and submitted (`Fleet.announce`): a
    # claim measured there only, to time against the default before it runs here
    hint: dict | None = None


def _holder_text(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
        since = time.strftime("%H:%M:%S", time.localtime(d["since"]))
        return f"process {d['pid']} on {d['host']} ({d['what']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process of this host"


@contextlib.contextmanager
def tune_turn(store_url: str, digest: str, what: str, wait: bool = True) -> Iterator[Turn]:
    """One tune of a key per host and store: the first process to miss it tunes while the block
    runs; the others wait here (saying for whom, at most TUNECACHE_TUNE_WAIT_S), then read the
    winner it kept. A holder that dies releases the key at once; one that outlives the bound is
    left to finish, and the waiter tunes the key itself. `wait=False`: never wait (the turn is
    not held when another process holds the key: come back to it later)."""
    from filelock import Timeout

    room = hashlib.sha256(store_url.encode()).hexdigest()[:16]  # processes of one store meet
    path = _dir(room) / f"tune-{digest[:32]}.lock"
    holder = path.with_suffix(".holder")
    lock = _lock(path)
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            yield Turn(waited=False, held=False)
            return
        waited = True
        bound = settings.tune_wait_s()
        log.warning(
            "tunecache: %s is being tuned by %s: waiting for its winner (at most %g s, TUNECACHE_TUNE_WAIT_S)",
            what,
            _holder_text(holder),
            bound,
        )
        try:
            lock.acquire(timeout=bound)
        except Timeout:
            log.warning("tunecache: %s: still being tuned after %g s; tuning it in this process too", what, bound)
            yield Turn(waited=True, held=False)
            return
    try:
        with contextlib.suppress(OSError):
            holder.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "what": Path(sys.argv[0]).name or "python",
                        "since": time.time(),
                    }
                )
            )
        yield Turn(waited=waited, held=True)
    finally:
        with contextlib.suppress(OSError):
            holder.unlink()
        lock.release()
