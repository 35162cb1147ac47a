"""A warm host's first call reads its config with the standard library's sqlite3.

Importing SQLAlchemy and opening the `Store` (engine, migrations check) costs more than the
call itself: about 0.5 s of the first `ops.matmul` on a host that already has its config. The
reads a first call needs, a key's winner (and its trials, for `@tunecache.autotune`) and a
backend's self-check verdict, are indexed SELECTs; this module does them directly on a local
SQLite store whose schema is at head.

Anything else answers UNKNOWN and the caller opens the Store as before: a URL other than a
plain `sqlite:///path` (Postgres, query options), no file yet, a schema at another revision, a
row that does not read back as its own key, any sqlite3 error (a lock, a corrupt file: the
Store's fault handling names it). Writes always go through the Store.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from tunecache.key import TuneKey
from tunecache.store.records import ConfigRecord, TrialRecord

UNKNOWN: Any = object()

_REVISION_FILE = re.compile(r"^(\d{4})_\w+\.py$")
_CONNECTIONS: dict[str, sqlite3.Connection | None] = {}
_LOCK = threading.Lock()
_HEAD: list[str | None] = []

_CONFIG_COLUMNS = (
    "digest",
    "kernel",
    "kernel_version",
    "triton_version",
    "arch",
    "sm_count",
    "problem",
    "config",
    "median_ms",
    "tflops",
    "candidates",
    "default_ms",
    "vendor_ms",
    "device_name",
    "tuned_by",
    "tuned_at",
    "source",
    "fleet_checked_at",
    "fleet_generation",
)


def head_revision() -> str | None:
    """The newest Alembic revision shipped. Revisions are named NNNN_what_it_does.py with
    revision id NNNN and form one line, so the head is the largest NNNN; reading file names
    instead of loading Alembic keeps opening a store cheap (tests check this against Alembic)."""
    if not _HEAD:
        from importlib.util import find_spec

        spec = find_spec("tunecache_migrations")
        folder = Path(next(iter(spec.submodule_search_locations))) / "versions" if spec else None
        try:
            ids = [m.group(1) for f in os.listdir(folder) if (m := _REVISION_FILE.match(f))] if folder else []
        except OSError:
            ids = []
        _HEAD.append(max(ids) if ids else None)
    return _HEAD[0]


def _path(url: str) -> str | None:
    if not url.startswith("sqlite:///") or "?" in url:
        return None
    path = url[len("sqlite:///") :]
    return path if path and path != ":memory:" else None


def no_file(url: str) -> bool:
    """Whether `url` names a SQLite store whose file does not exist yet (it holds nothing)."""
    path = _path(url)
    return path is not None and not os.path.exists(path)


def _connection(url: str) -> sqlite3.Connection | None:
    with _LOCK:
        if url in _CONNECTIONS:
            return _CONNECTIONS[url]
        conn = None
        path = _path(url)
        if path is not None and os.path.isfile(path):
            try:
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0, check_same_thread=False)
                row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
                if row is None or row[0] != head_revision():
                    conn.close()
                    conn = None
            except sqlite3.Error:
                conn = None
        _CONNECTIONS[url] = conn
        return conn


def _when(v: Any) -> datetime | None:
    return None if v is None else datetime.fromisoformat(str(v))


def _read(url: str, sql: str, args: tuple, parse: Any) -> Any:
    """`parse(rows)` of one read-only query, or UNKNOWN (no such file, another schema, a fault, a
    row that cannot be read): then the caller asks the Store, which says what is wrong."""
    conn = _connection(url)
    if conn is None:
        return UNKNOWN
    try:
        with _LOCK:
            rows = conn.execute(sql, args).fetchall()
        return parse(rows)
    except (sqlite3.Error, ValueError, TypeError, KeyError):
        return UNKNOWN


def config(url: str, digest: str) -> ConfigRecord | None:
    """The stored winner for `digest`, None if the store has none, or UNKNOWN: ask the Store."""

    def parse(rows: list) -> ConfigRecord | None:
        if not rows:
            return None
        r = dict(zip(_CONFIG_COLUMNS, rows[0]))
        key = TuneKey(
            r["kernel"],
            r["kernel_version"],
            r["triton_version"],
            r["arch"],
            int(r["sm_count"]),
            json.loads(r["problem"]),
        )
        cfg = json.loads(r["config"])
        if key.digest != digest or not isinstance(cfg, dict):
            return UNKNOWN  # the Store reports a row like this one
        return ConfigRecord(
            key=key,
            config=cfg,
            median_ms=float(r["median_ms"]),
            tflops=r["tflops"],
            candidates=int(r["candidates"] or 0),
            device_name=r["device_name"] or "",
            tuned_by=r["tuned_by"] or "",
            tuned_at=_when(r["tuned_at"]),
            source=r["source"],
            default_ms=r["default_ms"],
            vendor_ms=r["vendor_ms"],
            fleet_checked_at=_when(r["fleet_checked_at"]),
            fleet_generation=r["fleet_generation"],
        )

    return _read(url, f"SELECT {', '.join(_CONFIG_COLUMNS)} FROM tuned_configs WHERE digest = ?", (digest,), parse)


def trials(url: str, digest: str) -> list[TrialRecord]:
    """A key's stored trials, oldest first, as `Store.trials` answers them; UNKNOWN: ask the Store."""
    return _read(
        url,
        "SELECT config, status, median_ms, error FROM trials WHERE digest = ? ORDER BY id",
        (digest,),
        lambda rows: [TrialRecord(json.loads(c), status, ms, error) for c, status, ms, error in rows],
    )


def selfcheck(
    url: str, kernel: str, kernel_version: str, triton_version: str, arch: str, sm_count: int
) -> tuple[bool, str | None] | None:
    """(ok, detail) of the stored verdict, None if there is none, or UNKNOWN: ask the Store."""
    return _read(
        url,
        "SELECT ok, detail FROM selfchecks WHERE kernel = ? AND kernel_version = ? AND "
        "triton_version = ? AND arch = ? AND sm_count = ?",
        (kernel, kernel_version, triton_version, arch, sm_count),
        lambda rows: None if not rows else (bool(rows[0][0]), rows[0][1]),
    )


def forget() -> None:
    """Close the connections (tests that swap stores; the Store itself never needs this)."""
    with _LOCK:
        for conn in _CONNECTIONS.values():
            if conn is not None:
                conn.close()
        _CONNECTIONS.clear()
