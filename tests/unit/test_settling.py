"""A tuning run's settling round picks the fastest config even when a quick time was lucky.

The quick round times each candidate briefly; its leaders (within LEADER_FACTOR of its best)
are timed again, longer. On an H100 tuning matmul 8192^3, one candidate's quick time came out
low (a cool GPU's boost clock at the start of the round), its settled time did not, and the
configs its lucky time had crowded out of the leaders were never timed again: the winner ran
0.95x the exhaustive best. `timing.settle` re-times whatever lies within reach of the settled
best, so both the tuner and the drop-in autotuner see them.
"""

from __future__ import annotations

from tunecache.tuning.timing import LEADER_FACTOR, MAX_SETTLED, settle


def test_a_lucky_quick_time_no_longer_crowds_out_the_real_winner():
    quick = {"lucky": 1.30, "fast": 1.52, "other": 1.58, "slow": 2.40}
    true_ms = {"lucky": 1.64, "fast": 1.51, "other": 1.57, "slow": 2.40}
    timed = []

    def time_fn(c):
        timed.append(c)
        return true_ms[c]

    settled = settle(quick, time_fn)
    assert min(settled, key=settled.get) == "fast"
    assert "slow" not in timed  # beyond LEADER_FACTOR of any settled time
    assert 1.52 > LEADER_FACTOR * 1.30  # "fast" was no leader by its quick time alone


def test_also_timed_and_failures_never_win():
    quick = {"a": 1.0, "b": 1.05, "default": 3.0}
    settled = settle(quick, lambda c: None if c == "a" else {"b": 1.04, "default": 2.9}[c], also=["default"])
    assert settled["a"] is None and settled["default"] == 2.9
    assert min((c for c, ms in settled.items() if ms is not None), key=settled.get) == "b"


def test_settling_stops_at_max_settled():
    quick = {i: 1.0 + i * 1e-4 for i in range(100)}
    timed = []
    settle(quick, lambda c: timed.append(c) or quick[c])
    assert len(timed) == MAX_SETTLED == len(set(timed))
