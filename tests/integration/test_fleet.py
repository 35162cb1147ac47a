"""Hosts sharing through the fleet: a real `tunecache serve` on loopback over Postgres, and
"hosts" that are separate processes with separate local SQLite stores."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from support import ROOT
from support.fleet import host_env, local_counts, run_host, start_worker, wait_for

# One library call on a host; prints what it launched and where the config came from.
CALL = """
import json, os, time, torch
from tunecache import ops
from tunecache.store import default_store
torch.manual_seed(0)
a, b = torch.randn(40, 24), torch.randn(24, 36)
torch.testing.assert_close(ops.matmul(a, b), a @ b)
(entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
t0, calls = time.monotonic(), 1
while entry.provisional and time.monotonic() - t0 < float(os.environ.get("WAIT_S", "0")):
    time.sleep(0.2)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)   # the same process, no restart
    (entry,) = ops.OP_LAUNCHERS["matmul"].memo.values()
    calls += 1
recs = default_store().list_configs()
print(json.dumps({"config": entry.config, "provisional": entry.provisional, "digest": entry.key.digest,
                  "calls": calls, "local_sources": [r.source for r in recs]}))
"""

# the same call and nothing after it: the process ends at once
BARE_CALL = """
import torch
from tunecache import ops
a, b = torch.randn(40, 24), torch.randn(24, 36)
ops.matmul(a, b)
print("{}")
"""


def _api(fleet, token_scope="admin"):
    return httpx.Client(
        base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.tokens[token_scope]}"}, timeout=10
    )


def test_two_hosts_share_a_config_and_the_second_never_tunes(clean_fleet, tmp_path):
    fleet = clean_fleet
    # host A tunes for the fleet: a worker token (a publish token's result is only a submission
    # until a worker re-times it: tests/integration/test_fleet_trust.py)
    env_a = host_env(tmp_path, "host_a", fleet.url, fleet.tokens["worker"], TUNECACHE_MISS_POLICY="tune")
    env_b = host_env(tmp_path, "host_b", fleet.url, fleet.tokens["read"], TUNECACHE_MISS_POLICY="strict")

    a = run_host(CALL, env_a)
    counts_a = local_counts(env_a)
    assert counts_a["trials"] > 0, "host A had nothing to share, so it must have tuned"
    assert a["local_sources"] == ["inline"]

    with _api(fleet) as api:
        served = api.get(f"/v1/configs/{a['digest']}").json()
        subs = api.get(f"/v1/configs/{a['digest']}/submissions").json()
    assert served["config"] == a["config"]
    assert [s["submitted_by"] for s in subs] == ["test-worker"] and subs[0]["accepted"]
    assert served["source"] == "inline" and served["tuned_by"] != "test-worker", "a worker host says how and where"

    # host B: separate process and store; policy strict would raise if the fleet had nothing
    b = run_host(CALL, env_b)
    counts_b = local_counts(env_b)
    assert b["config"] == a["config"] and not b["provisional"]
    assert counts_b["trials"] == 0, "host B tuned although the fleet had the config"
    assert b["local_sources"] == ["fleet"], "the fleet's answer is written through to the local store"

    # and the write-through means B's next process needs no network at all
    env_b_offline = dict(env_b, TUNECACHE_SERVER_URL="http://127.0.0.1:9")  # discard port: nothing there
    b2 = run_host(CALL, env_b_offline)
    assert b2["config"] == a["config"] and local_counts(env_b)["trials"] == 0

    # a plain script that ends at its first call (the copy is written behind the call, in a
    # thread, while a fresh host's store is first opened) still leaves the copy for the next one
    env_c = host_env(tmp_path, "host_c", fleet.url, fleet.tokens["read"], TUNECACHE_MISS_POLICY="strict")
    run_host(BARE_CALL, env_c)
    c = run_host(CALL, dict(env_c, TUNECACHE_SERVER_URL="http://127.0.0.1:9"))
    assert c["config"] == a["config"] and c["local_sources"] == ["fleet"]


def test_a_miss_is_tuned_by_a_worker_and_picked_up_without_restart(clean_fleet, tmp_path):
    fleet = clean_fleet
    env_host = host_env(
        tmp_path,
        "host",
        fleet.url,
        fleet.tokens["publish"],
        TUNECACHE_MISS_POLICY="default",
        TUNECACHE_RECHECK_S="0.5",
        WAIT_S="240",
    )
    host = subprocess.Popen(
        [sys.executable, "-c", CALL], env=env_host, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    worker = None
    try:
        with _api(fleet) as api:
            jobs = wait_for(lambda: api.get("/v1/jobs").json(), 120, 0.2, "the host to enqueue its miss")
            assert len(jobs) == 1 and jobs[0]["status"] in ("queued", "running")
            env_worker = host_env(tmp_path, "worker", fleet.url, fleet.tokens["worker"])
            worker = start_worker(env_worker, tmp_path / "worker.log", "--burst", "--poll-s", "0.2", "--lease-s", "10")
            out, errs = host.communicate(timeout=300)
            assert host.returncode == 0, errs[-4000:]
            result = json.loads(out.strip().splitlines()[-1])
            assert worker.wait(120) == 0, (tmp_path / "worker.log").read_text()[-3000:]
            job = api.get(f"/v1/jobs/{jobs[0]['digest']}").json()
            served = api.get(f"/v1/configs/{jobs[0]['digest']}").json()
    finally:
        for p in (host, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert job["status"] == "done"
    assert served["source"] == "worker"
    assert not result["provisional"] and result["config"] == served["config"]
    assert result["calls"] > 1, "the host must have run on the default config while the worker tuned"
    assert local_counts(env_host)["trials"] == 0, "policy default must not tune on the host"
    assert result["local_sources"] == ["fleet"]
    log = (tmp_path / "worker.log").read_text()
    assert "worker done: 1 job(s) 1 tuned" in log, log[-2000:]
