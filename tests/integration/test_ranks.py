"""A job is many processes (README "Jobs of many ranks"): the processes of a host that miss the
same key at once tune it once, the others wait for that winner and run it; no two processes
time candidates on one device at once; a process killed mid-tune leaves nothing held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK = r"""
import json, os, sys, time, torch
from tunecache import ops
torch.manual_seed(0)
M = int(sys.argv[1])
a, b = torch.randn(M, 40), torch.randn(40, 36)
t0 = time.perf_counter()
c = ops.matmul(a, b)
assert torch.allclose(c, a @ b, atol=1e-4, rtol=1e-4)
(entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
print(json.dumps({"config": entry.config, "seconds": time.perf_counter() - t0}))
"""


def _start(tmp_path: Path, n: int, M: int, store: str, **env: str) -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    full = {
        **os.environ,
        "TUNECACHE_DB_URL": f"sqlite:///{tmp_path / store}",
        "TUNECACHE_LOCK_DIR": str(tmp_path / "locks"),
        **env,
    }
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(M)], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]


def _finish(procs: list[subprocess.Popen]) -> list[tuple[dict, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def _trials(tmp_path: Path, store: str) -> int:
    from tunecache.store import Store

    s = Store(f"sqlite:///{tmp_path / store}")
    try:
        return s.counts()["trials"]
    finally:
        s.close()


def _runs_per_key(tmp_path: Path, store: str) -> dict[str, int]:
    """digest -> how many tuning runs left trials of it."""
    from tunecache.store import Store

    s = Store(f"sqlite:///{tmp_path / store}")
    try:
        with s.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT digest, COUNT(DISTINCT run_id) FROM trials GROUP BY digest")
            return dict(rows.all())
    finally:
        s.close()


def test_three_processes_that_miss_one_key_tune_it_once_and_run_one_winner(tmp_path):
    _finish(_start(tmp_path, 1, 48, "alone.sqlite"))
    one_tune = _trials(tmp_path, "alone.sqlite")
    assert one_tune >= 3
    ranks = _finish(_start(tmp_path, 3, 48, "ranks.sqlite"))
    assert _trials(tmp_path, "ranks.sqlite") == one_tune, "more than one process of the host tuned the key"
    assert len({json.dumps(r["config"], sort_keys=True) for r, _ in ranks}) == 1, "the ranks run different configs"
    waited = [err for _, err in ranks if "is being tuned by process" in err]
    assert len(waited) == 2, [err[-500:] for _, err in ranks]
    assert all("waiting for its winner" in err for err in waited)


def test_two_tuning_processes_never_time_on_one_device_at_once(tmp_path):
    """Two processes tune different shapes at the same moment on the one device there is: every
    window in which one of them held the device's timer is disjoint from the other's."""
    trace = tmp_path / "timing.jsonl"
    procs = _start(tmp_path, 1, 48, "a.sqlite", TUNECACHE_TIMING_TRACE=str(trace))
    procs += _start(tmp_path, 1, 56, "b.sqlite", TUNECACHE_TIMING_TRACE=str(trace))
    _finish(procs)
    windows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len({w["pid"] for w in windows}) == 2, "both processes' trial runners timed"
    windows.sort(key=lambda w: w["start"])
    for before, after in zip(windows, windows[1:]):
        assert before["device"] == after["device"] == "cpu"
        assert after["start"] >= before["end"], f"{before} and {after} overlap"


def test_a_process_killed_while_it_tunes_leaves_the_key_to_the_next(tmp_path):
    (holder,) = _start(tmp_path, 1, 64, "killed.sqlite")
    locks = tmp_path / "locks"
    deadline = time.monotonic() + 300
    while not list(locks.glob("*/tune-*.holder")):  # it holds the key and tunes
        assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()[-2000:]
        time.sleep(0.05)
    holder.send_signal(signal.SIGKILL)
    holder.wait(60)
    ((res, err),) = _finish(_start(tmp_path, 1, 64, "killed.sqlite", TUNECACHE_TUNE_WAIT_S="120"))
    assert "waiting for its winner" not in err, err[-2000:]
    assert _trials(tmp_path, "killed.sqlite") >= 3


STEPS = r"""
import json, os, sys, time, torch
import tunecache
from tunecache import ops
shared = sys.argv[1]
torch.manual_seed(0)
a, b = torch.randn(48, 40), torch.randn(40, 36)
seen = []
for step in range(4):
    while not os.path.exists(os.path.join(shared, f"step{step}")):
        time.sleep(0.02)
    if step == 2:
        tunecache.refresh()  # the job's step boundary: every rank moves here
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    seen.append(entry.config)
    open(os.path.join(shared, f"done{step}-{os.getpid()}"), "w").close()
print(json.dumps(seen))
"""


def test_ranks_under_policy_default_move_to_the_winner_together_at_refresh(tmp_path):
    """Policy `default` with TUNECACHE_RECHECK_S=never: every rank runs the default until the job
    calls `tunecache.refresh()` at a step boundary, then every rank runs the winner, so no step
    sees two configs across ranks, though the winner landed between two steps."""
    import torch

    from tunecache.key import interpreter_device
    from tunecache.store import Store
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import matmul_portable as mod

    shared = tmp_path / "shared"
    shared.mkdir()
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    env = {
        **os.environ,
        "TUNECACHE_DB_URL": url,
        "TUNECACHE_LOCK_DIR": str(tmp_path / "locks"),
        "TUNECACHE_MISS_POLICY": "default",
        "TUNECACHE_RECHECK_S": "never",
    }
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(shared)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]

    def step(n: int) -> None:
        (shared / f"step{n}").touch()
        deadline = time.monotonic() + 300
        while len(list(shared.glob(f"done{n}-*"))) < len(ranks):
            assert all(r.poll() is None for r in ranks) and time.monotonic() < deadline
            time.sleep(0.02)

    step(0)
    problem = mod.problem(torch.randn(48, 40), torch.randn(40, 36))
    device = interpreter_device()
    default = mod.default_config(problem, device)
    winner = next(c for c in mod.prune(mod.config_space(problem, device), problem, device) if c != default)
    store = Store(url)
    store.put_config(ConfigRecord(make_key(mod, problem, device), winner, 0.001, source="worker"))
    store.close()
    for n in (1, 2, 3):
        step(n)
    seen = [json.loads(r.communicate(timeout=60)[0].strip().splitlines()[-1]) for r in ranks]
    assert seen[0] == seen[1], "the ranks ran different configs at one step"
    assert seen[0] == [default, default, winner, winner]


TUNE_ALL = r"""
import json, sys
import tunecache
shapes = [("matmul", {"M": m, "N": 36, "K": 40, "dtype": "float32"}) for m in (24, 32, 40, 48, 56, 64)]
report = tunecache.tune_all(shapes)
print(json.dumps({"tuned": report.tuned, "by_others": report.by_others, "already": report.already,
                  "failed": report.failed, "total": report.total}))
"""


def test_tune_all_splits_the_shapes_over_the_processes_that_run_it(tmp_path):
    """Two processes run `tunecache.tune_all` over one list at once: between them each shape is
    tuned once (as many trials as one process alone), both take part, and both end with every
    winner."""
    script = tmp_path / "tune_all.py"
    script.write_text(TUNE_ALL)

    def start(store: str) -> subprocess.Popen:
        env = {
            **os.environ,
            "TUNECACHE_DB_URL": f"sqlite:///{tmp_path / store}",
            "TUNECACHE_LOCK_DIR": str(tmp_path / "locks"),
        }
        return subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    said: list[str] = []

    def result(p: subprocess.Popen) -> dict:
        out, err = p.communicate(timeout=600)
        said.append(err[-3000:])
        assert p.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    alone = result(start("alone.sqlite"))
    assert alone["tuned"] == alone["total"] == 6 and not alone["failed"]
    pair = [start("pair.sqlite") for _ in range(2)]
    a, b = (result(p) for p in pair)
    assert a["tuned"] + b["tuned"] == 6 and a["tuned"] > 0 and b["tuned"] > 0, (a, b, said[1:])
    assert a["tuned"] + a["by_others"] == 6 and b["tuned"] + b["by_others"] == 6
    # each shape tuned by one run (how many candidates a run times depends on what its process
    # learnt from the shapes it tuned before: tunecache.tuning.ranking)
    assert _runs_per_key(tmp_path, "pair.sqlite") == _runs_per_key(tmp_path, "alone.sqlite")
    assert set(_runs_per_key(tmp_path, "pair.sqlite").values()) == {1}
