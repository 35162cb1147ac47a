"""Predict, then measure a few (issue 40), across the fleet: a host ranks its tunes' candidates
by the trials of the problems nearest its own, its store's and the fleet's; the fleet serves
only trials a worker or an admin published, never a submission's claims. Real service on
Postgres, real tunes on the CPU interpreter."""

from __future__ import annotations

import httpx
import pytest

from support.fleet import result_body

pytestmark = pytest.mark.postgres

PROBLEM = {"M": 64, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row", "precision": "ieee"}
FAST = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 2, "num_stages": 2}
SLOW = dict(FAST, num_stages=3)


def _publish(fleet, scope: str, problem: dict, trials: list[dict]) -> httpx.Response:
    body = {**result_body(0.5, FAST, problem), "trials": trials}
    return httpx.post(
        f"{fleet.url}/v1/configs", json=body, headers={"Authorization": f"Bearer {fleet.tokens[scope]}"}, timeout=30
    )


def _trial(config: dict, ms: float) -> dict:
    return {"config": config, "status": "ok", "median_ms": ms}


def test_the_fleet_serves_a_workers_trials_and_not_a_submissions(clean_fleet):
    from tunecache.fleet.client import FleetClient
    from tunecache.fleet.store_fleet import StoreFleet
    from tunecache.store import Store

    worker = _publish(clean_fleet, "worker", PROBLEM, [_trial(FAST, 0.5), _trial(SLOW, 1.5)])
    assert worker.status_code == 200, worker.text
    # a publish token's result for the same key: a submission, its times only claimed
    liar = _publish(clean_fleet, "publish", PROBLEM, [_trial(SLOW, 0.01), _trial(FAST, 9.0)])
    assert liar.status_code == 200, liar.text

    client = FleetClient(clean_fleet.url, clean_fleet.tokens["read"])
    served = client.trials("matmul.portable", "cpu")
    assert sorted(row[3] for row in served) == [0.5, 1.5]
    store = Store(clean_fleet.db_url)
    try:  # the Fleet interface answers alike on both sides
        assert sorted(map(repr, StoreFleet(store).trials("matmul.portable", "cpu"))) == sorted(map(repr, served))
        # the store itself keeps the submission's trials (the audit shows them), marked untrusted
        assert len(store.ranking_trials("cpu", "matmul.portable")) == 4
    finally:
        store.close()
    assert client.trials("matmul.portable", "sm_90") == []


def test_a_hosts_tune_times_first_what_ran_fastest_on_the_nearest_tuned_problem(db_url):
    """The store holds a tune of a near problem: the next tune's first candidate is its winner,
    and the tune times the short list (the static order's whole space is longer)."""
    import torch

    from tunecache.cache.config_cache import CACHE
    from tunecache.key import interpreter_device
    from tunecache.store.process import default_store
    from tunecache.store.records import ConfigRecord, TrialRecord
    from tunecache.tuning.tuner import make_key, tune
    from tunecache_kernels import matmul_portable as mod

    device = interpreter_device()
    near = mod.problem(torch.randn(64, 64), torch.randn(64, 64))
    space = mod.prune(mod.config_space(near, device), near, device)
    slowest_first = list(reversed(space))  # a past tune in which the static order's last config won
    key = make_key(mod, near, device)
    past = [TrialRecord(c, "ok", median_ms=1.0 + i) for i, c in enumerate(slowest_first)]
    default_store().put_config(ConfigRecord(key, slowest_first[0], 1.0, candidates=len(space)), past)

    problem = mod.problem(torch.randn(60, 64), torch.randn(64, 56))
    ranking = CACHE.ranking(mod.KERNEL, device)
    result = tune(mod, problem, device, ranking=ranking)
    timed = [t.config for t in result.trials]
    assert timed[0] == slowest_first[0], "the nearest tuned problem's winner is timed first"


def test_the_trusted_trials_revision_upgrades_and_downgrades(empty_db_url):
    """Revision 0010 adds trials.trusted (the trials kept before it count as untrusted) and
    drops it again; the trials stay."""
    from sqlalchemy import create_engine, inspect

    from support.migrations import downgrade
    from tunecache.store import Store
    from tunecache.store.migrate import current_revision, head_revision, upgrade

    engine = create_engine(empty_db_url)
    upgrade(engine, "0009")
    assert "trusted" not in {c["name"] for c in inspect(engine).get_columns("trials")}
    upgrade(engine, "0010")
    assert "trusted" in {c["name"] for c in inspect(engine).get_columns("trials")}
    downgrade(engine, "0009")
    assert current_revision(engine) == "0009"
    assert "trusted" not in {c["name"] for c in inspect(engine).get_columns("trials")}
    engine.dispose()
    store = Store(empty_db_url)  # migrates to head again
    try:
        assert current_revision(store.engine) == head_revision()
    finally:
        store.close()
