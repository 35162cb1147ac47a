"""A stuck neighbour never stalls a call (issue 41): a local store that another process holds
locked, a fleet that hangs or dribbles bytes.

Measured before (main at 50d32eb): under policy `default` every miss waited out the busy
timeout on a locked store (3 misses = 187 s at the default 60 s), and a call waited for two fleet
deadlines in a row (GET then POST) before the fleet was given up, and again for the breaker's
trial call after it. Now a call never waits on a write (the store's writer thread makes them
beside it), a locked store costs that thread one busy timeout per process and its writes wait
until the store answers again, and a call waits for one fleet deadline at most: the calls after
it skip the fleet until a background probe finds it back."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.fleet import Server
from support.misses import miss_key, timed_miss
from support.raw_http import RawServer, head

BUSY_S = 2.0  # TUNECACHE_DB_BUSY_TIMEOUT_S
DEADLINE_S = 1.0  # TUNECACHE_SERVER_TIMEOUT_S
PROBE_S = 1.0  # TUNECACHE_BREAKER_OPEN_S: how often a fleet that missed its deadline is asked again
SLACK_S = 0.5  # a small matmul's first launch on the interpreter, on a shared 2-core host


@pytest.fixture
def env(db_url, monkeypatch):
    from tunecache.fleet import client

    monkeypatch.setenv("TUNECACHE_BACKEND", "portable")
    monkeypatch.setenv("TUNECACHE_MISS_POLICY", "default")
    monkeypatch.setenv("TUNECACHE_DB_BUSY_TIMEOUT_S", str(BUSY_S))
    monkeypatch.setenv("TUNECACHE_SERVER_TIMEOUT_S", str(DEADLINE_S))
    monkeypatch.setenv("TUNECACHE_BREAKER_OPEN_S", str(PROBE_S))
    client.reset_clients()
    yield monkeypatch
    client.reset_clients()


def _seconds(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def _until(what: str, ok, timeout: float) -> float:
    """Seconds until `ok()` holds (it must, within `timeout`)."""
    t0 = time.monotonic()
    while not ok():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(0.05)
    return time.monotonic() - t0


# ---- a local store locked by another process -------------------------------------------------


@contextlib.contextmanager
def stuck_writer(path: Path):
    """Another process in the middle of a write transaction on the store, as a stuck one is;
    it lets go when the block ends."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE')\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait(10)


def _store_at_head(db_url: str) -> Path:
    from tunecache.store import Store

    Store(db_url).close()
    return Path(db_url[len("sqlite:///") :])


def _jobs(db_url: str) -> set[str]:
    from tunecache.store import Store

    s = Store(db_url)
    try:
        return {j.key.digest for j in s.list_jobs()}
    finally:
        s.close()


THREE_MISSES = """
import sys, time
import torch
from tunecache import ops
torch.testing.assert_close(torch.ones(2), torch.ones(2))  # its first call imports DTensor (~1 s): not a miss's
t0 = time.perf_counter()
for i in range(3):
    a, b = torch.randn(8 + i, 8), torch.randn(8, 8)
    torch.testing.assert_close(ops.matmul(a, b), a @ b)
print(f"CALLS {time.perf_counter() - t0:.3f}", flush=True)
print(f"DONE {time.time():.3f}", flush=True)
"""


def test_3_misses_of_a_fresh_process_under_a_locked_store_wait_no_busy_timeout(env, db_url):
    """The issue's probe: a fresh process, its store locked by another process throughout,
    policy `default`, 3 misses. Before: 3 busy timeouts (187 s at 60 s); now the calls wait for
    none, and the process's exit waits for one at most (its writer's first write), then says
    what it could not keep."""
    path = _store_at_head(db_url)
    with stuck_writer(path):
        proc = subprocess.run(
            [sys.executable, "-c", THREE_MISSES],
            capture_output=True,
            text=True,
            timeout=300,
        )
        exited = time.time()
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if ln.startswith(("CALLS", "DONE")))
        calls, exit_s = float(lines["CALLS"]), exited - float(lines["DONE"])
        assert calls < BUSY_S, (
            f"3 misses under a locked store took {calls:.2f} s, at most one busy timeout ({BUSY_S:g} s) per "
            f"process (before: one per miss, 3 misses = 3 x {BUSY_S:g} s)"
        )
        assert exit_s < BUSY_S + 2.0, (
            f"the process's exit waited {exit_s:.2f} s for its writes under a locked store: one busy timeout "
            f"({BUSY_S:g} s) at most, then the writes still waiting are given up"
        )
        warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("tunecache:") and "locked" in ln]
        assert len(warned) == 1 and "wait beside the calls until it answers again" in warned[0], proc.stderr[-3000:]
    assert _jobs(db_url) == set(), "the process's writes were given up at its exit, not made after it"


def test_the_writes_of_a_locked_store_wait_aside_and_land_once_it_answers(env, db_url, caplog):
    """In one process: the misses under the lock wait for nothing, the one after the writer
    found the store locked neither; once the lock is let go, the queued keys land (nothing lost)."""
    from tunecache.store import process as process_store

    path = _store_at_head(db_url)
    with stuck_writer(path), caplog.at_level(logging.WARNING, logger="tunecache"):
        times = [timed_miss(i) for i in range(3)]
        assert sum(times) < BUSY_S, (
            f"3 misses under a locked store took {sum(times):.2f} s ({_seconds(times)}), at most one busy "
            f"timeout ({BUSY_S:g} s)"
        )
        waited = _until("the writer finds the store locked", lambda: process_store.is_locked(db_url), BUSY_S + 5)
        later = timed_miss(3)
        assert later < BUSY_S / 2, f"a miss after the store was found locked took {later:.2f} s: it must skip the store"
        assert _jobs(db_url) == set(), "the writes wait while the lock is held"
    let_go = time.monotonic()
    landed = _until("the 4 queued keys land", lambda: _jobs(db_url) == {miss_key(i).digest for i in range(4)}, 10)
    assert not process_store.is_locked(db_url)
    assert landed < PROBE_S + 2.0, f"the queued keys landed {landed:.2f} s after the lock was let go"
    assert time.monotonic() - let_go < PROBE_S + 3.0
    locked = [r.getMessage() for r in caplog.records if "locked by another process" in r.getMessage()]
    assert len(locked) == 1, f"one warning for the lock (the writer found it after {waited:.2f} s): {locked}"


