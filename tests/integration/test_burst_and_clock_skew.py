"""Issue 41, item 5, against a real `tunecache serve` on Postgres: a `--burst` worker exits when
nothing it can run is queued (a job for a kernel no host has is not its work), and a token's
expiry is read by the database's clock, as leases are, so a service whose clock is 25 minutes
off still takes a token that expires in 20."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import pytest

from support.fleet import Server, host_env, make_tokens, start_worker

pytestmark = pytest.mark.postgres

# the service's clock, 25 minutes off: `tunecache.store.records.utcnow` is what the service
# read the time from (every `from … import utcnow` binds this one: it is patched first)
SKEWED_CLOCK = """
import datetime as _dt
import tunecache.store.records as _records

_real = _records.utcnow
_records.utcnow = lambda: _real() + _dt.timedelta(minutes={minutes})
"""


def test_a_burst_worker_exits_within_60_s_when_only_a_job_for_a_kernel_it_lacks_is_queued(pg_url, tmp_path):
    from tunecache.store import Store

    Store(pg_url).close()
    tokens = make_tokens(pg_url, prefix="burst")
    server = Server(pg_url, tmp_path / "server.log").start()
    try:
        job = {
            "kernel": "triton:nowhere.kernel",  # a user's kernel that no worker here has
            "kernel_version": "v1",
            "triton_version": "3.9.0",
            "arch": "cpu",
            "sm_count": 0,
            "problem": {"N": 4096},
        }
        r = httpx.post(f"{server.url}/v1/jobs", json=job, headers={"Authorization": f"Bearer {tokens['publish']}"})
        assert r.status_code == 200, r.text
        env = host_env(tmp_path, "burst", server.url, tokens["worker"])
        log = tmp_path / "worker.log"
        start = time.monotonic()
        proc = start_worker(env, log, "--burst", "--poll-s", "0.2")
        try:
            code = proc.wait(60)
        except Exception:
            proc.kill()
            raise AssertionError(
                f"--burst did not exit in 60 s with only a job it cannot run queued:\n{log.read_text()[-2000:]}"
            ) from None
        assert code == 0, log.read_text()[-3000:]
        queued = httpx.get(
            f"{server.url}/v1/jobs", params={"status": "queued"}, headers={"Authorization": f"Bearer {tokens['read']}"}
        ).json()
        assert "triton:nowhere.kernel" in [j["kernel"] for j in queued], "the job stays for a host that has it"
        assert time.monotonic() - start < 60
    finally:
        server.stop()


@pytest.mark.parametrize("minutes", [-25, 25])
def test_a_token_that_expires_in_20_min_works_on_a_service_whose_clock_is_25_min_off(pg_url, tmp_path, minutes):
    from tunecache.store import Store

    store = Store(pg_url)
    name = f"skew-{minutes}-{time.monotonic_ns()}"
    secret, _ = store.create_token(name, ["read"], expires_in=timedelta(minutes=20))
    expired, _ = store.create_token(name + "-old", ["read"], expires_in=timedelta(seconds=1))
    store.close()
    site = tmp_path / "skewed"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEWED_CLOCK.format(minutes=minutes))
    server = Server(pg_url, tmp_path / "server.log", env={"PYTHONPATH": str(site)}).start()
    try:
        ok = httpx.get(f"{server.url}/v1/whoami", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
        assert ok.status_code == 200, f"clock {minutes:+d} min: a token with 20 min left was refused: {ok.text}"
        time.sleep(1.5)
        gone = httpx.get(f"{server.url}/v1/whoami", headers={"Authorization": f"Bearer {expired}"}, timeout=10)
        assert gone.status_code == 401, f"clock {minutes:+d} min: an expired token was taken"
        log = (tmp_path / "server.log").read_text()
        assert "sitecustomize" not in log, log[-2000:]
    finally:
        server.stop()
