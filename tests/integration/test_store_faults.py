"""Faults of the local SQLite store never fail the caller: on real files and real mounts (a
tmpfs per test: read-only, or filled up), the store opens as the best store that still works
and says once, in words, what happened."""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from support import run_py
from tunecache.key import TuneKey
from tunecache.store import (
    STORE_ERRORS,
    ConfigRecord,
    ReadOnlyStoreError,
    Store,
    TrialRecord,
    default_store,
    describe_fault,
)
from tunecache.store import process as process_store
from tunecache.store.local import open_local_store
from tunecache.store.migrate import head_revision

CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def key(m: int) -> TuneKey:
    return TuneKey(
        "matmul.portable",
        "v1",
        "3.9.0",
        "cpu",
        0,
        {"M": m, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
    )


def rec(m: int, ms: float = 1.0) -> ConfigRecord:
    return ConfigRecord(key(m), CFG, ms)


def seed(path: Path) -> str:
    """The URL of a store at head at `path` holding the config of key(1) and its trial, closed
    (its -wal and -shm are gone)."""
    url = f"sqlite:///{path}"
    s = Store(url)
    s.put_config(rec(1), [TrialRecord(CFG, "ok", 1.0)])
    s.close()
    return url


def read_only_warnings(url: str, caplog) -> list[str]:
    """Open the local store at `url`, which must come up read-only: it serves key(1) and skips,
    quietly, a put of key(2). The warnings it logged."""
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        h = open_local_store(url)
        try:
            assert h.outcome == "read-only" and not h.store.writable
            assert h.store.get_config(key(1).digest).config == CFG
            kept, won = h.store.put_config(rec(2), [TrialRecord(CFG, "ok", 1.0)])  # skipped
            assert kept.digest == key(2).digest and won
            assert h.store.get_config(key(2).digest) is None
        finally:
            h.store.close()
    return warnings_of(caplog)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tunecache.store" and r.levelno >= logging.WARNING]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs mounted in this test's tmp dir, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str = "1m") -> Path:
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        try:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True
            )
        except FileNotFoundError:
            pytest.skip("no `mount` command here: these tests need real mounts")
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here (these tests need root): {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=True)  # a connection left open: detach it


def remount_read_only(d: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True, capture_output=True)


def fill(d: Path) -> None:
    """Write a file until the disk is full."""
    with open(d / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError) as e:
            while True:
                f.write(b"\0" * 4096)
    assert e.value.errno == errno.ENOSPC


# ---- read-only --------------------------------------------------------------------------


def test_read_only_file_system_serves_reads_and_skips_writes(tmpfs, caplog):
    d = tmpfs()
    path = d / "store.sqlite"
    url = seed(path)
    remount_read_only(d)
    assert read_only_warnings(url, caplog) == [
        f"tunecache: the store file {path} is on a read-only file system: using it read-only"
    ]
    h = open_local_store(url)
    try:
        assert [t.status for t in h.store.trials(key(1).digest)] == ["ok"]
        h.store.add_trials(key(2), [TrialRecord(CFG, "ok", 1.0)])
        assert h.store.trials(key(2).digest) == []
        with pytest.raises(ReadOnlyStoreError, match="open read-only"):  # a queue that drops jobs must say so
            h.store.enqueue(key(3))
    finally:
        h.store.close()


def test_store_file_that_cannot_be_written_is_used_read_only(tmpfs, caplog):
    # what a read-only file (chmod, another owner) is to a user; root ignores modes, but not
    # the immutable attribute
    d = tmpfs()
    path = d / "store.sqlite"
    url = seed(path)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a file immutable here (chattr +i)")
    try:
        assert read_only_warnings(url, caplog) == [
            f"tunecache: the store file {path} cannot be written (permission denied): using it read-only"
        ]
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("name", ["store.sqlite", "sub/store.sqlite"])
def test_read_only_directory_without_a_store_keeps_results_in_memory(tmpfs, caplog, name):
    d = tmpfs()
    remount_read_only(d)
    path = d / name
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        h = open_local_store(f"sqlite:///{path}")
        try:
            assert h.outcome == "memory" and h.store.writable and h.store.path is None
            assert h.store.put_config(rec(1)) == (rec(1), True)
            got: list = []
            t = threading.Thread(target=lambda: got.append(h.store.get_config(key(1).digest)))
            t.start()
            t.join()
            assert got[0].config == CFG, "every thread sees the one in-memory store"
        finally:
            h.store.close()
    (warning,) = warnings_of(caplog)
    assert warning.endswith(": keeping results in memory for this process")
    if "/" in name:  # a store directory that is not there is never made (a mistyped path): said so
        assert f"the store directory {path.parent} does not exist" in warning and "mkdir -p" in warning
    else:
        assert warning.startswith(f"tunecache: the store file {path} is on a read-only file system")
    assert not path.exists()


