"""The tuning estimate (issue 42: "the 'roughly 4 s' estimate took 17.6 s"): one rule for every
announcement, learned from the store's past tunes of the kernel on the device class, a first
guess without them, and it says which."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tunecache.key import DeviceClass, TuneKey
from tunecache.store.records import ConfigRecord
from tunecache.tuning import estimate, isolated
from tunecache.tuning.estimate import TuneEstimate, estimate_tune

CPU = DeviceClass("cpu", 0, "cpu")
H100 = DeviceClass("sm_90", 132, "H100")
MOD = SimpleNamespace(KERNEL="matmul.portable", flops=lambda p: 2.0 * p["M"] * p["N"] * p["K"])


def past(m: int, seconds: float, candidates: int, start: float | None = 0.0) -> ConfigRecord:
    key = TuneKey(MOD.KERNEL, "v1", "3.9.0", "cpu", 0, {"M": m, "N": m, "K": m, "dtype": "float32"})
    return ConfigRecord(key, {}, 1.0, candidates=candidates, tune_seconds=seconds, start_seconds=start)


@pytest.fixture
def runner_start(monkeypatch):
    """The trial runner's start the estimate adds (0: warm), set by the test."""
    start = {"s": 0.0}
    monkeypatch.setattr(isolated, "runner_start_s", lambda torch_device: start["s"])
    return start


def problem(m: int) -> dict:
    return {"M": m, "N": m, "K": m, "dtype": "float32"}


def test_with_no_past_tune_it_is_todays_first_guess_and_says_so(runner_start):
    runner_start["s"] = 4.0
    est = estimate_tune(MOD, problem(64), CPU, 18, "cpu", past=[])
    assert est == TuneEstimate(1.8, 0) and est.text() == "roughly 1.8 s (a first guess)"
    gpu = estimate_tune(MOD, problem(64), H100, 12, "cuda:0", past=[])
    assert gpu.basis == "a first guess"


# first calls on an H200 host with 16 compile workers, each on an empty store and a cold Triton
# cache (`bench_tuning.py --held-out ...`, 9 held-out shapes of 4 kernels, 12-13 candidates
# announced, 13-24 timed): the call's seconds by the trial runner's start (runner_start_s: a
# process that imports torch, which each run's first call started, or a fork of it; 12.2 s: a
# fresh machine's first call, its runner still importing torch when the tune was announced)
COLD_H200_CALLS_S = {4.0: (8.2, 6.5, 12.2), 0.3: (6.1, 5.3, 7.9, 6.5, 5.1, 5.1, 4.8)}


def test_a_gpus_first_guess_is_within_2x_of_cold_first_calls_measured_on_an_h200(runner_start, monkeypatch):
    from tunecache.tuning import compile_pool

    monkeypatch.setattr(compile_pool, "default_workers", lambda: 16)
    for start, calls in COLD_H200_CALLS_S.items():
        runner_start["s"] = start
        guess = estimate_tune(MOD, problem(64), H100, 12, "cuda:0", past=[]).seconds
        assert all(0.5 <= measured / guess <= 2 for measured in calls), (start, guess)


def test_past_tunes_give_the_seconds_a_candidate_takes_their_runner_starts_left_out(runner_start):
    # the first tune here started the runner (2 s of its 2.8); the candidates took 0.04 s each
    est = estimate_tune(MOD, problem(48), CPU, 18, "cpu", past=[past(40, 2.8, 20, start=2.0)])
    assert est.seconds == pytest.approx(18 * 0.04) and est.text() == "roughly 0.7 s (from 1 past tune here)"
    runner_start["s"] = 0.3  # a runner forked from the host's runner server: its start is added once
    assert estimate_tune(MOD, problem(48), CPU, 18, "cpu", past=[past(40, 2.8, 20, start=2.0)]).seconds == (
        pytest.approx(0.3 + 18 * 0.04)
    )


