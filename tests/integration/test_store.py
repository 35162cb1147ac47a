"""The store behaves the same on SQLite and on the real Postgres server."""

from __future__ import annotations

import pytest

from support.migrations import columns, downgrade, indexes
from tunecache.key import TuneKey
from tunecache.store import ConfigRecord, Store, TrialRecord
from tunecache.store.migrate import current_revision, head_revision
from tunecache.store.transfer import export_configs, import_configs

CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = Store(f"sqlite:///{tmp_path / 's.sqlite'}")
    else:
        s = Store(request.getfixturevalue("pg_url"))
        with s.engine.begin() as conn:  # one database per session: start each test empty
            conn.exec_driver_sql("TRUNCATE tuned_configs, tuning_jobs, trials RESTART IDENTITY")
    yield s
    s.close()


def key(m=64, arch="cpu", sms=0, kernel="matmul.portable"):
    return TuneKey(
        kernel,
        "v1",
        "3.9.0",
        arch,
        sms,
        {"M": m, "N": 64, "K": 64, "dtype": "float32", "a_layout": "row", "b_layout": "row"},
    )


def test_schema_is_at_head_after_open(store):
    assert current_revision(store.engine) == head_revision()


def test_put_get_roundtrip_with_trials(store):
    k = key()
    trials = [TrialRecord(CFG, "ok", 1.0), TrialRecord(dict(CFG, BLOCK_M=64), "failed", error="boom")]
    kept, won = store.put_config(ConfigRecord(k, CFG, 1.0, tflops=2.0, candidates=2), trials)
    assert won
    got = store.get_config(k.digest)
    assert got.config == CFG and got.key == k and got.median_ms == 1.0 and got.tflops == 2.0
    assert [t.status for t in store.trials(k.digest)] == ["ok", "failed"]
    assert store.get_config(key(65).digest) is None


def test_a_runs_many_trials_are_kept_as_given(store):
    """Many trials at once (Postgres takes them by COPY): every field read back as written."""
    k = key(96)
    trials = [
        TrialRecord(dict(CFG, BLOCK_K=16 + i % 3, name='tab\tquote"\\'), "ok", 1.0 + i / 7)
        if i % 2
        else TrialRecord(dict(CFG, GROUP_M=i), "failed", error=f"line\nbreak \u00e9 {i}")
        for i in range(120)
    ]
    store.add_trials(k, trials, run_id="many")
    got = store.trials(k.digest)
    assert sorted((t.status, t.median_ms, t.error, tuple(sorted(t.config.items()))) for t in got) == sorted(
        (t.status, t.median_ms, t.error, tuple(sorted(t.config.items()))) for t in trials
    )


def test_faster_result_wins_with_a_noise_margin(store):
    k = key()
    store.put_config(ConfigRecord(k, CFG, 1.0))
    kept, won = store.put_config(ConfigRecord(k, dict(CFG, BLOCK_M=64), 0.99))  # within noise
    assert not won and kept.config == CFG
    kept, won = store.put_config(ConfigRecord(k, dict(CFG, BLOCK_M=64), 0.5))
    assert won and store.get_config(k.digest).config["BLOCK_M"] == 64
    kept, won = store.put_config(ConfigRecord(k, CFG, 0.9))  # slower than the kept one
    assert not won and store.get_config(k.digest).median_ms == 0.5


def test_list_filters_by_kernel_and_arch(store):
    store.put_config(ConfigRecord(key(1), CFG, 1.0))
    store.put_config(ConfigRecord(key(2, arch="sm_90", sms=132), CFG, 1.0))
    store.put_config(ConfigRecord(key(3, kernel="conv2d_fprop.portable"), CFG, 1.0))
    assert len(store.list_configs()) == 3
    assert len(store.list_configs(arch="sm_90")) == 1
    assert len(store.list_configs(kernel="conv2d_fprop.portable")) == 1


