"""Several processes writing one SQLite store at once lose no row and raise no lock error."""

from __future__ import annotations

import subprocess
import sys

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
