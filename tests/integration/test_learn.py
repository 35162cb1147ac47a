"""The ranking keeps learning (issue 40): `tunecache learn` trains the trees again on the trials
the package ships, the store's and the fleet's, and later tunes on the host rank by them.

The trials are real: a whole-space tune of a conv's weight gradient (a Stable Diffusion UNet's
3x3 at 64x64, 320 channels, batch 2: 2,153 candidates timed on an H200) whose 16 candidates the
package's trees chose held none within 14% of its best, and a UNet fprop's (414 candidates),
both from `benchmarks/bench_tuning.py` (benchmarks/results/tuning-trees-h200-20261128-s49c.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.fleet import result_body

pytest.importorskip("lightgbm")  # the `learn` extra (dev installs it)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tuning-trees-h200-20261128-s49c.json"


def _whole_space(op: str) -> dict:
    (row,) = [r for r in json.loads(RESULTS.read_text())["ops"] if r["op"] == op]
    return row["exhaustive"]


def _learn(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunecache.cli", "learn", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200", **env),
        timeout=600,
    )


def _best_of_the_short_list(whole: dict, trees_dir: Path) -> float:
    """The whole space's best over the best of what a tune's short list (trees alone: no tuned
    problem near) would time, by the whole-space run's own times; in a fresh process that reads
    the trees under `trees_dir` (or the package's)."""
    code = """
import json, sys
from tunecache.backends import module_for_kernel
from tunecache.key import DeviceClass
from tunecache.tuning import rank_model
from tunecache.tuning.ranking import Ranking, shortlist
whole = json.loads(sys.stdin.read())
mod, dev, p = module_for_kernel(whole["kernel"]), DeviceClass("sm_90", 132), whole["problem"]
ms = {json.dumps(c, sort_keys=True): t for c, s, t in whole["trials"] if s == "ok"}
space = mod.prune(mod.config_space(p, dev), p, dev)
short = shortlist(Ranking([], rank_model.model(mod.KERNEL, "sm_90"), 132).order(space, p), space, [])
timed = short.candidates + short.rest[:4]  # the run-time variants: the next ones stand in
print(min(ms.values()) / min(ms.get(json.dumps(c, sort_keys=True), 1e9) for c in timed))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(whole),
        capture_output=True,
        text=True,
        env=dict(os.environ, TUNECACHE_TREES_DIR=str(trees_dir)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


def _keep(store_url: str, whole: dict) -> None:
    """The whole-space tune as a host's tune would have kept it (its winner, every trial)."""
    from tunecache.key import TuneKey
    from tunecache.store import Store
    from tunecache.store.records import ConfigRecord, TrialRecord

    ok = [(c, t) for c, s, t in whole["trials"] if s == "ok"]
    best = min(ok, key=lambda x: x[1])
    key = TuneKey(whole["kernel"], "v-test", "3.9.0", "sm_90", 132, whole["problem"])
    store = Store(store_url)
    try:
        store.put_config(
            ConfigRecord(key, best[0], best[1], candidates=len(ok)), [TrialRecord(c, "ok", t) for c, t in ok]
        )
    finally:
        store.close()


def test_learn_trains_on_the_stores_trials_and_later_tunes_rank_by_what_it_learned(db_url, tmp_path):
    wgrad = _whole_space("conv2d_wgrad")
    before = _best_of_the_short_list(wgrad, tmp_path / "trees")
    assert before < 0.9, before  # the package's trees missed this conv's best (measured 0.82 on the GPU)

    _keep(db_url, wgrad)
    proc = _learn("--no-fleet", env={"TUNECACHE_TREES_DIR": str(tmp_path / "trees")})
    assert proc.returncode == 0, proc.stderr
    assert "conv2d_wgrad.hopper: trained on 63 problems (62 package, 1 store, 0 fleet)" in proc.stderr
    assert "later tunes on this host rank" in proc.stderr and (tmp_path / "trees" / "sm_90.trees.json.gz").is_file()

    after = _best_of_the_short_list(wgrad, tmp_path / "trees")
    assert after >= 0.98, after


def test_learn_with_nothing_new_writes_nothing_and_says_so(db_url, tmp_path):
    proc = _learn("--no-fleet", env={"TUNECACHE_TREES_DIR": str(tmp_path / "trees")})
    assert proc.returncode == 0, proc.stderr
    assert "nothing tuned on sm_90 beyond the package's trials" in proc.stderr
    assert not (tmp_path / "trees").exists()


def test_learn_on_the_interpreter_says_there_is_nothing_to_learn(db_url, tmp_path):
    proc = _learn("--arch", "cpu", env={"TUNECACHE_TREES_DIR": str(tmp_path / "trees")})
    assert proc.returncode == 2 and "not speeds" in proc.stderr


@pytest.mark.postgres
def test_learn_takes_the_fleets_trials_from_its_workers(clean_fleet, db_url, tmp_path):
    import httpx

    fprop = _whole_space("conv2d_fprop")
    ok = [{"config": c, "status": "ok", "median_ms": t} for c, s, t in fprop["trials"] if s == "ok"]
    best = min(ok, key=lambda t: t["median_ms"])
    body = result_body(
        best["median_ms"], best["config"], fprop["problem"], kernel=fprop["kernel"], arch="sm_90", sm_count=132
    )
    answer = httpx.post(
        f"{clean_fleet.url}/v1/configs",
        json={**body, "trials": ok},
        headers={"Authorization": f"Bearer {clean_fleet.tokens['worker']}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    env = {
        "TUNECACHE_TREES_DIR": str(tmp_path / "trees"),
        "TUNECACHE_SERVER_URL": clean_fleet.url,
        "TUNECACHE_TOKEN": clean_fleet.tokens["read"],
    }
    proc = _learn(env=env)
    assert proc.returncode == 0, proc.stderr
    assert "conv2d_fprop.hopper: trained on 45 problems (44 package, 0 store, 1 fleet)" in proc.stderr


def test_trees_learned_beside_other_package_trees_give_way_to_the_packages(tmp_path, monkeypatch, caplog):
    """An upgrade ships trees trained on more: a host's older learned file does not outrank them."""
    from tunecache.tuning import rank_model

    monkeypatch.setenv("TUNECACHE_TREES_DIR", str(tmp_path))
    rank_model.write_learned("sm_90", {"matmul.hopper": [1.0]})  # one tree, a leaf: every config alike
    assert rank_model.model("matmul.hopper", "sm_90").trees == [1.0]
    monkeypatch.setattr(rank_model, "_package_trees", lambda arch: "another-version")
    rank_model._LEARNED.clear()
    assert rank_model.model("matmul.hopper", "sm_90") is rank_model.shipped_model("matmul.hopper", "sm_90")
    assert "`tunecache learn` runs again" in caplog.text
    rank_model._LEARNED.clear()
