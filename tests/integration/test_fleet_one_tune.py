"""Across hosts, one tune per key per fleet (README "Jobs of many ranks"): a host that misses a
key another host of the fleet is tuning waits for that host's result instead of tuning again;
the result, a submission of a `publish` token, reaches it as a hint that it times against its
own default (two trials, not a tune) before it runs it. Real service on Postgres, real host
processes, each with its own store."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from support.fleet import ROOT, host_env, local_counts, wait_for

pytestmark = pytest.mark.postgres

HOST = r"""
import json, time, torch
from tunecache import ops
torch.manual_seed(0)
a, b = torch.randn(56, 40), torch.randn(40, 36)
t0 = time.perf_counter()
torch.testing.assert_close(ops.matmul(a, b), a @ b, atol=1e-4, rtol=1e-4)
(entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
print(json.dumps({"config": entry.config, "seconds": time.perf_counter() - t0}))
"""


def _env(tmp_path, name, fleet) -> dict:
    """A host of its own: its store and lock folder, and the fleet with a publish token."""
    return host_env(tmp_path, name, fleet.url, fleet.tokens["publish"], TUNECACHE_LOCK_DIR=str(tmp_path / name))


def _host(tmp_path, name, fleet, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOST], env=_env(tmp_path, name, fleet), cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr,
        text=True,
    )  # fmt: skip


def _done(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _announced(db_url: str) -> list[tuple]:
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return list(conn.exec_driver_sql("SELECT digest, holder FROM tune_announcements"))
    finally:
        engine.dispose()


def test_a_host_that_misses_a_key_another_host_tunes_waits_and_times_its_result_only(clean_fleet, tmp_path):
    """Two real hosts miss one key at about the same time: the second times the first's
    result (at most itself and its default) instead of a tune, and both run one config. (Whether
    the second still saw the first tuning depends on the race; the next test holds it there.)"""
    first = _host(tmp_path, "first", clean_fleet)
    wait_for(lambda: _announced(clean_fleet.db_url), 300, what="the first host to announce the key")
    second = _host(tmp_path, "second", clean_fleet)
    (ran_first, _), (ran_second, _) = _done(first), _done(second)
    tuned = local_counts(_env(tmp_path, "first", clean_fleet))["trials"]
    checked = local_counts(_env(tmp_path, "second", clean_fleet))["trials"]
    assert tuned >= 3, "the first host tuned the whole space"
    assert checked <= 2, f"the second host timed {checked} configs: the hint and its default are 2 at most"
    assert ran_second["config"] == ran_first["config"], "the hosts run different configs"


def test_a_host_waits_while_another_tunes_then_runs_its_submitted_config(clean_fleet, tmp_path):
    """The other host is held mid-tune (its announcement made here, with its token): the host
    says whom it waits for, then takes the config that host submits, timed against its default."""
    import torch

    from tunecache.fleet.client import FleetClient
    from tunecache.key import interpreter_device
    from tunecache.store.records import ConfigRecord
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import matmul_portable as mod

    problem = mod.problem(torch.randn(56, 40), torch.randn(40, 36))
    device = interpreter_device()
    key = make_key(mod, problem, device)
    default = mod.default_config(problem, device)
    other = next(c for c in mod.prune(mod.config_space(problem, device), problem, device) if c != default)
    tuning = FleetClient(clean_fleet.url, clean_fleet.tokens["publish"])
    assert tuning.announce(key, "node7 pid 4711").mine
    log = tmp_path / "host.err"
    with open(log, "w") as err:
        host = _host(tmp_path, "host", clean_fleet, stderr=err)

    def waits() -> bool:
        assert host.poll() is None, log.read_text()[-3000:]
        return "waiting for its result" in log.read_text()

    wait_for(waits, 300, interval=0.2, what="the host to say it waits for the other's tune")
    assert tuning.publish(ConfigRecord(key, other, 0.01)).reached
    assert tuning.announce(key, "node7 pid 4711", seconds=0.0).mine  # done: withdrawn
    out, _ = host.communicate(timeout=600)
    said = log.read_text()
    assert host.returncode == 0, said[-3000:]
    assert "is being tuned by test-publish: node7 pid 4711 on the fleet" in said, said[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["config"] == other, "the host did not run the submitted config"
    assert local_counts(_env(tmp_path, "host", clean_fleet))["trials"] <= 2, (
        "the host tuned instead of timing the submitted config"
    )


def test_an_announcement_holds_while_renewed_and_lapses_when_its_host_is_gone(clean_fleet):
    from tunecache.fleet.client import FleetClient
    from tunecache.key import TuneKey

    key = TuneKey("matmul.portable", "v1", "3.9.0", "cpu", 0, {"M": 8, "N": 8, "K": 8, "dtype": "float32"})
    a = FleetClient(clean_fleet.url, clean_fleet.tokens["publish"])
    b = FleetClient(clean_fleet.url, clean_fleet.tokens["worker"])
    assert a.announce(key, "host-a", seconds=1.0).mine
    said = b.announce(key, "host-b")
    assert said.state == "tuning" and said.holder == "test-publish: host-a" and 0 < said.seconds_left <= 1.0
    time.sleep(1.2)  # host-a stopped renewing: the key is free again, and the next host takes it
    assert b.announce(key, "host-b").mine
    assert a.announce(key, "host-a").state == "tuning"


def test_a_hint_is_only_the_announcing_hosts_own_submission(clean_fleet):
    """Another token's submission for the key does not answer an announcement: a hint comes from
    the host that said it tunes the key, whose token the fleet can purge."""
    from support.fleet import result_body
    from tunecache.fleet.client import FleetClient
    from tunecache.key import TuneKey

    problem = {"M": 8, "N": 8, "K": 8, "dtype": "float32"}
    key = TuneKey("matmul.portable", "v1", "3.9.0", "cpu", 0, problem)
    announcer = FleetClient(clean_fleet.url, clean_fleet.tokens["publish"])
    assert announcer.announce(key, "host-a").mine
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    other = clean_fleet.tokens["admin"]  # any token but the announcer's
    with httpx.Client(base_url=clean_fleet.url) as api:
        headers = {"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
        refused = api.post("/v1/jobs/announce", headers=headers, json={**key.fields(), "holder": "x"})
        assert refused.status_code == 403, "announcing takes a publish token, as publishing does"
        sent = api.post(
            "/v1/configs", headers={"Authorization": f"Bearer {other}"}, json=result_body(0.01, config, problem)
        )
        assert sent.status_code == 200, sent.text
    waiter = FleetClient(clean_fleet.url, clean_fleet.tokens["worker"])
    assert waiter.announce(key, "host-b").state == "tuning"
    published = announcer.publish(_record(key, config))
    assert published.reached
    said = waiter.announce(key, "host-b")
    assert said.state == "submitted" and said.hint == config and said.holder == "test-publish: host-a"


def _record(key, config):
    from tunecache.store.records import ConfigRecord

    return ConfigRecord(key, config, 0.02)


def test_a_worker_holding_the_keys_job_is_who_tunes_it(clean_fleet):
    from tunecache.fleet.client import FleetClient
    from tunecache.key import DeviceClass, TuneKey

    key = TuneKey("matmul.portable", "v1", "3.9.0", "cpu", 0, {"M": 8, "N": 16, "K": 8, "dtype": "float32"})
    host = FleetClient(clean_fleet.url, clean_fleet.tokens["publish"])
    assert host.enqueue(key)
    worker = FleetClient(clean_fleet.url, clean_fleet.tokens["worker"])
    job = worker.claim("worker-1", DeviceClass("cpu", 0), lease_s=30)
    assert job is not None and job.digest == key.digest
    said = host.announce(key, "host-a")
    assert said.state == "tuning" and said.holder == "worker worker-1" and 0 < said.seconds_left <= 30


def test_a_worker_does_not_claim_a_key_a_host_is_tuning_until_it_is_done(clean_fleet):
    """One tune per key per fleet, workers included: the key's queued job waits while a host's
    announcement holds, and is claimed once the host withdraws it (its result submitted)."""
    from tunecache.fleet.client import FleetClient
    from tunecache.key import DeviceClass, TuneKey

    key = TuneKey("matmul.portable", "v1", "3.9.0", "cpu", 0, {"M": 16, "N": 16, "K": 8, "dtype": "float32"})
    host = FleetClient(clean_fleet.url, clean_fleet.tokens["publish"])
    worker = FleetClient(clean_fleet.url, clean_fleet.tokens["worker"])
    assert host.enqueue(key) and host.announce(key, "host-a").mine
    assert worker.claim("worker-1", DeviceClass("cpu", 0), lease_s=30) is None, "a worker took a key a host tunes"
    assert host.announce(key, "host-a", seconds=0.0).mine  # done: withdrawn
    job = worker.claim("worker-1", DeviceClass("cpu", 0), lease_s=30)
    assert job is not None and job.digest == key.digest


def test_the_announcements_revision_upgrades_and_downgrades(empty_db_url):
    """Revision 0009 adds the table of announcements and drops it again; the rows of the other
    tables stay."""
    from sqlalchemy import create_engine, inspect

    from support.migrations import downgrade, indexes
    from tunecache.key import TuneKey
    from tunecache.store import Store
    from tunecache.store.migrate import current_revision, head_revision, upgrade

    engine = create_engine(empty_db_url)
    upgrade(engine, "0008")
    assert "tune_announcements" not in inspect(engine).get_table_names()
    upgrade(engine, "0009")
    assert "ix_tune_announcements_digest" in indexes(engine, "tune_announcements")
    downgrade(engine, "0008")
    assert current_revision(engine) == "0008" and "tune_announcements" not in inspect(engine).get_table_names()
    engine.dispose()
    store = Store(empty_db_url)  # migrates to head again
    try:
        assert current_revision(store.engine) == head_revision()
        key = TuneKey("matmul.portable", "v1", "3.9.0", "cpu", 0, {"M": 8})
        assert store.announce(key, "host-a", "lib:a").mine
    finally:
        store.close()


def test_a_hint_is_timed_with_the_default_and_a_hint_that_cannot_run_here_gets_a_whole_tune(db_url):
    import torch

    from tunecache.key import interpreter_device
    from tunecache.tuning.tuner import tune
    from tunecache_kernels import matmul_portable as mod

    problem = mod.problem(torch.randn(40, 24), torch.randn(24, 36))
    device = interpreter_device()
    default = mod.default_config(problem, device)
    space = mod.prune(mod.config_space(problem, device), problem, device)
    hint = next(c for c in space if c != default)
    held = tune(mod, problem, device, hint=hint)
    assert held.config == hint and held.candidates <= 2, (held.config, held.candidates)
    unfit = dict(hint, BLOCK_M=7)  # outside the space: pruned, so only the default would run
    whole = tune(mod, problem, device, hint=unfit)
    assert len(space) > 2 and whole.candidates >= len(space), "a hint that cannot run here: the whole space"
    assert whole.config != unfit