def test_export_import_roundtrip_validates_entries(store, tmp_path):
    store.put_config(ConfigRecord(key(1), CFG, 1.0))
    data = export_configs(store)
    data["configs"].append(dict(data["configs"][0], config={"BLOCK_M": 3}))  # outside the space
    data["configs"].append(dict(data["configs"][0], kernel="nope.portable"))
    data["configs"].append("garbage")
    other = Store(f"sqlite:///{tmp_path / 'other.sqlite'}")
    report = import_configs(other, data)
    assert report["stored"] == 1 and len(report["rejected"]) == 3
    assert other.get_config(key(1).digest).config == CFG
    assert import_configs(other, export_configs(store))["kept"] == 1  # idempotent


def test_one_active_job_per_digest(store):
    a = store.enqueue(key(1))
    b = store.enqueue(key(1), priority=5)
    assert a.id == b.id and b.priority == 5
    assert len(store.list_jobs()) == 1


def test_claim_respects_device_class_and_priority(store):
    store.enqueue(key(1, arch="sm_90", sms=132))
    store.enqueue(key(2, arch="sm_90", sms=114))
    store.enqueue(key(3, arch="sm_90", sms=132), priority=9)
    assert store.claim_job("w", "sm_100", 148) is None
    job = store.claim_job("w", "sm_90", 132)
    assert job.key.problem["M"] == 3 and job.status == "running" and job.attempts == 1
    job = store.claim_job("w", "sm_90", 132)
    assert job.key.problem["M"] == 1
    assert store.claim_job("w", "sm_90", 132) is None


def test_lapsed_lease_is_claimed_again_and_old_owner_loses_it(store):
    store.enqueue(key(1))
    job = store.claim_job("dead", "cpu", 0, lease_s=-1)  # its lease has already run out
    again = store.claim_job("alive", "cpu", 0, lease_s=60)
    assert again.id == job.id and again.attempts == 2
    assert not store.heartbeat(job.id, job.lease_secret), "the dead worker's secret no longer holds the lease"
    assert not store.complete_job(job.id, job.lease_secret)
    assert store.heartbeat(job.id, again.lease_secret)
    assert store.complete_job(job.id, again.lease_secret)
    assert store.get_job(job.digest).status == "done"


def test_failures_back_off_then_fail_with_the_error_kept(store):
    store.enqueue(key(1), max_attempts=2)
    job = store.claim_job("w", "cpu", 0)
    assert store.fail_job(job.id, job.lease_secret, "first", backoff_s=3600) == "queued"
    assert store.claim_job("w", "cpu", 0) is None  # backing off
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE tuning_jobs SET not_before = created_at")
    job = store.claim_job("w", "cpu", 0)
    assert store.fail_job(job.id, job.lease_secret, "second") == "failed"
    assert store.get_job(job.digest).last_error == "second"
    assert store.claim_job("w", "cpu", 0) is None


def test_done_job_without_a_winner_is_requeued(store):
    store.enqueue(key(1))
    job = store.claim_job("w", "cpu", 0)
    store.complete_job(job.id, job.lease_secret)
    assert store.enqueue(key(1)).status == "queued"


def test_head_revision_agrees_with_alembic():
    from alembic.script import ScriptDirectory

    from tunecache.store.migrate import alembic_config

    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_current_head() == head_revision()
    assert len(script.get_heads()) == 1, "revisions must form one line"


