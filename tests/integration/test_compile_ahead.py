"""A tune never waits behind compiles done for a later one, and a compile asked ahead is not
done twice: `tunecache.tune_all` compiles its next shapes' first candidates while it times this
one's (`compile_pool.compile_ahead`), in the same warm compile workers, real ones here."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("triton")

from tunecache.tuning import compile_pool
from tunecache.tuning.compile import canonical_problem, device_for
from tunecache.tuning.isolated import CompilePool, WorkerFailed
from tunecache.tuning.tuner import first_candidates


def _order_of(pool: CompilePool, futures: dict) -> list[str]:
    done: list[str] = []
    lock = threading.Lock()
    for name, f in futures.items():
        f.add_done_callback(lambda _f, name=name: (lock.acquire(), done.append(name), lock.release()))
    for f in futures.values():
        f.result(timeout=120)
    return done


def test_a_task_asked_now_runs_before_every_task_asked_ahead():
    pool = CompilePool(1, dict(os.environ))
    try:
        futures = {f"ahead{i}": pool.submit({"cmd": "hello", "sys_path": []}, 60, ahead=True) for i in range(3)}
        futures["now"] = pool.submit({"cmd": "hello", "sys_path": []}, 60)
        order = _order_of(pool, futures)
    finally:
        pool.close()
    # the one worker took ahead0 first (it was alone then); "now" came before the others
    assert order.index("now") < order.index("ahead1") and order.index("now") < order.index("ahead2"), order


def test_a_task_asked_ahead_and_then_wanted_is_hurried_to_the_front():
    pool = CompilePool(1, dict(os.environ))
    try:
        futures = {f"ahead{i}": pool.submit({"cmd": "hello", "sys_path": []}, 60, ahead=True) for i in range(3)}
        pool.hurry(futures["ahead2"])
        order = _order_of(pool, futures)
    finally:
        pool.close()
    assert order.index("ahead2") < order.index("ahead1"), order


def test_closing_a_pool_drops_its_tasks_asked_ahead_with_a_reason():
    pool = CompilePool(1, dict(os.environ))
    first = pool.submit({"cmd": "hello", "sys_path": []}, 60)
    dropped = [pool.submit({"cmd": "hello", "sys_path": []}, 60, ahead=True) for _ in range(2)]
    pool.close()
    assert not isinstance(first.result(timeout=60), WorkerFailed)  # asked now: answered
    reasons = [f.result(timeout=60) for f in dropped]
    assert all("closed before this task ran" in str(getattr(r, "reason", "")) for r in reasons), reasons


def test_closing_a_pool_stops_its_idle_workers_at_once():
    pool = CompilePool(2, dict(os.environ))
    pids = {pool.submit({"cmd": "hello", "sys_path": []}, 60).result(timeout=60)["pid"] for _ in range(4)}
    time.sleep(0.2)  # both threads back to waiting for a task
    pool.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
        return f.read().split(") ")[1][0] != "Z"


def test_a_tune_takes_over_the_compiles_asked_ahead_of_it_instead_of_compiling_again(monkeypatch):
    from tunecache_kernels import matmul_hopper as mod

    device = device_for("sm_90a")
    problem = canonical_problem("matmul", {"M": 1000, "N": 1000, "K": 1000, "dtype": "bfloat16"})
    configs = first_candidates(mod, problem, device)[:3]
    assert configs, "the ranking offers candidates for a plain bf16 GEMM"
    submitted: list[dict] = []
    real_submit = CompilePool.submit

    def counting_submit(self, msg, timeout, *, ahead=False):
        submitted.append({"ahead": ahead, "cmd": msg["cmd"]})
        return real_submit(self, msg, timeout, ahead=ahead)

    monkeypatch.setattr(CompilePool, "submit", counting_submit)
    asked = compile_pool.compile_ahead(mod, problem, configs, device)
    assert asked >= 1 and all(s["ahead"] for s in submitted)
    n_ahead = len(submitted)
    reports = compile_pool.compile_configs(mod, problem, configs, device)
    assert len(submitted) == n_ahead, f"the tune compiled again what was asked ahead: {submitted[n_ahead:]}"
    assert [r.config for r in reports] == configs
    assert all(r.compiled for r in reports), [r.error for r in reports]
    # and asked again, nothing is pending: the tune compiles (from Triton's cache) on its own
    again = compile_pool.compile_configs(mod, problem, configs, device)
    assert len(submitted) > n_ahead and [r.compiled for r in again] == [r.compiled for r in reports]
