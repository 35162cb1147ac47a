"""Workers: kill -9 mid-job loses nothing; a job that cannot be tuned ends `failed` with its
error; with no fleet configured a worker serves the local store's queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from support.fleet import host_env, start_worker, wait_for

KILLS = 20
WORKERS_PER_ROUND = 4  # started together, each killed once it holds a lease


def _matmul_key(M, N, K):
    import torch

    from tunecache import backends
    from tunecache.key import interpreter_device
    from tunecache.tuning.tuner import make_key
    from tunecache_kernels import problems

    p = problems.matmul_problem(torch.empty(M, K, device="meta"), torch.empty(K, N, device="meta"))
    return make_key(backends.backend_module("matmul", "portable"), p, interpreter_device())


def _holding(api, pid: int):
    """The running job leased to the worker with this pid, or None."""
    for job in api.get("/v1/jobs", params={"status": "running"}).json():
        if f":{pid}:" in (job["lease_owner"] or ""):
            return job
    return None


def test_kill_minus_9_mid_job_20_times_loses_nothing(clean_fleet, tmp_path):
    fleet = clean_fleet
    # shapes whose tuning takes seconds on the interpreter, so a kill lands mid-job
    keys = [_matmul_key(*s) for s in ((64, 64, 64), (64, 48, 64), (48, 64, 64), (64, 64, 48))]
    api = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens['admin']}"}, timeout=10)
    for k in keys:
        # every lapsed lease spends an attempt (poison-pill protection), and the first jobs
        # in the queue take all the kills: give them room for 20
        r = api.post("/v1/jobs", json={**k.fields(), "max_attempts": KILLS + 5})
        assert r.status_code == 200, r.text
    env = host_env(tmp_path, "workerhost", fleet.url, fleet.tokens["worker"])

    kills, cycle = 0, 0
    t0 = time.monotonic()
    while kills < KILLS:
        cycle += 1
        procs = [
            start_worker(env, tmp_path / f"w{cycle}-{i}.log", "--lease-s", "2", "--poll-s", "0.2")
            for i in range(min(WORKERS_PER_ROUND, KILLS - kills))
        ]
        try:
            pending = list(procs)
            deadline = time.monotonic() + 90
            while pending:
                assert time.monotonic() < deadline, "workers did not lease jobs"
                running = api.get("/v1/jobs", params={"status": "running"}).json()
                for p in list(pending):
                    job = next((j for j in running if f":{p.pid}:" in (j["lease_owner"] or "")), None)
                    if job is None:
                        continue
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(10)
                    pending.remove(p)
                    after = api.get(f"/v1/jobs/{job['digest']}").json()
                    # killed mid-job: it never completed, the lease still names the dead worker
                    assert after["status"] == "running" and f":{p.pid}:" in after["lease_owner"], after
                    kills += 1
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    kill_phase_s = time.monotonic() - t0
    t1 = time.monotonic()

    # fresh workers: every lease runs out, every job is claimed again and completes
    finals = [
        start_worker(env, tmp_path / f"final-{i}.log", "--burst", "--lease-s", "15", "--poll-s", "0.2")
        for i in range(2)
    ]
    for i, p in enumerate(finals):
        assert p.wait(300) == 0, (tmp_path / f"final-{i}.log").read_text()[-3000:]

    jobs = {j["digest"]: j for j in api.get("/v1/jobs").json()}
    assert sorted(jobs) == sorted(k.digest for k in keys), "a job was lost or invented"
    assert all(j["status"] == "done" for j in jobs.values()), jobs
    # each kill spent one attempt of a job that was then claimed again; one more claim each to finish
    assert sum(j["attempts"] for j in jobs.values()) == KILLS + len(keys)
    for k in keys:
        subs = api.get(f"/v1/configs/{k.digest}/submissions").json()
        winner = api.get(f"/v1/configs/{k.digest}").json()
        assert len(subs) == 1 and subs[0]["accepted"], f"exactly one result per key, got {subs}"
        assert winner["config"] == subs[0]["config"] and winner["source"] == "worker"
    configs = api.get("/v1/configs").json()
    assert len(configs) == len(keys)
    print(f"{KILLS} kills in {kill_phase_s:.0f} s, {cycle} rounds; completion {time.monotonic() - t1:.0f} s")


def test_a_job_that_cannot_be_tuned_fails_with_its_error(clean_fleet, tmp_path):
    fleet = clean_fleet
    key = _matmul_key(16, 16, 16)
    broken = {**key.fields(), "problem": {"dtype": "float32"}}  # no sizes: the tuner raises
    api = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens['admin']}"}, timeout=10)
    job = api.post("/v1/jobs", json={**broken, "max_attempts": 1}).json()
    env = host_env(tmp_path, "w", fleet.url, fleet.tokens["worker"])
    p = start_worker(env, tmp_path / "w.log", "--burst", "--poll-s", "0.2")
    assert p.wait(120) == 0, (tmp_path / "w.log").read_text()[-3000:]
    after = api.get(f"/v1/jobs/{job['digest']}").json()
    assert after["status"] == "failed" and after["attempts"] == 1
    assert "KeyError" in after["last_error"], after["last_error"]
    assert api.get(f"/v1/configs/{job['digest']}").status_code == 404


def test_without_a_fleet_the_worker_serves_the_local_queue(tmp_path):
    from tunecache.store import Store

    env = host_env(tmp_path, "solo", None, None)
    store = Store(env["TUNECACHE_DB_URL"])
    key = _matmul_key(32, 32, 32)
    store.enqueue(key)
    p = start_worker(env, tmp_path / "solo.log", "--burst", "--poll-s", "0.2")
    assert p.wait(120) == 0, (tmp_path / "solo.log").read_text()[-3000:]
    assert store.get_job(key.digest).status == "done"
    rec = store.get_config(key.digest)
    assert rec is not None and rec.source == "worker"
    assert store.trials(key.digest), "the worker keeps every trial in the local store"
    store.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_worker_stopped_inside_code_compiled_from_a_string_exits_0(sig):
    """The signal may land while code made from a string runs (a dataclass or namedtuple being
    made, a Triton binder): CPython then exited by SIGINT after the worker had handled it."""
    body = (
        "import os, signal, time\n"
        "import tunecache.fleet.worker as w\n"
        "class Interrupted:\n"
        "    owner, outcomes = 'w', []\n"
        "    def __init__(self, *a, **k): pass\n"
        f"    def run(self, max_jobs=None): exec('os.kill(os.getpid(), {int(sig)}); time.sleep(30)')\n"
        "w.Worker = Interrupted\n"
        "print(w.run_worker())\n"
    )
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[]"), proc.stderr[-2000:]


@pytest.mark.parametrize(
    "sigs",
    [[signal.SIGTERM], [signal.SIGINT], [signal.SIGINT, signal.SIGTERM]],
    ids=["SIGTERM", "SIGINT", "Ctrl-C-then-pretunes-SIGTERM"],
)
def test_a_stopped_worker_releases_its_job_at_once(clean_fleet, tmp_path, sigs):
    fleet = clean_fleet
    key = _matmul_key(64, 64, 64)
    api = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens['admin']}"}, timeout=10)
    api.post("/v1/jobs", json=key.fields())
    env = host_env(tmp_path, "w", fleet.url, fleet.tokens["worker"])
    p = start_worker(env, tmp_path / "w.log", "--lease-s", "600", "--poll-s", "0.2")
    try:
        wait_for(lambda: _holding(api, p.pid), 60, 0.05, "the worker to lease the job")
        for sig in sigs:  # back to back: a second signal must not cut the release short
            p.send_signal(sig)
        assert p.wait(30) == 0, (tmp_path / "w.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    job = api.get(f"/v1/jobs/{key.digest}").json()
    # back in the queue now, not in 600 s, and the interrupted attempt is not counted
    assert job["status"] == "queued" and job["lease_owner"] is None and job["attempts"] == 0, job