def test_the_median_of_the_past_tunes_nearest_in_size(runner_start):
    # on the interpreter a candidate of a larger problem takes longer: the nearest sizes decide
    small = [past(24, 0.4, 10), past(32, 0.5, 10), past(40, 0.6, 10)]
    large = [past(100, 8.0, 40), past(110, 10.0, 40), past(120, 12.0, 40), past(128, 14.0, 40)]
    est = estimate_tune(MOD, problem(105), CPU, 40, "cpu", past=small + large)
    assert est.past_tunes == estimate.NEAREST
    assert est.seconds == pytest.approx(40 * 0.25)  # median of 0.2, 0.25, 0.3, 0.35 and the 40's 0.06
    # untimed rows (an import, an older tunecache) teach nothing
    untimed = ConfigRecord(past(64, 1.0, 10).key, {}, 1.0, candidates=10)
    assert estimate_tune(MOD, problem(64), CPU, 10, "cpu", past=[untimed]).basis == "a first guess"


def test_a_store_that_cannot_be_read_leaves_the_first_guess(runner_start, monkeypatch):
    from tunecache.cache.config_cache import CACHE

    def broken():
        raise RuntimeError("no store here")

    monkeypatch.setattr(CACHE, "store", lambda: SimpleNamespace(past_tunes=lambda *a: broken()))
    assert estimate_tune(MOD, problem(64), CPU, 18, "cpu") == TuneEstimate(1.8, 0)


def test_durations_are_said_as_precisely_as_an_estimate_is():
    assert [estimate.duration_text(s) for s in (0.01, 0.84, 9.94, 17.6, 250)] == [
        "0.1 s",
        "0.8 s",
        "9.9 s",
        "18 s",
        "4 min",
    ]


def test_the_runners_start_is_learned_from_past_starts_of_its_kind(runner_start):
    # a CPU host starts a fresh runner in ~2 s, not the H100 host's 4; a fork is another kind
    tunes = [past(40, 2.8, 20, start=2.0), past(48, 1.0, 20, start=0.2), past(56, 3.2, 20, start=2.4)]
    runner_start["s"] = 4.0  # a fresh process
    assert estimate_tune(MOD, problem(48), CPU, 20, "cpu", past=tunes).seconds == pytest.approx(2.2 + 20 * 0.04)
    runner_start["s"] = 0.3  # a fork of the host's runner server
    assert estimate_tune(MOD, problem(48), CPU, 20, "cpu", past=tunes).seconds == pytest.approx(0.2 + 20 * 0.04)
    runner_start["s"] = 0.0  # warm: none
    assert estimate_tune(MOD, problem(48), CPU, 20, "cpu", past=tunes).seconds == pytest.approx(20 * 0.04)
    runner_start["s"] = 4.0  # no past start of its kind: the guess
    assert estimate_tune(MOD, problem(48), CPU, 20, "cpu", past=tunes[1:2]).seconds == pytest.approx(4.0 + 20 * 0.04)


def test_a_runner_that_answered_but_still_imports_torch_in_the_background_is_not_warm(monkeypatch):
    """A new host's first call: the launcher starts the runner ahead and it greets at once, but
    its torch import runs seconds more; the announcement made meanwhile counts that start (it
    counted none, and said 3.9 s of a call that took 12.2 s on an H200)."""
    import threading
    import time

    from tunecache.tuning import forkserver

    monkeypatch.setattr(isolated, "_RUNNERS", {})
    monkeypatch.setattr(forkserver, "runner", lambda role, env, fd: None)  # a process of its own
    monkeypatch.setattr(forkserver, "serving", lambda env: False)
    w = isolated.runner_for("cpu")
    greeted, finish = threading.Event(), threading.Event()

    def warm_up() -> None:
        w.warm_up(torch=True)
        greeted.set()
        finish.wait(60)  # the warm-up's end, held until the test lets it go

    try:
        w.in_background(warm_up)
        assert greeted.wait(120), "the runner never answered"
        assert not isolated.runner_is_warm("cpu")
        assert isolated.runner_start_s("cpu") == 4.0
        finish.set()
        deadline = time.monotonic() + 30
        while w.warming and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isolated.runner_is_warm("cpu")
        assert isolated.runner_start_s("cpu") == 0.0
    finally:
        finish.set()
        w.close()