def test_default_and_vendor_times_go_with_the_result(store, tmp_path):
    """What tuning bought (the untuned default's time, the vendor op's) is kept with the winner
    and with every submission, and goes where the winner goes: an export, a fleet copy."""
    k = key(7)
    kept, won = store.put_config(ConfigRecord(k, CFG, 1.0, default_ms=1.5, vendor_ms=0.8))
    got = store.get_config(k.digest)
    assert won and (got.default_ms, got.vendor_ms) == (1.5, 0.8)
    assert [(r.default_ms, r.vendor_ms) for r in store.list_configs()] == [(1.5, 0.8)]
    other = Store(f"sqlite:///{tmp_path / 'other.sqlite'}")
    try:
        assert import_configs(other, export_configs(store))["stored"] == 1
        assert (other.get_config(k.digest).default_ms, other.get_config(k.digest).vendor_ms) == (1.5, 0.8)
        assert other.delete_config(k.digest) and other.put_fleet_copy(store.get_config(k.digest), generation=3)
        copy = other.get_config(k.digest)
        assert copy.source == "fleet" and (copy.default_ms, copy.vendor_ms) == (1.5, 0.8)
    finally:
        other.close()
    # a new winner brings its own times (none: not measured)
    kept, won = store.put_config(ConfigRecord(k, dict(CFG, BLOCK_M=64), 0.5))
    got = store.get_config(k.digest)
    assert won and (got.default_ms, got.vendor_ms) == (None, None)
    # the fleet's side: a publish is recorded as a submission, and a winning one carries them to the winner
    kept, won, sid = store.publish(ConfigRecord(k, CFG, 0.25, default_ms=2.0, vendor_ms=0.3), submitted_by="w")
    got = store.get_config(k.digest)
    assert won and (got.default_ms, got.vendor_ms) == (2.0, 0.3)
    _, sub_id, _ = store.submit(ConfigRecord(k, CFG, 0.2, default_ms=4.0), submitted_by="p")
    subs = {s.id: s for s in store.submissions(k.digest)}
    assert (subs[sid].default_ms, subs[sid].vendor_ms, subs[sid].accepted) == (2.0, 0.3, True)
    assert (subs[sub_id].default_ms, subs[sub_id].vendor_ms, subs[sub_id].accepted) == (4.0, None, False)
    assert store.get_config(k.digest).default_ms == 2.0, "a submission never changes the winner"


def test_a_tunes_seconds_stay_with_its_winner_and_are_read_back_as_past_tunes(store):
    """How long a kept tune took here (wall seconds, of them the runner's start) is kept with the
    winner, replaced with it, and read back by past_tunes for the next tune's estimate: the
    kernel's tunes on the device class, newest first; fleet copies and untimed rows left out."""
    k = key(1)
    store.put_config(ConfigRecord(k, CFG, 1.0, candidates=18, tune_seconds=2.5, start_seconds=1.5))
    got = store.get_config(k.digest)
    assert (got.tune_seconds, got.start_seconds) == (2.5, 1.5)
    store.put_config(ConfigRecord(k, dict(CFG, BLOCK_M=64), 2.0, candidates=18, tune_seconds=9.0))
    assert store.get_config(k.digest).tune_seconds == 2.5, "a result that lost keeps nothing of its own"
    store.put_config(ConfigRecord(k, dict(CFG, BLOCK_M=64), 0.5, candidates=20, tune_seconds=3.0))
    got = store.get_config(k.digest)
    assert (got.candidates, got.tune_seconds, got.start_seconds) == (20, 3.0, None), "a new winner: its own"
    store.put_config(ConfigRecord(key(2), CFG, 1.0, candidates=8, tune_seconds=1.0, start_seconds=0.0))
    store.put_config(ConfigRecord(key(3), CFG, 1.0, candidates=8))  # not timed (an import, an older tunecache)
    store.put_config(ConfigRecord(key(4, arch="sm_90", sms=132), CFG, 1.0, candidates=8, tune_seconds=1.0))
    store.put_config(ConfigRecord(key(5, kernel="conv2d_fprop.portable"), CFG, 1.0, candidates=8, tune_seconds=1.0))
    assert store.put_fleet_copy(ConfigRecord(key(6), CFG, 1.0, candidates=8, tune_seconds=1.0), generation=1)
    past = store.past_tunes("matmul.portable", "cpu", 0)
    assert [(r.key.problem["M"], r.tune_seconds) for r in past] == [(2, 1.0), (1, 3.0)]
    assert [r.key.problem["M"] for r in store.past_tunes("matmul.portable", "cpu", 0, limit=1)] == [2]