# ---- full disk --------------------------------------------------------------------------


def test_full_disk_under_an_open_store_reads_and_a_put_fails_in_words(tmpfs, caplog):
    d = tmpfs("1m")
    path = d / "store.sqlite"
    url = f"sqlite:///{path}"
    writer = Store(url)  # another process's store, open: its -wal and -shm are there
    writer.put_config(rec(1))
    fill(d)
    h = None
    try:
        with caplog.at_level(logging.WARNING, logger="tunecache.store"):
            h = open_local_store(url)
        assert h.outcome == "ok" and h.store.writable and warnings_of(caplog) == []
        assert h.store.get_config(key(1).digest).config == CFG
        big = [TrialRecord(dict(CFG, BLOCK_M=i), "failed", error="x" * 3900) for i in range(100)]
        with pytest.raises(STORE_ERRORS) as e:
            h.store.put_config(rec(2), big)
        assert describe_fault(e.value, h.store.path) == f"the disk holding {path} is full"
        assert h.store.get_config(key(1).digest).config == CFG, "reads go on after the failed write"
        assert h.store.get_config(key(2).digest) is None
    finally:
        if h is not None:
            h.store.close()
        writer.close()


def test_full_disk_under_a_closed_store_serves_it_read_only(tmpfs, caplog):
    d = tmpfs("1m")
    path = d / "store.sqlite"
    url = seed(path)
    fill(d)
    assert read_only_warnings(url, caplog) == [f"tunecache: the disk holding {path} is full: using it read-only"]


def test_full_disk_without_a_store_keeps_results_in_memory(tmpfs, caplog):
    d = tmpfs("256k")
    fill(d)
    path = d / "store.sqlite"
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        h = open_local_store(f"sqlite:///{path}")
        try:
            assert h.outcome == "memory"
            h.store.put_config(rec(1))
            assert h.store.get_config(key(1).digest).config == CFG
        finally:
            h.store.close()
    assert warnings_of(caplog) == [
        f"tunecache: the disk holding {path} is full: keeping results in memory for this process"
    ]


# ---- corrupt ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "damaged header"])
def test_corrupt_file_is_moved_aside_and_a_fresh_store_made(tmp_path, caplog, damage):
    path = tmp_path / "store.sqlite"
    url = f"sqlite:///{path}"
    if damage == "garbage":
        path.write_bytes(b"this is not a database\n" * 200)
        Path(f"{path}-wal").write_bytes(b"nor is this a write-ahead log")
    else:
        seed(path)
        data = bytearray(path.read_bytes())
        data[16:100] = b"\xff" * 84  # page size, format numbers, counters: all wrong
        path.write_bytes(bytes(data))
    bad = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        h = open_local_store(url)
        try:
            assert h.outcome == "fresh" and h.store.writable
            h.store.put_config(rec(2))
            assert h.store.get_config(key(2).digest).config == CFG
            assert h.store.get_config(key(1).digest) is None
        finally:
            h.store.close()
    assert re.fullmatch(r"store\.sqlite\.corrupt-\d{8}T\d{6}", h.moved_to.name), h.moved_to
    assert h.moved_to.read_bytes() == bad, "the corrupt file is kept as it was"
    # a -wal goes with its file, never left beside the fresh store (SQLite itself may delete
    # it first: the last connection to close, even a failed one, removes -wal and -shm)
    old_wal = Path(f"{h.moved_to}-wal")
    assert not old_wal.exists() or old_wal.read_bytes() == b"nor is this a write-ahead log"
    assert not Path(f"{path}-wal").exists() or b"write-ahead" not in Path(f"{path}-wal").read_bytes()
    assert warnings_of(caplog) == [
        f"tunecache: the store file {path} is not a SQLite database (corrupt): "
        f"moved aside to {h.moved_to} and started a fresh store"
    ]
    with caplog.at_level(logging.WARNING, logger="tunecache.store"):
        Store(url).close()  # the fresh store opens as it is
    assert len(warnings_of(caplog)) == 1


