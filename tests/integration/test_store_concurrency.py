"""Several processes writing one SQLite store at once lose no row and raise no lock error."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

from tunecache.store import Store

WRITER = r"""
import sys
from tunecache.key import TuneKey
from tunecache.store import ConfigRecord, Store, TrialRecord
url, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = Store(url)
cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
for i in range(n):
    own = TuneKey("matmul.portable", "v", "3.9.0", "cpu", 0, {"M": wid * 100000 + i + 1})
    shared = TuneKey("matmul.portable", "v", "3.9.0", "cpu", 0, {"M": -i})
    store.put_config(ConfigRecord(own, cfg, 1.0), [TrialRecord(cfg, "ok", 1.0)])
    store.put_config(ConfigRecord(shared, cfg, 1.0 + wid), [TrialRecord(cfg, "ok", 1.0 + wid)])
    store.enqueue(shared)
    job = store.claim_job(f"w{wid}", "cpu", 0)
    if job is not None:
        store.complete_job(job.id, job.lease_secret)
print("ok")
"""


def test_parallel_writers_lose_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    writers, n = 6, 40
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, str(w), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, errs) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "ok", errs
        assert "locked" not in errs
    counts = Store(url).counts()
    assert counts["tuned_configs"] == writers * n + n
    assert counts["trials"] == 2 * writers * n
    assert counts["tuning_jobs"] == n
    # the shared keys kept the fastest writer's result (writer 0: 1.0 ms)
    assert {r.median_ms for r in Store(url).list_configs() if r.key.problem["M"] <= 0} == {1.0}


def test_a_store_opened_while_another_process_writes_the_fresh_file_waits_and_is_writable(tmp_path):
    """The ranks of a job on a new host open one fresh store together: SQLite refuses at once,
    without waiting, to switch a file to WAL while another connection is about to write it. The
    store waits (as for any lock) and opens writable, instead of keeping its results in memory."""
    from tunecache.key import TuneKey
    from tunecache.store import ConfigRecord
    from tunecache.store.local import open_local_store

    path = tmp_path / "fresh.sqlite"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # the write lock, as the first process creating its tables
    threading.Timer(0.5, lambda: other.execute("COMMIT")).start()
    handle = open_local_store(f"sqlite:///{path}")
    assert handle.outcome == "ok", handle.fault
    key = TuneKey("matmul.portable", "v", "3.9.0", "cpu", 0, {"M": 1})
    handle.store.put_config(ConfigRecord(key, {"BLOCK_M": 32}, 1.0))
    assert handle.store.get_config(key.digest).config == {"BLOCK_M": 32}