def test_3_results_kept_under_a_locked_store_wait_for_one_busy_timeout(env, db_url):
    """Policy `tune` keeps a result where the call waits (`ConfigCache.keep`): the first keep
    under a lock waits out the busy timeout, the next ones not at all; all three land later."""
    from tunecache.cache.config_cache import ConfigCache
    from tunecache.store import Store
    from tunecache.store.records import ConfigRecord

    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    cache = ConfigCache()
    path = _store_at_head(db_url)
    with stuck_writer(path):
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            kept = cache.keep(ConfigRecord(miss_key(i), cfg, 1.0))
            times.append(time.perf_counter() - t0)
            assert kept.record.config == cfg
        assert sum(times) < BUSY_S + SLACK_S, (
            f"3 results kept under a locked store took {sum(times):.2f} s ({_seconds(times)}): one busy "
            f"timeout ({BUSY_S:g} s) per process at most, not one per result"
        )
    s = Store(db_url)
    try:
        _until("the 3 results land", lambda: all(s.get_config(miss_key(i).digest) for i in range(3)), PROBE_S + 5)
    finally:
        s.close()


# ---- a fleet that hangs or dribbles ------------------------------------------------------------


def _assert_one_deadline_then_skipped(url: str, env) -> None:
    """The first miss waits for one deadline at most (before: GET, then POST); the next ones,
    and those after the breaker's open time, wait for none (the probe asks, not a call)."""
    from tunecache.fleet.client import fleet_client

    env.setenv("TUNECACHE_SERVER_URL", url)
    first = timed_miss(0)
    assert first < DEADLINE_S + SLACK_S, (
        f"a miss under a hanging fleet took {first:.2f} s: one fleet deadline ({DEADLINE_S:g} s) per call at "
        f"most (before: two, GET then POST)"
    )
    assert fleet_client(url).breaker.skips_calls
    times = [timed_miss(i) for i in range(1, 4)]
    time.sleep(PROBE_S * 1.5)  # past the breaker's open time: the probe asks again, and fails
    times += [timed_miss(i) for i in range(4, 7)]
    # a call that asked the fleet waits its deadline at least; one that skips it only the miss's own
    # time (up to 0.63 s seen under a full CI run on the 2-core host)
    assert max(times) < DEADLINE_S, (
        f"the 6 misses after the fleet missed its deadline took {_seconds(times)} s: they must skip it "
        f"(before: the breaker's trial call waited for another deadline)"
    )


def test_a_hanging_fleet_costs_one_call_one_deadline(env, clean_fleet, tmp_path):
    """A real service, stopped (SIGSTOP): its socket accepts, nothing answers. Once it answers
    again the probe lets the calls back, and a miss's key reaches its queue beside the call."""
    from tunecache.fleet.client import fleet_client

    env.setenv("TUNECACHE_TOKEN", clean_fleet.tokens["publish"])
    server = Server(clean_fleet.db_url, tmp_path / "s.log").start()
    try:
        server.pause()
        _assert_one_deadline_then_skipped(server.url, env)
        server.resume()
        back = _until("the probe finds the fleet back", lambda: not fleet_client(server.url).breaker.skips_calls, 10)
        assert back < 2 * PROBE_S + DEADLINE_S + SLACK_S, f"the probe found the fleet back after {back:.2f} s"
        took = timed_miss(7)
        assert took < DEADLINE_S, f"a miss with the fleet back took {took:.2f} s"
        digest = miss_key(7).digest
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {clean_fleet.tokens['read']}"}
        ) as api:
            _until("the miss's key reaches the fleet's queue", lambda: api.get(f"/v1/jobs/{digest}").is_success, 10)
    finally:
        server.stop()


def test_a_dribbling_fleet_costs_one_call_one_deadline(env):
    """A service that sends headers, then its body a byte every 0.3 s (every read on time, the
    whole answer never). Once it answers whole again, the probe lets the calls back."""
    from tunecache.fleet.client import fleet_client

    dribbling = [True]

    def answer(server: RawServer, conn) -> None:
        if not dribbling[0]:
            body = b'{"detail": "not found"}'
            server.send(conn, head("404 Not Found", Content_Length=len(body), Connection="close") + body)
            return
        server.send(conn, head(Content_Length=1000))
        while not server.stop.wait(0.3):
            server.send(conn, b" ")

    server = RawServer(answer)
    env.setenv("TUNECACHE_TOKEN", "tc_whatever")
    try:
        _assert_one_deadline_then_skipped(server.url, env)
        seen = server.requests
        assert seen <= 4, f"{seen} requests: the first miss's lookup and the probes, no call's"
        dribbling[0] = False
        back = _until("the probe finds the fleet back", lambda: not fleet_client(server.url).breaker.skips_calls, 10)
        assert back < 2 * PROBE_S + DEADLINE_S + SLACK_S, f"the probe found the fleet back after {back:.2f} s"
        before = server.requests
        timed_miss(8)
        _until("a miss asks the fleet again", lambda: server.requests >= before + 2, 5)  # lookup, then enqueue
    finally:
        server.close()