def test_default_store_survives_a_corrupt_store_and_warns_once(db_url, caplog):
    path = Path(db_url.removeprefix("sqlite:///"))
    path.write_bytes(b"\x00garbage" * 512)
    process_store._DEFAULT.pop(db_url, None)
    try:
        with caplog.at_level(logging.WARNING, logger="tunecache.store"):
            s = default_store()
            s.put_config(rec(1))
            assert default_store() is s and s.get_config(key(1).digest).config == CFG
        (msg,) = warnings_of(caplog)
        assert "is not a SQLite database (corrupt): moved aside to" in msg
    finally:
        s = process_store._DEFAULT.pop(db_url, None)
        if s is not None:
            s.close()


# ---- a newer schema ---------------------------------------------------------------------


def test_store_of_a_newer_tunecache_is_used_read_only(tmp_path, caplog):
    path = tmp_path / "store.sqlite"
    url = seed(path)
    s = Store(url)
    with s.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    s.close()
    assert read_only_warnings(url, caplog) == [
        f"tunecache: the store file {path} was written by a newer tunecache (schema revision 9999, this one "
        f"knows up to {head_revision()}): using it read-only"
    ]
    conn = sqlite3.connect(path)
    try:  # neither migrated nor written
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]
        assert conn.execute("SELECT count(*) FROM tuned_configs").fetchone() == (1,)
    finally:
        conn.close()


# ---- a lock held past the busy timeout --------------------------------------------------


@pytest.fixture
def short_busy_timeout(monkeypatch):
    monkeypatch.setenv("TUNECACHE_DB_BUSY_TIMEOUT_S", "0.2")


