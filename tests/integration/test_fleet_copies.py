"""A host's copies of fleet winners follow the fleet: marked as copies, rechecked after
TUNECACHE_FLEET_TTL_S or when the fleet's generation moves, removed or replaced when the fleet
removes or replaces them, and never in the way of a result this host measured itself. A real
`tunecache serve` on loopback over Postgres; the host is this test process with its own store."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
import torch

from tunecache import MissingConfig, ops
from tunecache.cache.config_cache import CACHE
from tunecache.fleet.client import reset_clients
from tunecache.key import interpreter_device
from tunecache.store import ConfigRecord, default_store, utcnow
from tunecache.tuning.tuner import make_key
from tunecache_kernels import matmul_portable as mod

A, B = torch.randn(40, 24), torch.randn(24, 36)
SLOW = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
FAST = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


@pytest.fixture
def host(db_url, clean_fleet, monkeypatch):
    """This process as a fleet host with a read token and policy strict (so it never tunes)."""
    monkeypatch.setenv("TUNECACHE_SERVER_URL", clean_fleet.url)
    monkeypatch.setenv("TUNECACHE_TOKEN", clean_fleet.tokens["read"])
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "strict")
    reset_clients()
    CACHE._generation_at = -float("inf")
    yield clean_fleet
    reset_clients()
    ops.clear_memo()


def _key():
    return make_key(mod, mod.problem(A, B), interpreter_device())


def _admin(fleet):
    return httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens['admin']}"}, timeout=10)


def _publish(fleet, config, ms):
    rec = ConfigRecord(key=_key(), config=config, median_ms=ms, source="worker")
    with _admin(fleet) as api:
        r = api.post("/v1/configs", json=rec.to_json())
        assert r.status_code == 200, r.text
        return r.json()


def _matmul_config():
    ops.clear_memo()
    torch.testing.assert_close(ops.matmul(A, B), A @ B)
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    return entry.config


def test_a_fleet_winner_is_kept_as_a_marked_copy(host):
    _publish(host, SLOW, 2.0)
    assert _matmul_config() == SLOW
    copy = default_store().get_config(_key().digest)
    assert copy.source == "fleet" and copy.fleet_checked_at is not None
    assert copy.fleet_generation is not None


def test_a_fleet_delete_reaches_the_host(host):
    _publish(host, SLOW, 2.0)
    assert _matmul_config() == SLOW
    with _admin(host) as api:
        assert api.delete(f"/v1/configs/{_key().digest}").status_code == 200
    CACHE._generation_at = -float("inf")  # the next generation poll is due (a minute later in life)
    with pytest.raises(MissingConfig):
        _matmul_config()
    assert default_store().get_config(_key().digest) is None, "the host's copy is removed"


def test_a_fleet_replacement_reaches_the_host(host):
    _publish(host, SLOW, 2.0)
    assert _matmul_config() == SLOW
    assert _publish(host, FAST, 1.0)["accepted"]
    CACHE._generation_at = -float("inf")
    assert _matmul_config() == FAST
    assert default_store().get_config(_key().digest).config == FAST


def test_a_copy_past_its_ttl_is_rechecked(host, monkeypatch):
    _publish(host, SLOW, 2.0)
    assert _matmul_config() == SLOW
    store = default_store()
    digest = _key().digest
    # a copy checked two hours ago, under the generation that is current: only the TTL is due
    with store._write() as s:
        from tunecache.store import TunedConfigRow

        row = s.query(TunedConfigRow).filter_by(digest=digest).one()
        row.fleet_checked_at = utcnow() - timedelta(hours=2)
    before = store.get_config(digest).fleet_checked_at
    assert _matmul_config() == SLOW
    # the recheck's write is made beside the call (store.process): default_store() settles it
    assert default_store().get_config(digest).fleet_checked_at > before, "the copy was rechecked with the fleet"


def test_a_fleet_copys_claimed_time_never_blocks_a_local_result(db_url):
    store = default_store()
    key = _key()
    store.put_fleet_copy(ConfigRecord(key=key, config=SLOW, median_ms=1e-6, source="worker"), generation=3)
    kept, won = store.put_config(ConfigRecord(key=key, config=FAST, median_ms=0.5, source="inline"))
    assert won and store.get_config(key.digest).config == FAST
    # and a fleet copy never overwrites a result of this host's own
    assert not store.put_fleet_copy(ConfigRecord(key=key, config=SLOW, median_ms=1e-6), generation=4)
    assert store.get_config(key.digest).source == "inline"


def test_a_fleet_config_this_host_cannot_launch_is_reported(host, monkeypatch):
    monkeypatch.setenv("TUNECACHE_TOKEN", host.tokens["publish"])  # reporting needs the publish scope
    reset_clients()
    bad = {**SLOW, "num_warps": 8}  # in the space; the interpreter's pruning keeps one value of num_warps
    assert not mod.prune([bad], mod.problem(A, B), interpreter_device())
    _publish(host, bad, 2.0)
    with pytest.raises(MissingConfig):
        _matmul_config()
    assert default_store().get_config(_key().digest) is None, "never kept on the host"
    from tunecache.store import Store

    fleet_store = Store(host.db_url)
    (report,) = [t for t in fleet_store.trials(_key().digest) if t.status == "failed"]
    assert report.config == bad and "pruning refuses it" in report.error and "test-publish" in report.error
    assert fleet_store.get_config(_key().digest).config == bad, "a report never removes a winner by itself"
    job = fleet_store.get_job(_key().digest)
    assert job is not None and job.status == "queued" and job.retime, "the key is queued for re-timing"