def step_down(engine, revision: str) -> None:
    """Alembic's downgrade to `revision`: the winners keep their indexes."""
    downgrade(engine, revision)
    assert current_revision(engine) == revision
    assert {"ix_tuned_configs_digest", "ix_tuned_configs_kernel"} <= indexes(engine, "tuned_configs")


def test_the_tune_seconds_revision_upgrades_and_downgrades(empty_db_url):
    """Revision 0008 adds tune_seconds and start_seconds to winners (null for what was stored
    before) and drops them again, keeping the rows, their other columns and their indexes."""
    from sqlalchemy import create_engine

    from tunecache.store.migrate import upgrade

    engine = create_engine(empty_db_url)
    upgrade(engine, "0007")
    assert not {"tune_seconds", "start_seconds"} & columns(engine, "tuned_configs")
    upgrade(engine, "0008")
    assert {"tune_seconds", "start_seconds"} <= columns(engine, "tuned_configs")
    assert "tune_seconds" in columns(engine, "submissions")
    store = Store(empty_db_url)
    try:
        store.put_config(
            ConfigRecord(key(1), CFG, 1.0, candidates=4, default_ms=2.0, tune_seconds=3.0, start_seconds=1.0)
        )
    finally:
        store.close()
    step_down(engine, "0007")
    kept = columns(engine, "tuned_configs")
    assert not {"tune_seconds", "start_seconds"} & kept and {"reports", "default_ms"} <= kept
    engine.dispose()
    store = Store(empty_db_url)  # migrates to head again: the row is kept, its seconds are gone
    try:
        assert current_revision(store.engine) == head_revision()
        got = store.get_config(key(1).digest)
        assert (got.median_ms, got.candidates, got.default_ms) == (1.0, 4, 2.0)
        assert (got.tune_seconds, got.start_seconds) == (None, None)
        assert store.past_tunes("matmul.portable", "cpu", 0) == []
    finally:
        store.close()


def test_the_times_revision_upgrades_and_downgrades(empty_db_url):
    """Revision 0005 adds default_ms and vendor_ms to winners and submissions (null for what was
    stored before) and drops them again, keeping the rows and their indexes."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import IntegrityError

    from tunecache.store.migrate import upgrade

    def times():
        return {"default_ms", "vendor_ms"} & (columns(engine, "tuned_configs") | columns(engine, "submissions"))

    engine = create_engine(empty_db_url)
    upgrade(engine, "0004")
    assert not times()
    upgrade(engine, "0005")
    assert {"default_ms", "vendor_ms"} <= columns(engine, "tuned_configs") & columns(engine, "submissions")
    store = Store(empty_db_url)
    try:
        store.publish(ConfigRecord(key(1), CFG, 1.0, default_ms=2.0, vendor_ms=0.5), submitted_by="w")
        store.put_config(ConfigRecord(key(2), CFG, 1.0))
    finally:
        store.close()
    step_down(engine, "0004")
    assert not times()
    engine.dispose()
    store = Store(empty_db_url)  # migrates to head again: the rows are kept, their times are gone
    try:
        assert current_revision(store.engine) == head_revision()
        got = store.get_config(key(1).digest)
        assert got.median_ms == 1.0 and (got.default_ms, got.vendor_ms) == (None, None)
        assert [(s.median_ms, s.default_ms) for s in store.submissions(key(1).digest)] == [(1.0, None)]
        assert len(store.list_configs()) == 2
        with pytest.raises(IntegrityError):  # the digest is still unique
            with store.engine.begin() as conn:
                conn.exec_driver_sql(
                    "INSERT INTO tuned_configs (digest, kernel, kernel_version, triton_version, "
                    "arch, sm_count, device_name, problem, config, median_ms, candidates, "
                    "tuned_by, tuned_at, source) SELECT digest, kernel, kernel_version, "
                    "triton_version, arch, sm_count, device_name, problem, config, median_ms, "
                    "candidates, tuned_by, tuned_at, source FROM tuned_configs"
                )
    finally:
        store.close()