def hold_write_lock(path: Path) -> sqlite3.Connection:
    """Another connection in the middle of a write transaction, as a stuck process would be."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_held_lock_lets_reads_through_and_a_write_fails_in_words(tmp_path, caplog, short_busy_timeout):
    path = tmp_path / "store.sqlite"
    url = seed(path)
    holder = hold_write_lock(path)
    h = None
    try:
        with caplog.at_level(logging.WARNING, logger="tunecache.store"):
            h = open_local_store(url)  # reading the schema revision needs no lock in WAL mode
        assert h.outcome == "ok" and warnings_of(caplog) == []
        assert h.store.get_config(key(1).digest).config == CFG
        with pytest.raises(STORE_ERRORS) as e:
            h.store.put_config(rec(2))
        assert describe_fault(e.value, path) == (
            f"the store file {path} is locked by another process (it held a write lock past the busy timeout of 0.2 s)"
        )
        holder.execute("ROLLBACK")
        h.store.put_config(rec(2))  # the lock is gone: writes work again
        assert h.store.get_config(key(2).digest).config == CFG
    finally:
        holder.close()
        if h is not None:
            h.store.close()


def test_held_lock_while_the_store_needs_migrating_warns_once_and_goes_on(tmp_path, caplog, short_busy_timeout):
    from tunecache.store.migrate import upgrade

    path = tmp_path / "store.sqlite"
    url = f"sqlite:///{path}"
    old = Store(url, migrate=False)
    upgrade(old.engine, "0001")  # a store of an older tunecache: opening it migrates it
    old.close()
    holder = hold_write_lock(path)
    try:
        with caplog.at_level(logging.WARNING, logger="tunecache.store"):
            h = open_local_store(url)
            try:
                assert h.outcome in ("read-only", "memory")
                h.store.put_config(rec(1))
                h.store.get_config(key(1).digest)
            finally:
                h.store.close()
        (msg,) = warnings_of(caplog)
        assert msg.startswith(
            f"tunecache: the store file {path} is locked by another process (it held a write "
            f"lock past the busy timeout of 0.2 s)"
        )
    finally:
        holder.close()


# ---- the common path, and the words for the caller layer --------------------------------


def test_a_healthy_store_opens_as_it_is_without_alembic(tmp_path):
    url = seed(tmp_path / "store.sqlite")
    out = run_py(
        "import sys; from tunecache.store.local import open_local_store; h = open_local_store(%r); "
        "print(h.outcome, h.fault, h.store.writable, 'alembic' in sys.modules)" % url
    )
    assert out.stdout.split() == ["ok", "None", "True", "False"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("database or disk is full", "the disk holding the store is full"),
        ("attempt to write a readonly database", "the store is read-only"),
        ("file is not a database", "the store is not a SQLite database (corrupt)"),
        ("database disk image is malformed", "the store is damaged (corrupt)"),
        ("database is locked", "the store is locked by another process"),
        ("unable to open database file", "the store cannot be opened or created"),
        ("disk I/O error", "reading or writing the store failed with a disk I/O error"),
    ],
)
def test_describe_fault_words_sqlite_errors(text, words):
    wrapped = OperationalError("INSERT INTO tuned_configs ...", {}, sqlite3.OperationalError(text))
    assert describe_fault(wrapped).startswith(words)
    assert describe_fault(sqlite3.OperationalError(text)).startswith(words)


def test_describe_fault_leaves_other_errors_alone():
    assert describe_fault(ValueError("M must be positive")) is None
    assert describe_fault(OSError(errno.ENOSPC, "No space left on device")) == "the disk holding the store is full"


# ---- the call goes on: a training script's first call under each fault ----------------------

CALL = """
import torch
from tunecache import ops
torch.manual_seed(0)
a, b = torch.randn(40, 24), torch.randn(24, 36)
for _ in range(2):
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
print("CALLS OK")
"""


def _call(url: str, **env: str) -> list[str]:
    """Run the script against this store; return the tunecache warnings it printed."""
    import os
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", CALL],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TUNECACHE_DB_URL": url, **env},
    )
    assert proc.returncode == 0 and "CALLS OK" in proc.stdout, proc.stderr[-3000:]
    return [
        ln for ln in proc.stderr.splitlines() if ln.startswith("tunecache:") and not ln.startswith("tunecache: tuning ")
    ]


def _one_warning(lines: list[str], *words: str) -> None:
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], lines[0]


def test_a_call_goes_on_over_a_read_only_store(tmpfs, db_url):
    d = tmpfs()
    url = f"sqlite:///{d / 'store.sqlite'}"
    assert _call(url) == []  # tunes and keeps the winner
    remount_read_only(d)
    _one_warning(_call(url), "read-only file system", "using it read-only")


def test_a_call_goes_on_when_the_disk_is_full(tmpfs, db_url):
    d = tmpfs("256k")
    url = f"sqlite:///{d / 'store.sqlite'}"
    Store(url).close()  # an empty store, then no room to keep anything
    fill(d)
    _one_warning(_call(url), "is full")


def test_a_call_goes_on_over_a_corrupt_store(tmp_path, db_url):
    path = tmp_path / "store.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    _one_warning(_call(f"sqlite:///{path}"), "not a SQLite database", "moved aside")
    assert list(tmp_path.glob("store.sqlite.corrupt-*"))


def test_a_call_goes_on_over_a_store_of_a_newer_tunecache(tmp_path, db_url):
    path = tmp_path / "store.sqlite"
    Store(f"sqlite:///{path}").close()
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = '9999'")
    con.commit()
    con.close()
    _one_warning(_call(f"sqlite:///{path}"), "newer tunecache", "9999", "read-only")


def test_a_call_goes_on_while_another_process_holds_the_lock(tmp_path, db_url):
    path = tmp_path / "store.sqlite"
    Store(f"sqlite:///{path}").close()
    holder = hold_write_lock(path)
    try:
        _one_warning(_call(f"sqlite:///{path}", TUNECACHE_DB_BUSY_TIMEOUT_S="0.3"), "locked")
    finally:
        holder.rollback()
        holder.close()
