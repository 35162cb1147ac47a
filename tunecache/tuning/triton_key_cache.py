"""Triton's own cache key (`triton.runtime.cache.triton_key`), remembered across processes.

Every entry of Triton's cache is keyed by `triton_key()`: Triton's version and a sha256 of
libtriton (a few hundred MB) and of its compiler, backend and language sources. A process
computes it at its first compile lookup, which made it the largest part of a warm host's
first call (0.2-0.4 s). It is a pure function of those files, so it is kept in a small JSON
file in Triton's cache directory, under a fingerprint of the same files (path, size, mtime and inode:
any reinstall or edit changes it, and then the key is computed again and kept), and handed to
Triton the way Triton's own compile warm-up pool hands it to its workers: by setting
`triton.runtime.cache.triton_key`. The value is Triton's, never a guess: a fingerprint that
is not in the file is computed by Triton itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("tunecache")

_DONE: list[bool] = []
_LOCK = threading.Lock()
_KEEP = 4  # fingerprints kept in the file (a host with a few Triton installs)


def install() -> None:
    """Give this process Triton's key from the file when the files it hashes are unchanged;
    compute and keep it otherwise. Once per process; never raises."""
    if _DONE:
        return
    with _LOCK:
        if _DONE:
            return
        _DONE.append(True)
        try:
            _install()
        except Exception as e:  # noqa: BLE001 - Triton computes its key itself, as without this
            log.debug("tunecache: Triton's cache key is computed by Triton (%s)", e)


def _install() -> None:
    import triton.runtime.cache as cache

    real = cache.triton_key
    if not hasattr(real, "cache_info") or real.cache_info().currsize:  # replaced, or computed already
        return
    fingerprint = _fingerprint(Path(cache.__file__).resolve().parent.parent)
    path = _path()
    known = _read(path)
    key = known.get(fingerprint)
    if not isinstance(key, str):
        key = real()
        known = {fingerprint: key, **{k: v for k, v in list(known.items())[: _KEEP - 1] if k != fingerprint}}
        _write(path, known)
    cache.triton_key = lambda: key


def _fingerprint(root: Path) -> str:
    """The files `triton_key` hashes (and their neighbours): path, size, mtime, inode."""
    h = hashlib.sha256()
    import triton

    h.update(triton.__version__.encode())
    files = [root / "runtime" / "cache.py"]
    files += [p for p in (root / "_C").iterdir() if p.name.startswith("libtriton")]
    for sub in ("compiler", "backends", "language"):
        for dirpath, dirnames, filenames in os.walk(root / sub):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            files += [Path(dirpath) / f for f in sorted(filenames)]
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()


def _path() -> Path:
    from triton import knobs

    return Path(knobs.cache.dir) / "tunecache-triton-key.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full disk: the next process computes it again
        log.debug("tunecache: cannot keep Triton's cache key in %s: %s", path, e)
